"""The lean headers a build tries first (sandbox.lite_headers): torch's factory headers without
the includes their functions do not use, and the lean binding header that takes the place of
``torch/extension.h`` in the C++ file; a candidate that needs more is built again as it wrote it."""
from __future__ import annotations

import subprocess
import sysconfig
import uuid
from pathlib import Path

from sandbox.header_tries import LEAN_NOTE, MINIMAL_NOTE, OWN_NOTE, HeaderTry, binding_tries, next_try, header_tries
from sandbox.pyglue import RAW_BINDING, RAW_NOTE
from sandbox.lite_headers import FACTORY_OPS, LEAN_BINDING, lighten, lite_include_dir
from sandbox.result import Status
from sandbox.tasks import read_spec

ADV = Path(__file__).parent / "adversarial"
TASK = ADV / "task_small.py"

TORCHGEN_LIKE = """#pragma once
#include <ATen/Context.h>
#include <ATen/DeviceGuard.h>
#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <optional>
#include <ATen/ops/empty_like_ops.h>
namespace at {
inline at::Tensor empty_like(const at::Tensor & self) { return at::_ops::empty_like::call(self); }
}
"""


def test_lighten_drops_only_the_includes_the_functions_do_not_use():
    light = lighten(TORCHGEN_LIKE, "empty_like")
    kept = [line for line in light.splitlines() if line.startswith("#include")]
    assert kept == ["#include <ATen/core/Tensor.h>", "#include <c10/core/TensorOptions.h>", "#include <optional>",
                    "#include <ATen/ops/empty_like_ops.h>"]
    assert "// kernelloop: dropped #include <ATen/Context.h>" in light
    assert light.split("namespace at {")[1] == TORCHGEN_LIKE.split("namespace at {")[1]    # torch's own functions
    # a header that is not torchgen's factory header is left alone (the real one is used)
    assert lighten("#include <ATen/core/Tensor.h>\n", "empty_like") is None


def test_the_installed_torch_gets_lighter_headers_that_compile(tmp_path):
    from torch.utils import cpp_extension as ce

    root = Path(lite_include_dir(tmp_path))
    assert lite_include_dir(tmp_path) == str(root)                 # made once
    for op in FACTORY_OPS:
        text = (root / "ATen" / "ops" / f"{op}.h").read_text()
        includes = [line for line in text.splitlines() if line.startswith("#include")]
        assert "#include <ATen/Context.h>" not in includes and f"inline at::Tensor {op}(" in text
    src = tmp_path / "use.cpp"
    src.write_text(f"#include <{LEAN_BINDING['cpu']}>\n"
                   "torch::Tensor f(torch::Tensor x) { return torch::zeros_like(x).add_(torch::full({2}, 1.5)); }\n")
    flags = [f"-I{root}", *(x for p in ce.include_paths("cpu") for x in ("-isystem", p)),
             "-isystem", sysconfig.get_path("include", scheme="posix_prefix"), "-std=c++20", "-fsyntax-only"]
    proc = subprocess.run([ce.get_cxx_compiler(), *flags, str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_binding_tries_put_the_lean_header_first_unless_the_candidate_chose_its_own():
    own = HeaderTry("", [], False)
    lean, last = binding_tries(own, ['#include <torch/extension.h>\ntorch::Tensor f(torch::Tensor);'], ("/lite",), "cpu")
    assert lean.note == LEAN_NOTE and lean.lean_binding and lean.no_implicit_headers
    assert lean.cpp_prefix == (f"#include <{LEAN_BINDING['cpu']}>",) and lean.include_paths == ("/lite",)
    assert lean.cpp == ["\ntorch::Tensor f(torch::Tensor);"]          # torch's heavy header taken out
    assert last is own and not own.lean_binding
    assert binding_tries(own, None, ("/lite",), "cpu") == [own]      # asked for no implicit headers
    assert binding_tries(own, ["x"], (), "cpu") == [own]             # no lighter headers made
    # with torch used in the CUDA sources, the first try is lean on both sides
    first = header_tries(["#include <torch/extension.h>\n__global__ void k() {}"], False, ("/lite",), ["int g();"])[0]
    assert first.lean_binding and first.cpp == ["int g();"]
    # after any failure of the lean try the candidate's own headers decide
    tries = [lean, own]
    assert next_try(tries, 0, "error: 'matmul' is not a member of 'torch'") == 1
    assert next_try(tries, 0, "error: 'j' was not declared in this scope") == 1
    # with the glue library, the raw binding's twin of the lean try goes first (sandbox.pyglue)
    raw, lean2, last2 = binding_tries(own, ['#include <torch/extension.h>\ntorch::Tensor f(torch::Tensor);'], ("/lite",),
                                      "cpu", ["-L/glue", "-l:g.so"])
    assert raw.raw and not lean2.raw and raw.note == RAW_NOTE and lean2 == lean and last2 is own
    assert raw.cpp_prefix == (f"#include <{RAW_BINDING['cpu']}>",) and raw.cpp == lean.cpp
    assert raw.ldflags == ("-L/glue", "-l:g.so") and raw.binding_header == RAW_BINDING["cpu"]
    # its own error (a type its casters lack) goes to the pybind11 twin; the candidate's to its own headers
    assert next_try([raw, lean2, own], 0, "error: incomplete type 'kl_glue::arg<std::map<int, int> >'") == 1
    assert next_try([raw, lean2, own], 0, "error: 'j' was not declared in this scope") == 2
    cuda_tries = header_tries(["#include <torch/extension.h>\n__global__ void k() {}"], False, ("/lite",), ["int g();"],
                              ["-l:g.so"])
    assert [t.raw for t in cuda_tries] == [True, False, False, False] and cuda_tries[0].note == MINIMAL_NOTE
    assert next_try(cuda_tries, 0, "error: 'j' was not declared in this scope") == 3        # MINIMAL -> own
    assert next_try(cuda_tries, 0, 'error: namespace "torch" has no member "matmul"') == 2  # MINIMAL -> TYPES


def test_a_cpu_candidate_builds_with_the_lean_header_or_else_with_its_own(sandbox):
    spec = read_spec(TASK, name="adversarial/task_small")
    honest = (ADV / "cpu" / "honest.py").read_text().replace("(p[i] > 0.f", f"/* {uuid.uuid4().hex} */ (p[i] > 0.f")
    lean = sandbox.evaluate(spec, honest)
    assert lean.status is Status.correct and lean.build.notes == [RAW_NOTE], lean.build.notes
    # a name the lean header lacks: built again with torch/extension.h, and still correct
    needs_more = honest.replace("  return y;\n}\ntorch::Tensor uninit_like",
                                "  return torch::matmul(y, torch::eye(y.size(1), y.options()));\n}\n"
                                "torch::Tensor uninit_like")
    assert needs_more != honest
    full = sandbox.evaluate(spec, needs_more)
    assert full.build.notes == [f"not {RAW_NOTE}: tried {OWN_NOTE}"], full.build.notes
    assert full.status is Status.correct, full


def test_a_candidate_that_includes_torch_extension_itself_gets_the_lean_header_too(sandbox):
    """The builtin proposer writes ``#include <torch/extension.h>`` and asks for no implicit
    headers; on the H200 its builds took 24 s with torch's 790 MB precompiled header."""
    spec = read_spec(TASK, name="adversarial/task_small")
    honest = (ADV / "cpu" / "honest.py").read_text().replace("(p[i] > 0.f", f"/* {uuid.uuid4().hex} */ (p[i] > 0.f")
    own = honest.replace('CPP = r"""\n', 'CPP = r"""\n#include <torch/extension.h>\n').replace(
        'functions=["relu_scale", "uninit_like"])', 'functions=["relu_scale", "uninit_like"], no_implicit_headers=True)')
    assert own.count("no_implicit_headers=True") == 1 and "#include <torch/extension.h>" in own
    r = sandbox.evaluate(spec, own)
    assert r.status is Status.correct and r.build.notes == [RAW_NOTE], r.build.notes
