"""The C expressions of the builtin generator's elementwise operators, shared by the CUDA and the
C++ (OpenMP) templates (``agent.builtin.ops`` classifies nodes into them): only the C math library's
float functions (``expf``, ``tanhf`` ...) and the helpers ``templates/common.h.j2`` defines for both
(``kl_softplus``, ``kl_mish`` ...), and float literals that say what float32 makes of a value.
"""
from __future__ import annotations

import math
from typing import Any

import torch

# --------------------------------------------------------------------------------------
# C expressions of the elementwise operators.  ``{a}``/``{b}`` are operand expressions
# (always a variable name or a literal, so repeating them costs nothing); other names are
# the operator's parameters, rendered as float literals.
# --------------------------------------------------------------------------------------
UNARY: dict[str, str] = {
    "relu": "({a} < 0.f ? 0.f : {a})",
    "neg": "(-{a})",
    "copy": "({a})",
    "abs": "fabsf({a})",
    "exp": "expf({a})",
    "log": "logf({a})",
    "log1p": "log1pf({a})",
    "expm1": "expm1f({a})",
    "sqrt": "sqrtf({a})",
    "rsqrt": "(1.f / sqrtf({a}))",
    "square": "({a} * {a})",
    "reciprocal": "(1.f / {a})",
    "erf": "erff({a})",
    "sigmoid": "(1.f / (1.f + expf(-{a})))",
    "tanh": "tanhf({a})",
    "silu": "({a} / (1.f + expf(-{a})))",
    "gelu": "(0.5f * {a} * (1.f + erff({a} * 0.70710678118654752f)))",
    "gelu_tanh": "(0.5f * {a} * (1.f + tanhf(0.79788456080286536f * ({a} + 0.044715f * {a} * {a} * {a}))))",
    "mish": "kl_mish({a})",
    "hardswish": "({a} * kl_clampf({a} + 3.f, 0.f, 6.f) / 6.f)",
    "hardsigmoid": "(kl_clampf({a} + 3.f, 0.f, 6.f) / 6.f)",
    "selu": "(1.0507009873554805f * ({a} > 0.f ? {a} : 1.6732632423543772f * expm1f({a})))",
    "logsigmoid": "(fminf({a}, 0.f) - log1pf(expf(-fabsf({a}))))",
    "softsign": "({a} / (1.f + fabsf({a})))",
    "sin": "sinf({a})",
    "cos": "cosf({a})",
    # parametrised unary operators
    "leaky_relu": "({a} > 0.f ? {a} : {a} * {negative_slope})",
    "elu": "({a} > 0.f ? {a} : {alpha} * expm1f({a}))",
    "softplus": "kl_softplus({a}, {beta}, {threshold})",
    "clamp_min": "kl_maxf({a}, {lo})",
    "clamp_max": "kl_minf({a}, {hi})",
    "clamp": "kl_minf(kl_maxf({a}, {lo}), {hi})",
    "hardtanh": "kl_minf(kl_maxf({a}, {lo}), {hi})",
}

BINARY: dict[str, str] = {
    "add": "({a} + {b})",
    "sub": "({a} - {b})",
    "mul": "({a} * {b})",
    "div": "({a} / {b})",
    "maximum": "kl_maxf({a}, {b})",
    "minimum": "kl_minf({a}, {b})",
    "pow": "powf({a}, {b})",
}


# --------------------------------------------------------------------------------------
# Literals and expressions
# --------------------------------------------------------------------------------------
def c_float(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    f32 = torch.tensor(v, dtype=torch.float32).item()
    if math.isinf(f32):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    text = repr(v)
    if "e" not in text and "." not in text:
        text += ".0"
    return f"{text}f" if not text.startswith("-") else f"({text}f)"


def ew_expr(op: str, args: list[str], params: dict[str, Any]) -> str:
    """The C expression of one elementwise operator applied to operand expressions."""
    p = {k: c_float(v) for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if op in ("add_alpha", "sub_alpha"):
        sign = "+" if op == "add_alpha" else "-"
        return f"({args[0]} {sign} {p['alpha']} * {args[1]})"
    if op == "masked_fill":            # the mask as a float: 0 or 1
        return f"({args[1]} != 0.f ? {p['value']} : {args[0]})"
    if op == "cube":
        return f"({args[0]} * {args[0]} * {args[0]})"
    if op in BINARY:
        return BINARY[op].format(a=args[0], b=args[1])
    if op in UNARY:
        return UNARY[op].format(a=args[0], **p)
    raise KeyError(op)
