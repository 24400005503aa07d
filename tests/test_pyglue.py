"""The raw binding (sandbox.pyglue): a candidate's functions bound through the CPython API and
kernelloop's glue library read arguments, give results and raise errors as load_inline's
pybind11 binding does; a type its casters lack is built again with pybind11."""
from __future__ import annotations

import uuid
import warnings

import pytest
import torch

from sandbox.build import HookedBuilder
from sandbox.header_tries import LEAN_NOTE
from sandbox.pyglue import RAW_NOTE, function_docs, module_definition

SOURCE = r"""
#include <torch/extension.h>
torch::Tensor scale(torch::Tensor x, double s, int64_t n) {
  TORCH_CHECK(n >= 0, "n must be >= 0");
  return x.mul(s).add(n);
}
std::vector<torch::Tensor> two(const torch::Tensor& a, torch::Tensor& b) { return {a.add(1), b.mul(2)}; }
std::tuple<torch::Tensor, int64_t> summed(torch::Tensor a, std::vector<int64_t> dims, bool flag) {
  return {a.sum(dims), flag ? 1 : 0};
}
void bump(torch::Tensor a, c10::optional<torch::Tensor> b) { if (b) a.add_(*b); else a.add_(1); }
torch::Tensor warned(torch::Tensor a) { TORCH_WARN("careful with ", a.size(0)); return a; }
torch::Tensor filled(at::IntArrayRef shape, double v) { return torch::full(shape, v); }
std::string named(std::string s, float f) { return s + std::to_string(static_cast<int>(f)); }
"""
FUNCTIONS = ["scale", "two", "summed", "bump", "warned", "filled", "named"]


@pytest.fixture(scope="module")
def builder():
    from torch.utils import cpp_extension

    original = cpp_extension.load_inline
    b = HookedBuilder()
    b.install()
    try:
        yield b
    finally:
        cpp_extension.load_inline = original


@pytest.fixture(scope="module")
def bound(builder):
    """The test source built once, its module and build record."""
    return build(builder, SOURCE, FUNCTIONS)


def build(builder: HookedBuilder, source: str, functions):
    from torch.utils import cpp_extension

    module = cpp_extension.load_inline(name="glue_test", cpp_sources=[f"{source}\n// {uuid.uuid4().hex}"],
                                       functions=functions)
    return module, builder.records[-1]


def test_functions_are_bound_without_pybind11_and_convert_as_load_inline_does(builder, bound):
    m, record = bound
    assert record.ok and record.notes == [RAW_NOTE], record.notes
    assert "PYBIND11_MODULE" not in (builder.cache_root / record.name / "main.cpp").read_text()
    x = torch.arange(4.0)
    assert torch.equal(m.scale(x, 2.0, 3), x * 2 + 3) and torch.equal(m.scale(x, 2, 3), x * 2 + 3)   # an int as a float
    a, b = m.two(x, x)
    assert torch.equal(a, x + 1) and torch.equal(b, x * 2)
    total, flag = m.summed(torch.ones(2, 3), [1], True)
    assert torch.equal(total, torch.full((2,), 3.0)) and flag == 1 and type(flag) is int
    y = torch.zeros(3)
    m.bump(y, None)
    m.bump(y, torch.ones(3))
    assert torch.equal(y, torch.full((3,), 2.0))                    # in place, through both optional branches
    assert torch.equal(m.filled((2, 2), 1.5), torch.full((2, 2), 1.5)) and m.filled([3], 2.0).shape == (3,)
    assert m.named("k", 7.9) == "k7"
    assert torch.equal(m.scale(x, torch.tensor(2.0), torch.tensor(3.0)), x * 2 + 3)   # 0-d tensors, as pybind11 reads them
    p = torch.nn.Parameter(torch.ones(2))
    assert torch.equal(m.scale(p, 1.0, 0), p.detach())              # a Tensor subclass is a Tensor
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m.warned(x)
    assert any("careful with 4" in str(w.message) for w in seen)    # TORCH_WARN as a Python warning


@pytest.mark.parametrize("call, error, words", [
    (lambda m, x: m.scale(x, 2.0, -1), RuntimeError, "n must be >= 0"),       # TORCH_CHECK, as torch raises it
    (lambda m, x: m.scale(x, "a", 1), TypeError, "expected a float"),
    (lambda m, x: m.scale(x, 2.0, 1.5), TypeError, "expected an int"),        # pybind11 refuses a float too
    (lambda m, x: m.scale(x), TypeError, "1 positional arguments given, 3 taken"),
    (lambda m, x: m.scale(1, 2.0, 1), TypeError, "expected a Tensor"),
    (lambda m, x: m.scale(x, s=2.0, n=1), TypeError, "keyword"),               # torch binds positionally
    (lambda m, x: m.summed(x, "ab", True), TypeError, "expected a sequence"),
])
def test_wrong_arguments_and_candidate_errors_raise_what_pybind11_would(bound, call, error, words):
    with pytest.raises(error, match=words):
        call(bound[0], torch.arange(4.0))


def test_a_type_the_casters_lack_is_built_with_pybind11_instead(builder):
    source = SOURCE + "int64_t counted(std::map<std::string, int64_t> m) { return (int64_t) m.size(); }\n"
    m, record = build(builder, source, [*FUNCTIONS, "counted"])
    assert record.notes == [f"not {RAW_NOTE}: tried {LEAN_NOTE}", LEAN_NOTE], record.notes
    assert m.counted({"a": 1, "b": 2}) == 2


def test_function_names_and_docstrings_are_read_as_torch_reads_them():
    assert function_docs("f") == {"f": "f"} and function_docs(["f", "g"]) == {"f": "f", "g": "g"}
    assert function_docs({"f": 'says "hi"'}) == {"f": 'says "hi"'}
    assert function_docs(None) is None and function_docs([1]) is None
    text = module_definition({"f": 'says "hi"'})
    assert 'KL_GLUE_FN(f, "says \\"hi\\"")' in text and "PyInit_" in text
