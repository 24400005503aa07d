"""Triton's real front end on the CPU: a kernel launched under the interpreter is also lowered to
TTIR for a GPU target (``sm_90``: no GPU is needed for this stage), so code that would not compile
on a GPU is a compile error under the interpreter too, with Triton's own message and line."""
from __future__ import annotations

from typing import Any, Optional

import torch

_TARGET = None
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
           torch.bool: "i1"}
# keyword arguments of a launch that are options, not kernel arguments
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                  "launch_pdl", "debug", "sanitize_overflow", "instrumentation_mode"}


def _arg_type(value: Any) -> Optional[str]:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype] if value.dtype in _DTYPES else None
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else ("u64" if value >= 2**63 else "i64")
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "constexpr"
    return None


def signature_of(fn: Any, args: tuple, kwargs: dict) -> Optional[tuple[dict[str, str], dict[str, Any]]]:
    """The (signature, constexprs) of one launch, or None where an argument has a type this
    check does not know (then the GPU's compiler alone decides)."""
    bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    bound.apply_defaults()
    constexpr_names = {p.name for p in fn.params if p.is_constexpr}
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[name] = value
            continue
        kind = _arg_type(value)
        if kind is None:
            return None
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = value
    return signature, constexprs


def as_jit(fn: Any, memo: Optional[dict[int, Any]] = None) -> Any:
    """A ``JITFunction`` of an interpreted kernel (``InterpretedFunction``), whose globals hold
    the callees it reaches as ``JITFunction``s too (the code generator calls only those)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    memo = {} if memo is None else memo
    if id(fn) in memo:
        return memo[id(fn)]
    jit = JITFunction(fn.fn)
    memo[id(fn)] = jit
    shadow = dict(jit.__globals__)
    for k, v in list(shadow.items()):
        if isinstance(v, InterpretedFunction):
            shadow[k] = as_jit(v, memo)
    jit.__globals__ = shadow
    return jit


def lower(jit: Any, signature: dict[str, str], constexprs: dict[str, Any]) -> None:
    """Lower ``jit`` (``as_jit`` of an interpreted kernel) to TTIR for ``sm_90``; raises Triton's
    ``CompilationError`` where it does not compile."""
    global _TARGET
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    if _TARGET is None:
        target = GPUTarget("cuda", 90, 32)
        _TARGET = (target, make_backend(target))
    target, backend = _TARGET
    options = backend.parse_options({})
    src = ASTSource(jit, signature, constexprs)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
