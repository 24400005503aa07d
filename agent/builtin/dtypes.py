"""The storage types the generated kernels read and write, and the run's precision.

Every generated kernel computes in ``float``: a tensor of ``float16`` or ``bfloat16`` is loaded
through ``c10::Half``/``c10::BFloat16`` (both convert to and from ``float`` in the C++ and the
CUDA templates), every operator and every reduction's accumulation runs in ``float`` (the CPU
statistics in ``double``), and a result is rounded to its tensor's type once, on store. A tensor
of any other dtype (float64, integers, bool) keeps its operators on PyTorch.

The run's precision arrives as a ``sandbox.numerics.Numerics`` (or anything with its
``precision``, ``cast`` and ``cast_model``); ``None`` is float32. The generator itself never
imports pydantic, so it runs where only torch and jinja2 are installed.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from agent.builtin.ops import ModuleAttr, tensor_meta

# torch dtype -> (C++ element type, ATen scalar type, name in messages)
KERNEL_DTYPES: dict[torch.dtype, tuple[str, str, str]] = {
    torch.float32: ("float", "at::kFloat", "float32"),
    torch.float16: ("c10::Half", "at::kHalf", "float16"),
    torch.bfloat16: ("c10::BFloat16", "at::kBFloat16", "bfloat16"),
}
PRECISION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def value_dtype(value: Any) -> Optional[torch.dtype]:
    """The dtype of a node's tensor or of a module's tensor operand; None where unknown."""
    if isinstance(value, ModuleAttr):
        return value.dtype
    tm = tensor_meta(value)
    return tm.dtype if tm is not None else None


def supported(dtype: Optional[torch.dtype]) -> bool:
    return dtype in KERNEL_DTYPES


def c_type(dtype: torch.dtype) -> str:
    return KERNEL_DTYPES[dtype][0]


def at_type(dtype: torch.dtype) -> str:
    return KERNEL_DTYPES[dtype][1]


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    if dtype in KERNEL_DTYPES:
        return KERNEL_DTYPES[dtype][2]
    return str(dtype).replace("torch.", "") if dtype is not None else "unknown"


def is_half(dtype: torch.dtype) -> bool:
    """A 2-byte floating type: loaded and stored as such, computed in float."""
    return dtype in (torch.float16, torch.bfloat16)


def precision_of(numerics: Any) -> str:
    """``fp32 | fp16 | bf16`` of a ``Numerics`` (``None``: fp32)."""
    p = getattr(numerics, "precision", None) or "fp32"
    if p not in PRECISION_DTYPES:
        raise ValueError(f"unknown precision {p!r}")
    return p


def cast_values(numerics: Any, values: Any) -> Any:
    """Floating-point tensors among ``values`` in the run's precision (``Numerics.cast``)."""
    return numerics.cast(values) if numerics is not None else values


def cast_model(numerics: Any, model: Any) -> Any:
    """The model's parameters and buffers in the run's precision (``Numerics.cast_model``)."""
    return numerics.cast_model(model) if numerics is not None else model
