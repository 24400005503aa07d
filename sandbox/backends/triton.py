"""The ``triton`` backend: ``@triton.jit`` kernels launched from ``ModelNew.forward``.

Parent side only (no Triton import here): the static scan with Triton's ways to lower
precision, and compiler errors mapped to the candidate's line. The worker side, which imports
Triton, is ``sandbox.backends.triton_hook``.

How it is judged, the same as CUDA:

* **built from** the candidate module alone: its ``@triton.jit`` functions (the kernels) and
  the Python that launches them. The build worker runs the module (a syntax error, or a Triton
  error raised while it is imported, is a compile error at its line); the candidate worker
  compiles each kernel on its first launch in a **warm-up** forward before the trials and
  timing, with ``TRITON_CACHE_DIR`` in the worker's own fresh temporary directory, which no
  other candidate's worker is told of and which is removed with the worker;
* **its own kernels** are the ``@triton.jit`` functions defined in the candidate's module:
  every launch of one (``kernel[grid](...)``, through ``triton.autotune`` and
  ``triton.heuristics`` too) is counted and wrapped in a ``kernelloop_ext::<name>`` profiler
  range; on a GPU the profiler's kernels are matched against their names (Triton names a
  kernel after its function). A forward without such a launch is ``no_custom_kernel``;
* **on the CPU** kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, NumPy). The
  interpreter compiles nothing, so each kernel's first launch with a new signature is also run
  through Triton's real front end (the code generator to TTIR for an ``sm_90`` target, which
  needs no GPU): what would not compile on the GPU is a compile error here too. The interpreter
  computes ``tl.dot`` exactly whatever its ``input_precision``; the harness rounds float32
  operands to TF32 where the GPU would use TF32 (Triton's default for float32 ``tl.dot``), so
  the float64 rule measures that loss on the CPU as on the GPU.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from kernelloop import pyast
from sandbox import anticheat
from sandbox.result import Flag, FlagKind

PRECISION_PATTERNS = [*anticheat.PRECISION_PATTERNS,
                      (re.compile(r"\btl\.(float16|bfloat16|float8\w*)\b|\btriton\.language\.(float16|bfloat16)\b"),
                       "computes in Triton half types (tl.float16/tl.bfloat16/float8)"),
                      (re.compile(r"input_precision\s*=\s*['\"]tf32['\"]"), "asks tl.dot for TF32 inputs"),
                      (re.compile(r"\bTRITON_F32_DEFAULT\b"), "changes Triton's default float32 dot precision"),
                      (re.compile(r"\bfast_(expf|dividef|logf|sinf|cosf|powf|tanf)\b"),
                       "uses fast-math approximations (libdevice fast_*)")]
PATCHABLE_ROOTS = anticheat.PATCHABLE_ROOTS | {"triton", "tl"}
_FULL_PRECISION = {"ieee", "tf32x3"}
CANDIDATE_FILE = "candidate.py"
# what the worker side writes for a failed build: "candidate.py:LINE: error: MESSAGE"
_ERROR_LINE_RE = re.compile(r"^candidate\.py:(\d+): error: (.*)$", re.MULTILINE)
_TRACEBACK_LINE_RE = re.compile(r'File "candidate\.py", line (\d+)')


def _tf32_dots(source: str) -> bool:
    """Whether a ``tl.dot`` call leaves its precision to Triton's default (TF32 for float32 on
    the GPU) or asks for TF32: neither ``input_precision="ieee"``/``"tf32x3"`` nor
    ``allow_tf32=False`` is passed."""
    try:
        tree = pyast.parse(source)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (anticheat.dotted_name(node.func) or "").endswith(("tl.dot", "language.dot")):
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            prec, allow = kw.get("input_precision"), kw.get("allow_tf32")
            if isinstance(prec, ast.Constant) and prec.value in _FULL_PRECISION:
                continue
            if isinstance(allow, ast.Constant) and allow.value is False:
                continue
            return True
    return False


class TritonBackend:
    no_call_reason = "no launch of the candidate's own @triton.jit kernels during a forward"

    def __init__(self, name: str, device: str):
        import importlib.util

        from sandbox.backends import BackendError

        if importlib.util.find_spec("triton") is None:
            raise BackendError("the triton backend needs the triton package (pip install 'triton>=3.9,<3.10'; "
                               "CUDA builds of torch bring it)")
        self.name, self.device = name, device

    def scan(self, source: str) -> list[Flag]:
        flags = anticheat.scan(source, PRECISION_PATTERNS, PATCHABLE_ROOTS)
        if _tf32_dots(source):
            flags.append(Flag(kind=FlagKind.precision, reason="tl.dot on float32 computes in TF32 unless "
                              "input_precision=\"ieee\" (or \"tf32x3\") is passed"))
        return flags

    def first_error(self, log: str, source: str, build_dirs: list[str]) -> tuple[Optional[str], Optional[int]]:
        m = _ERROR_LINE_RE.search(log)
        if m:
            return m.group(0)[:500], int(m.group(1))
        lines = _TRACEBACK_LINE_RE.findall(log)
        last = next((ln for ln in reversed(log.strip().splitlines()) if ln.strip()), None)
        return (last[:500] if last else None), (int(lines[-1]) if lines else None)

    def worker_env(self) -> dict[str, str]:
        """On the CPU the interpreter, before anything imports Triton: ``triton.language``'s own jit
        functions are interpreted ones only if it is set when Triton is first imported (torch's
        profiler and compiler import Triton where it is installed)."""
        return {"TRITON_INTERPRET": "1"} if self.device != "cuda" else {}

    def hook(self, max_jobs: Optional[int] = None):
        from sandbox.backends.triton_hook import TritonHook

        return TritonHook(self.device)
