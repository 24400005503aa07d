"""Triton's real front end for kernels that ran in the interpreter: what would not compile on a
GPU is a compile error on the CPU too, with Triton's own message and line.

Under ``TRITON_INTERPRET=1`` nothing compiles: a kernel whose ``tl.arange`` bound is not a
``tl.constexpr``, say, runs in the interpreter and fails on every GPU. So each launch's signature
(argument types and ``tl.constexpr`` values) is recorded in the candidate worker (``signature_of``),
and after the warm-up forward a child process with the interpreter off (``python -m
sandbox.backends.triton_frontend``) imports the candidate module afresh and lowers each launched
kernel to TTIR for an ``sm_90`` target: Triton's code generator and semantic checks, which need no
GPU. A child process, because the interpreter's state (``triton.language``'s jit functions as
interpreted ones, its patched builtins) would mislead the code generator in the worker itself.

The child answers one JSON line: ``{"ok": true, "notes": [...]}`` or ``{"error": {"kernel",
"type", "message", "lineno"}}``, ``lineno`` counted from the kernel's ``def`` (Triton's own).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from typing import Any, Optional

CHILD_TIMEOUT_S = 300.0
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int8": "i8",
           "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1"}
# keyword arguments of a launch that are options, not kernel arguments
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                  "launch_pdl", "debug", "sanitize_overflow", "instrumentation_mode"}


def _arg_type(value: Any) -> Optional[str]:
    import torch

    if isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
        return "*" + _DTYPES[name] if name in _DTYPES else None
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else ("u64" if value >= 2**63 else "i64")
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "constexpr"
    return None


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation
    return ann is not inspect.Parameter.empty and "constexpr" in (ann if isinstance(ann, str) else
                                                                  getattr(ann, "__name__", str(ann)))


def signature_of(py_fn: Any, args: tuple, kwargs: dict) -> Optional[tuple[dict[str, str], dict[str, Any]]]:
    """The (signature, constexprs) of one launch of the kernel ``py_fn`` (its Python function), or
    None where an argument has a type this check does not know (the GPU's compiler alone decides)."""
    sig = inspect.signature(py_fn)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    bound.apply_defaults()
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if _is_constexpr(sig.parameters[name]):
            if not isinstance(value, (int, float, bool, str, type(None))):
                return None
            signature[name], constexprs[name] = "constexpr", value
            continue
        kind = _arg_type(value)
        if kind is None:
            return None
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = value
    return signature, constexprs


def check(source: str, launches: list[dict[str, Any]], cwd: Optional[str] = None) -> dict[str, Any]:
    """Lower every launched kernel in a child process with the interpreter off (see the module)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        proc = subprocess.run([sys.executable, "-m", "sandbox.backends.triton_frontend"], cwd=cwd, env=env,
                              input=json.dumps({"source": source, "launches": launches}), capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"notes": [f"Triton's front end did not run: {type(exc).__name__}: {exc}"[:300]]}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    return {"notes": [f"Triton's front end gave no answer (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"]}


def _lower_all(source: str, launches: list[dict[str, Any]]) -> dict[str, Any]:
    import linecache

    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction

    linecache.cache["candidate.py"] = (len(source), None, source.splitlines(True), "candidate.py")
    namespace: dict[str, Any] = {"__name__": "kernelloop_candidate", "__file__": "candidate.py"}
    try:
        exec(compile(source, "candidate.py", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - the worker imported it: the difference is not the kernels'
        return {"notes": [f"the candidate module did not import without the interpreter: {type(exc).__name__}: {exc}"[:300]]}
    kernels: dict[str, Any] = {}
    for value in namespace.values():
        fn = value
        while fn is not None and not isinstance(fn, JITFunction):       # triton.autotune/heuristics wrap it
            fn = getattr(fn, "fn", None)
        if isinstance(fn, JITFunction):
            kernels[fn.fn.__name__] = fn
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    notes: list[str] = []
    for launch in launches:
        fn = kernels.get(launch["kernel"])
        if fn is None:
            notes.append(f"{launch['kernel']}: not a module-level kernel, not lowered on the CPU")
            continue
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        try:
            ASTSource(fn, launch["signature"], launch["constexprs"]).make_ir(
                target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
        except Exception as exc:  # noqa: BLE001
            if type(exc).__name__ in ("CompilationError", "CompileTimeAssertionFailure", "UnsupportedLanguageConstruct"):
                node = getattr(exc, "node", None)
                return {"error": {"kernel": launch["kernel"], "type": type(exc).__name__, "message": str(exc),
                                  "lineno": getattr(node, "lineno", None)}}
            notes.append(f"{launch['kernel']}: not lowered on the CPU ({type(exc).__name__}: {exc})"[:300])
    return {"ok": True, "notes": notes}


def main() -> None:
    request = json.loads(sys.stdin.read())
    result = _lower_all(request["source"], request["launches"])
    sys.stdout.write("\n" + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
