"""What a forward pass must do at the least: its FLOPs and the bytes that must cross the memory bus.

Two counts describe a task at its sizes:

* **FLOPs** of the forward, as ``torch.utils.flop_counter.FlopCounterMode`` counts them
  (matrix products, convolutions, attention; elementwise work counts 0), split by the
  dtype each counted op computes in.
* **Minimum bytes**: what has to cross the memory bus at least once: every input tensor,
  every parameter and buffer, and every output, each counted once. Intermediates are not
  counted (a perfect fusion keeps them on chip).

The forward runs on ``meta`` tensors (shapes and dtypes only), so counting works for
GPU-sized tasks without allocating anything; models that do not run on ``meta`` are tried
again under ``FakeTensorMode``. ``hardware.floors`` turns the counts into a time with a
device probe (``hardware.probe``). ``sandbox.tasks.count_task`` counts a task spec at a
device's sizes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch.utils import flop_counter
from torch.utils._pytree import tree_flatten

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32",
    torch.int64: "int64", torch.bool: "bool", torch.complex64: "complex64",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = "fp8"


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass
class RooflineCounts:
    """FLOPs and minimum memory traffic of one forward pass at one set of sizes."""

    flops: int
    min_bytes: int
    dtype: str                                                      # the task's compute dtype, e.g. "fp32"
    flops_by_dtype: dict[str, int] = field(default_factory=dict)    # "fp32" -> FLOPs
    flops_by_op: dict[str, int] = field(default_factory=dict)       # "aten.addmm" -> FLOPs
    # fp32 FLOPs that PyTorch may run on TF32 tensor cores: {"conv": n, "matmul": n}.
    tf32_eligible: dict[str, int] = field(default_factory=dict)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)     # inputs | parameters | buffers | outputs
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    input_shapes: list[list[int]] = field(default_factory=list)
    output_shapes: list[list[int]] = field(default_factory=list)
    method: str = "meta"                                            # meta | fake

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte of the minimum traffic."""
        return self.flops / self.min_bytes if self.min_bytes else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- counting

_CONV_OPS = {"convolution", "_convolution", "cudnn_convolution", "convolution_overrideable",
             "_slow_conv2d_forward", "convolution_backward"}
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm"}


def _op_class(op: Any) -> Optional[str]:
    """``conv`` or ``matmul`` for ops whose fp32 form cuDNN/cuBLAS may run in TF32, else None."""
    name = str(getattr(op, "__name__", op)).split(".")[-1]
    return "conv" if name in _CONV_OPS else "matmul" if name in _MATMUL_OPS else None


class _DtypeRecorder:
    """Wraps the flop formulas so each counted op also records its dtype (and TF32 eligibility)."""

    def __init__(self) -> None:
        self.by_dtype: dict[str, int] = {}
        self.tf32_eligible: dict[str, int] = {}

    def mapping(self) -> dict[Any, Any]:
        formulas = dict(flop_counter.flop_registry)
        # CPU's fused attention kernel is missing from the registry; it costs what sdpa costs.
        cpu_sdpa = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if cpu_sdpa is not None and cpu_sdpa not in formulas:
            formulas[cpu_sdpa] = flop_counter.shape_wrapper(
                lambda q, k, v, *args, out_shape=None, **kwargs: flop_counter.sdpa_flop_count(q, k, v))
        return {op: self._wrap(formula, _op_class(op)) for op, formula in formulas.items()}

    def _wrap(self, formula, op_class: Optional[str]):
        def counted(*args, out_val=None, **kwargs):
            flops = int(formula(*args, out_val=out_val, **kwargs))
            tensors = [t for t in tree_flatten((out_val, args))[0] if isinstance(t, torch.Tensor)]
            floating = [t for t in tensors if t.dtype.is_floating_point]
            dtype = dtype_name((floating or tensors)[0].dtype) if tensors else "unknown"
            self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + flops
            if dtype == "fp32" and op_class is not None and flops:
                self.tf32_eligible[op_class] = self.tf32_eligible.get(op_class, 0) + flops
            return flops
        counted._get_raw = True  # receive tensors, not shapes (FlopCounterMode's convention)
        return counted


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return [v for v in tree_flatten(list(values))[0] if isinstance(v, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _meta_context():
    return torch.device("meta")


def _fake_context():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _count_loaded(task: Any, method: str, numerics: Any) -> RooflineCounts:
    # No seeding: values do not exist on meta/fake tensors, and the caller's RNG stays as it was.
    ctx = _meta_context() if method == "meta" else _fake_context()
    with ctx, torch.no_grad():
        init = task.get_init_inputs()
        init = numerics.cast(init) if numerics is not None else init
        model = task.Model(*init)
        model = numerics.cast_model(model) if numerics is not None else model
        inputs = task.get_inputs()
        inputs = numerics.cast(inputs) if numerics is not None else inputs
        if method == "meta":
            inputs = [_to_meta(x) for x in inputs]
            model = model.to("meta")
        recorder = _DtypeRecorder()
        counter = flop_counter.FlopCounterMode(display=False, custom_mapping=recorder.mapping())
        with counter:
            output = model(*inputs)
    in_tensors = _unique(_tensors(inputs))
    params = list(model.parameters())
    buffers = list(model.buffers())
    outs = _unique(_tensors([output]))
    by_kind = {"inputs": sum(map(_nbytes, in_tensors)), "parameters": sum(map(_nbytes, params)),
               "buffers": sum(map(_nbytes, buffers)), "outputs": sum(map(_nbytes, outs))}
    by_dtype: dict[str, int] = {}
    for t in [*in_tensors, *params, *buffers, *outs]:
        by_dtype[dtype_name(t.dtype)] = by_dtype.get(dtype_name(t.dtype), 0) + _nbytes(t)
    flops_by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    flops = int(counter.get_total_flops())
    flops_by_dtype = {k: v for k, v in recorder.by_dtype.items() if v}
    return RooflineCounts(
        flops=flops, min_bytes=sum(by_kind.values()), dtype=_task_dtype(flops_by_dtype, in_tensors, params, outs),
        flops_by_dtype=flops_by_dtype, flops_by_op=flops_by_op, tf32_eligible=dict(recorder.tf32_eligible),
        bytes_by_kind=by_kind,
        bytes_by_dtype=by_dtype, input_shapes=[list(t.shape) for t in in_tensors],
        output_shapes=[list(t.shape) for t in outs], method=method)


def _task_dtype(flops_by_dtype: dict[str, int], *groups: list[torch.Tensor]) -> str:
    """The dtype the task computes in: the one carrying most FLOPs, else most floating bytes."""
    if flops_by_dtype:
        return max(flops_by_dtype.items(), key=lambda kv: kv[1])[0]
    weights: dict[str, int] = {}
    for group in groups:
        for t in group:
            if t.dtype.is_floating_point:
                weights[dtype_name(t.dtype)] = weights.get(dtype_name(t.dtype), 0) + _nbytes(t)
    return max(weights.items(), key=lambda kv: kv[1])[0] if weights else "fp32"


def count_loaded(task: Any, numerics: Any = None) -> RooflineCounts:
    """Counts for a loaded task (``sandbox.tasks.LoadedTask``, its overrides applied), without
    allocating, with model and inputs cast as ``numerics`` (a ``sandbox.numerics.Numerics``)
    casts them; ``None`` leaves them as the task makes them."""
    try:
        return _count_loaded(task, "meta", numerics)
    except Exception as meta_exc:  # noqa: BLE001 - some models do not run on meta; try fake tensors
        try:
            return _count_loaded(task, "fake", numerics)
        except Exception as fake_exc:  # noqa: BLE001
            raise RuntimeError(
                f"cannot count FLOPs and bytes of {task.spec.name}: on meta tensors "
                f"{type(meta_exc).__name__}: {meta_exc}; under FakeTensorMode "
                f"{type(fake_exc).__name__}: {fake_exc}") from fake_exc
