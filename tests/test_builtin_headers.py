"""The builtin's C++ file includes every header in its leading block: that block is what the
sandbox precompiles as the prefix header (``sandbox.pch.leading_includes``; docs/builds.md), and a
header included below it is parsed again by every build (the split-TF32 GEMMs' ATen headers, mid-file,
took 5 of the file's 6.7 CPU seconds). The GEMMs' block itself calls the Tensor methods, not the
``ATen/ops`` functions, whose headers cost every build that takes them even precompiled. (The cpu
target's C++ file holds the kernels first and the wrappers after them; the sandbox's binding header
takes the place of its ``torch/extension.h`` and the standard headers below are already included.)"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.builtin import generate
from sandbox.pch import leading_includes
from sandbox.tasks import discover, read_spec

TASKS = discover(["seeds", "level2"])
NETWORKS = [Path(__file__).parent / "fixtures" / "builtin" / f"{n}.py" for n in ("graph_net", "segsum")]


def _cpp_source(candidate: str) -> str:
    m = re.search(r'_CPP_SOURCE = r"""\n(.*?)\n"""', candidate, re.S)
    assert m, "the candidate has no _CPP_SOURCE"
    return m.group(1)


def test_every_include_of_the_cuda_candidates_cpp_file_is_in_its_leading_block():
    device = "cuda"
    with_gemms = 0
    for path in [*TASKS, *NETWORKS]:
        spec = read_spec(path, name=f"{path.parent.name}/{path.stem}")
        cpp = _cpp_source(generate(spec, device).source)
        block, rest = leading_includes(cpp)
        below = [line for line in rest if line.lstrip().startswith("#include")]
        assert below == [], f"{spec.name} ({device}): {below}"
        if "kl_tc_linear" in cpp or "kl_tc_matmul" in cpp:
            with_gemms += 1
            assert "#include <ATen/Context.h>" in block, spec.name
            assert not any("ATen/ops/" in line for line in block), spec.name
            assert "at::addmm(" not in cpp and "at::mm(" not in cpp, spec.name
        else:
            assert "#include <ATen/Context.h>" not in block, spec.name   # the others' prefix header stays small
    assert with_gemms > 0
