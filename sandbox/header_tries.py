"""Which headers a build tries, in which order (``sandbox.build.HookedBuilder.load_inline``).

A candidate's C++ and CUDA sources are first built with lighter headers than the ones it names
(``sandbox.lite_headers``: minimal ATen headers in the CUDA file; in the C++ file, the raw
binding of ``sandbox.pyglue`` and then the lean pybind11 binding header in place of
``<torch/extension.h>``), and last with its own: where the lighter ones fail for a reason of the
candidate's code, the candidate's own headers decide the verdict, so the swap never turns a
failing candidate into a passing one or back.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from sandbox.cuda_split import split_cuda
from sandbox.lite_headers import LEAN_BINDING, MINIMAL_TORCH_PRELUDE
from sandbox.pyglue import GLUE_ERROR_MARK, RAW_BINDING, RAW_NOTE

EXTENSION_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]torch/(?:extension|torch|all)\.h[>"][ \t]*(//.*)?$',
                                   re.MULTILINE)
_TORCH_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]torch/(?:extension|torch|all|types)\.h[>"][ \t]*(//.*)?$',
                               re.MULTILINE)
_PYTHON_USE_RE = re.compile(r"\bPYBIND11_|\bpy::|\bpybind11::|torch/python\.h|Python\.h")
# nvcc's words for a torch name the minimal headers lack (the next, fuller headers may have it)
_MISSING_TORCH_NAME_RE = re.compile(r'namespace "(?:torch|at|c10)[\w:]*" has no member|identifier "(?:torch|at|c10)::'
                                    r'|name followed by "::" must be a class or namespace name'   # torch::nn::...
                                    r'|no operator "[^"]+" matches these operands'      # tensor operators
                                    # and GCC's words, for the C++ file
                                    r"|is not a member of .(?:torch|at|c10)\b|.(?:torch|at|c10)::[\w:]+. has not been declared"
                                    r"|no match for .operator")

MINIMAL_NOTE = "CUDA sources built with minimal ATen headers in place of torch's"
CUDA_SPLIT_ENV = "KERNELLOOP_CUDA_SPLIT"
SPLIT_NOTE = ("CUDA sources split: the kernels built by nvcc without torch's headers, their torch wrappers "
              "as C++ with launch stubs (sandbox.cuda_split)")
SPLIT_FULL_NOTE = "CUDA sources split, the wrappers' C++ file on <torch/extension.h> (precompiled)"
LEAN_NOTE = "C++ bindings built with the lean binding header in place of <torch/extension.h>"
TYPES_NOTE = "CUDA sources built with <torch/types.h> in place of <torch/extension.h>"
OWN_NOTE = "the candidate's own headers"


@dataclass(frozen=True)
class HeaderTry:
    """One way to build the CUDA sources: lighter headers first, the candidate's own last."""
    note: str                       # what a success says; "" for the candidate's own headers
    cuda: list[str]
    no_implicit_headers: bool
    cpp_prefix: tuple[str, ...] = ()  # what load_inline's implicit headers would have put first in C++
    include_paths: tuple[str, ...] = ()  # put first on the include path (sandbox.lite_headers)
    cpp: Optional[list[str]] = None      # the C++ sources where they differ from the candidate's
    ldflags: tuple[str, ...] = ()        # the raw binding's: the glue library (sandbox.pyglue)

    @property
    def raw(self) -> bool:
        """The C++ file binds through the CPython API (``sandbox.pyglue``), not pybind11."""
        return any(line == f"#include <{h}>" for h in RAW_BINDING.values() for line in self.cpp_prefix)

    @property
    def binding_header(self) -> Optional[str]:
        """The lean or raw binding header the C++ file starts with, not torch/extension.h; None if neither."""
        return next((h for h in (*LEAN_BINDING.values(), *RAW_BINDING.values()) for line in self.cpp_prefix
                     if line == f"#include <{h}>"), None)

    @property
    def lean_binding(self) -> bool:
        return self.binding_header is not None


def _lean_try(note: str, cuda: list[str], cpp: list[str], lite_dirs: tuple[str, ...], device: str) -> HeaderTry:
    """A try whose C++ file starts with the lean binding header, torch's own headers taken out."""
    return HeaderTry(note, cuda, True, (f"#include <{LEAN_BINDING[device]}>",), tuple(lite_dirs),
                     [_TORCH_INCLUDE_RE.sub("", s) for s in cpp])


def _with_raw(tries: list[HeaderTry], glue: Optional[list[str]], device: str) -> list[HeaderTry]:
    """``tries`` with the raw binding's twin of each try that uses the lean binding header before
    it: ``glue`` is the glue library's link flags, None where the raw binding cannot serve."""
    if glue is None:
        return tries
    out = []
    for t in tries:
        if t.lean_binding:
            out.append(HeaderTry(t.note if t.note != LEAN_NOTE else RAW_NOTE, t.cuda, True,
                                 (f"#include <{RAW_BINDING[device]}>",), t.include_paths, t.cpp, tuple(glue)))
        out.append(t)
    return out


def split_enabled() -> bool:
    """KernelBench-style sources are built split first unless ``KERNELLOOP_CUDA_SPLIT=0``. On since
    session s: on an H200 host the adversarial suite's 39 CUDA verdicts were unchanged with the split
    on, a split candidate was judged correct and clean (``tests/test_cuda_split.py -m gpu``), and a
    KernelBench-style build took 1.1 s where the whole file took 7.2 s (``bench_build.py``, side by side)."""
    return os.environ.get(CUDA_SPLIT_ENV, "1") != "0"


def _split_try(cuda: list[str], cpp: list[str], lite_dirs: tuple[str, ...]) -> Optional[HeaderTry]:
    """The CUDA sources split (``sandbox.cuda_split``): kernels without torch through nvcc, the
    wrappers in the C++ file with the lean binding header; None where a source does not split
    or the split is off (``split_enabled``)."""
    if not split_enabled():
        return None
    splits = [split_cuda(s) for s in cuda]
    if not splits or any(sp is None for sp in splits):
        return None
    return _lean_try(SPLIT_NOTE, [sp.device for sp in splits], [sp.host for sp in splits] + cpp, lite_dirs, "cuda")


def _split_full_try(split: HeaderTry) -> HeaderTry:
    """``split`` with the wrappers' C++ file on torch's whole ``torch/extension.h`` (its precompiled
    header), for wrappers that call torch beyond the lean binding's minimal headers (``torch::matmul``)."""
    return HeaderTry(SPLIT_FULL_NOTE, split.cuda, True, ("#include <torch/extension.h>",), (), split.cpp)


def header_tries(cuda: list[str], no_implicit_headers: bool, lite_dirs: tuple[str, ...] = (),
                 cpp: Optional[list[str]] = None, glue: Optional[list[str]] = None) -> list[HeaderTry]:
    """How to build CUDA sources that use torch, fastest first.

    KernelBench-style candidates put their torch wrappers in the ``.cu`` file, and nvcc parses
    the torch headers three times (host preprocessing, cudafe++ and cicc, then the host
    compiler): on a 2-core host a one-kernel candidate took 98 s with ``torch/extension.h``,
    45 s with ``torch/types.h`` and about half that with the minimal ATen headers. So:

    0. unless ``KERNELLOOP_CUDA_SPLIT=0`` (``split_enabled``), where the sources split
       (``sandbox.cuda_split``: kernels launched from torch wrappers, the C++ file on the lean
       binding header), the kernels through nvcc without torch and the wrappers in the C++ file;
       where that lacks a torch name, the same with the C++ file on ``torch/extension.h``; any
       other failure goes on to 1;
    1. the minimal prelude (``MINIMAL_TORCH_PRELUDE``) in place of every torch header, its
       factory headers lightened where ``lite_dirs`` are given (``sandbox.lite_headers``, and
       the directory of its precompiled lean binding header): then the C++ file too starts
       with the lean binding header in place of ``torch/extension.h`` (``cpp``: the C++
       sources, where load_inline's or the candidate's own ``torch/extension.h`` leads them);
    2. where that lacks a torch name, ``torch/types.h`` in place of ``torch/extension.h``;
    3. the candidate's own headers: where the lighter ones do not build, this build decides the
       verdict, so the swap never turns a failing candidate into a passing one or back.

    Sources that bind to Python themselves are built as they are (the bindings that
    ``load_inline`` generates live in the C++ file, which keeps ``torch/extension.h``). With
    ``glue`` (``_with_raw``), each lean try's twin with the raw binding goes before it.
    """
    own = HeaderTry("", cuda, no_implicit_headers)
    if any(_PYTHON_USE_RE.search(s) for s in cuda):
        return [own]
    minimal = ["#include <cuda.h>", "#include <cuda_runtime.h>", MINIMAL_TORCH_PRELUDE] + [
        _TORCH_INCLUDE_RE.sub("", s) for s in cuda]
    # no implicit headers for the CUDA sources means none for the C++ side either: it keeps its own
    split = None
    if lite_dirs and cpp is not None:
        first = _lean_try(MINIMAL_NOTE, minimal, cpp, lite_dirs, "cuda")
        split = _split_try(cuda, cpp, lite_dirs)
    elif no_implicit_headers:
        first = HeaderTry(MINIMAL_NOTE, minimal, True, (), tuple(lite_dirs))
    else:
        first = HeaderTry(MINIMAL_NOTE, minimal, True, ("#include <torch/extension.h>",), tuple(lite_dirs))
    tries = [*([split, _split_full_try(split)] if split else []), first]
    if any(EXTENSION_INCLUDE_RE.search(s) for s in cuda):
        tries.append(HeaderTry(TYPES_NOTE, [EXTENSION_INCLUDE_RE.sub("#include <torch/types.h>", s) for s in cuda],
                               no_implicit_headers))
    return _with_raw(tries + [own], glue, "cuda")


def binding_tries(own: HeaderTry, cpp: Optional[list[str]], lite_dirs: tuple[str, ...], device: str,
                  glue: Optional[list[str]] = None) -> list[HeaderTry]:
    """How to build sources whose CUDA side (if any) does not use torch: the C++ file with the
    lean binding header first (``sandbox.lite_headers``) where load_inline would have put
    ``torch/extension.h`` there (``cpp``: the candidate's C++ sources; None where it asked for no
    implicit headers), then as ``own`` says."""
    if cpp is None or not lite_dirs:
        return [own]
    return _with_raw([_lean_try(LEAN_NOTE, own.cuda, cpp, lite_dirs, device), own], glue, device)


def next_try(tries: list[HeaderTry], failed: int, error: str) -> Optional[int]:
    """The try after ``tries[failed]`` failed with ``error``: the fuller headers only where the
    error names a missing torch name, else straight to the candidate's own headers."""
    if failed + 1 >= len(tries):
        return None
    if tries[failed].raw:
        # the raw binding's own error (a type its casters lack): its pybind11 twin next; any
        # other error is the candidate's, which the twin would meet too
        return failed + 1 if GLUE_ERROR_MARK in error else next_try(tries, failed + 1, error)
    if tries[failed].note == MINIMAL_NOTE and tries[failed + 1].note == TYPES_NOTE \
            and not _MISSING_TORCH_NAME_RE.search(error):
        return len(tries) - 1
    if tries[failed].note == SPLIT_NOTE and tries[failed + 1].note == SPLIT_FULL_NOTE \
            and not _MISSING_TORCH_NAME_RE.search(error):
        # not a torch name the wrappers lack: the whole file, whose own build decides
        return next((i for i in range(failed + 1, len(tries)) if tries[i].note == MINIMAL_NOTE), failed + 1)
    return failed + 1
