"""The ``triton`` backend's worker side (see ``sandbox.backends.triton``): installed before the
candidate's module runs, it registers the candidate's ``@triton.jit`` functions as they are
defined, counts and labels their launches, warms them up, and turns compile failures into
failed builds at the candidate's line."""
from __future__ import annotations

import json
import linecache
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from sandbox.build import BuildRecord, CallCounter

CANDIDATE_FILE = "candidate.py"
CANDIDATE_MODULE = "kernelloop_candidate"


def _is_candidates(py_fn: Any) -> bool:
    code = getattr(py_fn, "__code__", None)
    return getattr(py_fn, "__module__", None) == CANDIDATE_MODULE or (
        code is not None and code.co_filename == CANDIDATE_FILE)


def _def_line(source: str, py_fn: Any) -> Optional[int]:
    """The line of ``def name(`` of a candidate function (decorators stand above it)."""
    first = getattr(getattr(py_fn, "__code__", None), "co_firstlineno", 1)
    lines = source.splitlines()
    for i in range(max(first, 1), len(lines) + 1):
        if lines[i - 1].lstrip().startswith(f"def {py_fn.__name__}("):
            return i
    return None


class TritonHook:
    def __init__(self, device: str):
        self.device = device
        self.counter = CallCounter()
        self.failures: list[BuildRecord] = []
        self.kernels: dict[str, Any] = {}      # name -> the candidate's Python function
        self.source = ""
        self.interpret = device != "cuda"
        self.cache_dir = ""
        self.launches: dict[str, dict[str, Any]] = {}   # launch signatures seen under the interpreter
        self.checked: set[str] = set()                     # ... and lowered by Triton's front end
        self.notes: list[str] = []
        self._t0 = time.perf_counter()

    # ---- BuildHook -----------------------------------------------------------------
    @property
    def records(self) -> list[BuildRecord]:
        ok = BuildRecord("triton", "triton", self.cache_dir, round(time.perf_counter() - self._t0, 3), False, True,
                         "", self.device == "cuda", self.kernel_names(), list(self.notes))
        return list(self.failures) if self.failures else [ok]

    def install(self, source: str = "") -> None:
        """Before ``import triton`` in the candidate: the interpreter on the CPU, a cache of this
        worker's own; the candidate's source where ``inspect`` finds it (Triton reads a kernel's
        source); then Triton's kernel classes instrumented."""
        self.source = source
        cache = Path.cwd() / "triton-cache"
        cache.mkdir(mode=0o700, exist_ok=True)
        self.cache_dir = str(cache)
        os.environ["TRITON_CACHE_DIR"] = self.cache_dir
        if self.interpret:
            os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")      # Triton 3.9 warns where it is unset
        linecache.cache[CANDIDATE_FILE] = (len(source), None, source.splitlines(True), CANDIDATE_FILE)
        from triton.runtime import interpreter
        from triton.runtime.jit import JITFunction

        for cls in (JITFunction, interpreter.InterpretedFunction):
            self._instrument(cls)
        self._tf32_dots(interpreter)
        self.notes.append("Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1); the kernels a warm-up "
                          "forward launches before the trials are also lowered to TTIR for sm_90 by Triton's front end" if self.interpret else
                          "Triton kernels compiled on first launch, in a warm-up forward before the trials")

    def import_failed(self, exc: BaseException) -> None:
        """A syntax error (the kernels are Python: it is their compile error) or a Triton compile
        error while the module ran is a failed build; any other error at import stays a load error,
        as for every backend."""
        if isinstance(exc, SyntaxError) or _is_compilation_error(exc):
            self._fail(exc, self._line_of(exc))

    def kernel_names(self) -> list[str]:
        return sorted(self.kernels)

    def warm_up(self, model: Any, make_args: Callable[[int], Sequence[Any]]) -> Optional[BaseException]:
        import torch

        try:
            with torch.no_grad():
                model(*make_args(0))
            if self.device == "cuda":
                torch.cuda.synchronize()
        except BaseException as exc:  # noqa: BLE001 - only a compile failure is the build's; the trials report the rest
            if _is_compilation_error(exc):
                self._fail(exc, self._line_of(exc))
                return exc
        # under the interpreter: what ran (or began to) lowered by Triton's front end, as a GPU would
        return self._front_end() if self.interpret else None

    # ---- instrumentation -----------------------------------------------------------
    def _instrument(self, cls: type) -> None:
        hook = self
        init, run = cls.__init__, cls.run
        if getattr(run, "_kernelloop", False):
            return

        def registering_init(self, fn, *args, **kwargs):
            init(self, fn, *args, **kwargs)
            if _is_candidates(fn):
                hook.kernels[fn.__name__] = fn

        def counted_run(self, *args, grid, warmup, **kwargs):
            fn = getattr(self, "fn", None)
            if warmup or not _is_candidates(fn):
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            import torch

            if hook.interpret:
                hook._record(fn, args, kwargs)
            hook.counter.calls += 1
            hook.counter.by_function[fn.__name__] = hook.counter.by_function.get(fn.__name__, 0) + 1
            with torch.profiler.record_function(f"kernelloop_ext::{fn.__name__}"):
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)

        counted_run._kernelloop = True  # type: ignore[attr-defined]
        cls.__init__, cls.run = registering_init, counted_run

    def _record(self, py_fn: Any, args: tuple, kwargs: dict) -> None:
        """Under the interpreter: the launch's signature, for Triton's front end after the warm-up."""
        from sandbox.backends.triton_frontend import signature_of

        try:
            sig = signature_of(py_fn, args, kwargs)
        except TypeError:
            return                  # the launch itself fails the same way in the interpreter
        if sig is None:
            self.notes.append(f"{py_fn.__name__}: an argument of a type the CPU's front-end check does not know")
            return
        key = json.dumps([py_fn.__name__, sig[0], sig[1]], sort_keys=True, default=repr)
        if key not in self.launches:
            self.launches[key] = {"kernel": py_fn.__name__, "signature": sig[0], "constexprs": sig[1]}

    def _front_end(self) -> Optional[BaseException]:
        """The launches recorded so far lowered by Triton's front end (``triton_frontend``); its
        compile error, if any."""
        from sandbox.backends.triton_frontend import check

        todo = [v for k, v in self.launches.items() if k not in self.checked]
        if not todo:
            return None
        self.checked.update(self.launches)
        answer = check(self.source, todo, self.cache_dir and str(Path(self.cache_dir).parent))
        self.notes.extend(answer.get("notes", []))
        err = answer.get("error")
        if not err:
            return None
        exc = TritonCompileError(f"{err['type']} in {err['kernel']}: {err['message']}")
        start = _def_line(self.source, self.kernels[err["kernel"]]) if err["kernel"] in self.kernels else None
        line = start + err["lineno"] - 1 if start is not None and err.get("lineno") else None
        self._fail(exc, line)
        return exc

    def _tf32_dots(self, interpreter: Any) -> None:
        """The interpreter's ``tl.dot`` computes float32 exactly; the GPU rounds float32 operands to
        TF32 where ``input_precision`` is TF32 (Triton's default). Round them here too."""
        builder = interpreter.InterpreterBuilder
        create_dot = builder.create_dot
        if getattr(create_dot, "_kernelloop", False):
            return
        import numpy as np

        def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if "TF32" in str(input_precision).upper() and "X3" not in str(input_precision).upper():
                if a.data.dtype == np.float32:
                    a = interpreter.TensorHandle(interpreter._round_f32_to_tf32(a.data), a.dtype)
                if b.data.dtype == np.float32:
                    b = interpreter.TensorHandle(interpreter._round_f32_to_tf32(b.data), b.dtype)
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

        dot._kernelloop = True  # type: ignore[attr-defined]
        builder.create_dot = dot

    # ---- errors --------------------------------------------------------------------
    def _line_of(self, exc: BaseException) -> Optional[int]:
        """The candidate line an error points at: a syntax error's, a Triton compile error's
        (its line counts from the kernel's ``def``), else the last candidate frame's."""
        if isinstance(exc, SyntaxError) and exc.filename == CANDIDATE_FILE:
            return exc.lineno
        if _is_compilation_error(exc):
            node, name = getattr(exc, "node", None), None
            for kname, fn in self.kernels.items():
                if exc.src and f"def {kname}(" in str(exc.src):
                    name = kname
                    break
            if node is not None and name is not None and getattr(node, "lineno", None):
                start = _def_line(self.source, self.kernels[name])
                if start is not None:
                    return start + node.lineno - 1
        tb, line = exc.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == CANDIDATE_FILE:
                line = tb.tb_lineno
            tb = tb.tb_next
        return line

    def _fail(self, exc: BaseException, line: Optional[int]) -> None:
        message = str(exc).strip().splitlines()
        detail = next((m for m in reversed(message) if m.strip()), type(exc).__name__) if message else type(exc).__name__
        head = f"{CANDIDATE_FILE}:{line}: error: " if line is not None else "error: "
        log = f"{head}{type(exc).__name__}: {detail.strip()}\n{exc}"
        self.failures.append(BuildRecord("triton", "triton", self.cache_dir, round(time.perf_counter() - self._t0, 3),
                                         False, False, log[-20_000:], self.device == "cuda", self.kernel_names(),
                                         list(self.notes)))


class TritonCompileError(Exception):
    """Triton's front end refused a kernel that the interpreter ran (``triton_frontend``)."""


def _is_compilation_error(exc: BaseException) -> bool:
    return any(c.__name__ in ("CompilationError", "CompileTimeAssertionFailure", "UnsupportedLanguageConstruct")
               and c.__module__.startswith("triton") for c in type(exc).__mro__)
