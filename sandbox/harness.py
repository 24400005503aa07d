"""Harness helpers shared by the reference and candidate workers (and baselines).

Conventions (KernelBench's): the same seed before each constructor gives ``Model`` and
``ModelNew`` identical weights; inputs come from ``get_inputs()`` under a seed, made on
the target device; under a ``Numerics`` of fp16 or bf16 both are cast to that dtype.
Models stay in training mode, as KernelBench leaves them.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from sandbox.numerics import Numerics
from sandbox.tasks import LoadedTask


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)   # seeds the CPU and every CUDA generator


def to_device(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def make_inputs(task: LoadedTask, seed: int, device: str, numerics: Optional[Numerics] = None) -> list[Any]:
    """``get_inputs()`` under ``seed`` on ``device``, floating-point tensors in the precision of ``numerics``."""
    seed_all(seed)
    with torch.device(device):
        inputs = task.get_inputs()
    inputs = [to_device(x, device) for x in inputs]
    return numerics.cast(inputs) if numerics is not None else inputs


def make_model(cls: type, task: LoadedTask, seed: int, device: str,
               numerics: Optional[Numerics] = None) -> torch.nn.Module:
    """``cls(*get_init_inputs())`` with the seed set before each; tensors among the init inputs
    and the model's parameters and buffers in the precision of ``numerics`` (KernelBench's casts)."""
    seed_all(seed)
    init = task.get_init_inputs()
    if numerics is not None:
        init = numerics.cast(init)
    seed_all(seed)
    with torch.device(device):
        model = cls(*init)
    if isinstance(model, torch.nn.Module):
        model = model.to(device)
    return numerics.cast_model(model) if numerics is not None else model


def flatten_outputs(out: Any) -> list[Any]:
    """A forward's result as a list: a tensor, or a (nested) tuple/list of them."""
    if isinstance(out, (list, tuple)):
        flat: list[Any] = []
        for item in out:
            flat.extend(flatten_outputs(item))
        return flat
    return [out]


def is_plain_tensor(x: Any) -> bool:
    return type(x) is torch.Tensor or type(x) is torch.nn.Parameter
