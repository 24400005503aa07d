"""The numerics convention of a run: one object that the sandbox, the evals and the builtin read.

A convention is a **precision** and a **math mode**:

* precision ``fp32 | fp16 | bf16``, as KernelBench defines it: the model (its parameters and
  buffers, and tensors among its init inputs) and its floating-point inputs are cast to that
  dtype, and outputs are compared at ``atol = rtol = 1e-4`` (fp32) or ``1e-2`` (fp16, bf16).
  Integer inputs (indices, labels) keep their dtype (KernelBench casts every tensor).
* math mode ``default``: PyTorch's own defaults of the installed torch, read when this module
  is first imported (before any candidate code runs): cuDNN convolutions in TF32, cuBLAS
  matmuls in full fp32. That is what users run and what KernelBench times.
  ``strict``: IEEE fp32 everywhere (TF32 off in cuDNN and cuBLAS).

The harness sets the mode's switches afresh before every request a worker serves
(``enforced``), so a candidate cannot tell a trial from a timed run by them, and one that
flips a switch gets it flipped back.

**The float64 rule.** The reference also runs in float64 (a float64 copy of the model on the
same, already cast, inputs). An element of a candidate's output passes when it is within the
precision's tolerance of the reference (KernelBench's rule), *or* when it is no farther from
the float64 result than ``elem_factor`` times the reference's largest distance from it, plus
the tolerance: a kernel is never failed for being more accurate than the reference. Per
output, the candidate's relative RMS error against float64 may be at most ``rms_factor`` times
the reference's plus ``rms_slack_eps`` machine epsilons of the precision, else the candidate is
flagged ``inaccurate`` (measured in the first trial). Both rules apply only where the
reference itself is close to its float64 run (``fp64_applies_below``); a forward that draws
random numbers or casts by itself is compared by the tolerance alone.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MATH_MODES = ("default", "strict")
# KernelBench's tolerances (atol = rtol), by precision
TOLERANCES = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 1e-2}
# The reference further than this from its float64 run (relative RMS) computed something else
# than the float64 copy did: the float64 rules do not apply. TF32 and half types sit well below.
FP64_APPLIES_BELOW = {"fp32": 1e-2, "fp16": 5e-2, "bf16": 1e-1}

_B = torch.backends
_NEW_API = all(hasattr(m, "fp32_precision") for m in (_B.cudnn.conv, _B.cudnn.rnn, _B.cuda.matmul))


def _read_switches() -> dict[str, Any]:
    """The TF32 switches as they stand: the legacy ones and, where this torch has it, the new API."""
    state: dict[str, Any] = {"cudnn_allow_tf32": bool(_B.cudnn.allow_tf32),
                             "matmul_allow_tf32": bool(_B.cuda.matmul.allow_tf32),
                             "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if _NEW_API:
        state.update(fp32_precision=_B.fp32_precision, cudnn_fp32_precision=_B.cudnn.fp32_precision,
                     conv_fp32_precision=_B.cudnn.conv.fp32_precision,
                     rnn_fp32_precision=_B.cudnn.rnn.fp32_precision,
                     matmul_fp32_precision=_B.cuda.matmul.fp32_precision)
    return state


# PyTorch's defaults, read at first import (in a worker, before any candidate code has run).
TORCH_DEFAULTS: dict[str, Any] = _read_switches()
_STRICT: dict[str, Any] = {"cudnn_allow_tf32": False, "matmul_allow_tf32": False, "float32_matmul_precision": "highest"}
if _NEW_API:
    _STRICT.update(fp32_precision="none", cudnn_fp32_precision="none", conv_fp32_precision="ieee",
                   rnn_fp32_precision="ieee", matmul_fp32_precision="ieee")


def _write_switches(state: dict[str, Any]) -> None:
    """Set every switch: the legacy ones first (their setters also move the new API's), then the
    new API's (torch >= 2.9 raises on reading a switch whose two APIs disagree)."""
    torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    _B.cudnn.allow_tf32 = state["cudnn_allow_tf32"]
    _B.cuda.matmul.allow_tf32 = state["matmul_allow_tf32"]
    if _NEW_API:
        _B.fp32_precision = state["fp32_precision"]
        _B.cudnn.fp32_precision = state["cudnn_fp32_precision"]
        _B.cudnn.conv.fp32_precision = state["conv_fp32_precision"]
        _B.cudnn.rnn.fp32_precision = state["rnn_fp32_precision"]
        _B.cuda.matmul.fp32_precision = state["matmul_fp32_precision"]


class Tolerance(BaseModel):
    atol: float
    rtol: float


class Numerics(BaseModel):
    """A run's numerics convention (see the module's docstring); stored with every run,
    evaluation and baseline, and part of the evaluation cache's key."""

    model_config = ConfigDict(frozen=True)

    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    math: Literal["default", "strict"] = "default"
    # the float64 rules
    fp64_check: bool = True
    elem_factor: float = Field(2.0, ge=1.0)
    rms_factor: float = Field(2.0, ge=1.0)
    rms_slack_eps: float = Field(4.0, ge=0.0)

    # ---- what it means -----------------------------------------------------------
    @property
    def label(self) -> str:
        """How every figure measured under it is labelled, e.g. ``fp32/default``."""
        return f"{self.precision}/{self.math}"

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def eps(self) -> float:
        return float(torch.finfo(self.dtype).eps)

    @property
    def tolerance(self) -> Tolerance:
        tol = TOLERANCES[self.precision]
        return Tolerance(atol=tol, rtol=tol)

    @property
    def fp64_applies_below(self) -> float:
        return FP64_APPLIES_BELOW[self.precision]

    def switches(self) -> dict[str, Any]:
        """The TF32 switches this mode runs under."""
        return dict(TORCH_DEFAULTS if self.math == "default" else _STRICT)

    def tf32_classes(self, device: str) -> set[str]:
        """Op classes whose fp32 FLOPs run in TF32 under this mode on ``device`` (the roofline
        floor charges them at the TF32 rate): none on cpu, none in ``strict``."""
        if device != "cuda" or self.precision != "fp32":
            return set()
        s = self.switches()
        classes = set()
        if s["cudnn_allow_tf32"] and s.get("conv_fp32_precision", "tf32") != "ieee":
            classes.add("conv")
        if (s["matmul_allow_tf32"] or s["float32_matmul_precision"] != "highest"
                or s.get("matmul_fp32_precision") == "tf32"):
            classes.add("matmul")
        return classes

    def tf32_words(self, device: str = "cuda") -> str:
        """What runs in TF32 under this mode, in words ("" for nothing)."""
        words = {"conv": "cuDNN convolutions", "matmul": "cuBLAS matmuls"}
        return " and ".join(words[c] for c in sorted(self.tf32_classes(device)))

    def describe(self) -> str:
        """One line for table headers and reports."""
        if self.precision != "fp32":
            what = f"model and inputs in {self.precision}"
        elif self.math == "strict":
            what = "IEEE fp32 everywhere (TF32 off)"
        else:
            tf32 = self.tf32_words("cuda")
            what = f"PyTorch defaults ({tf32} in TF32 on cuda)" if tf32 else "PyTorch defaults (no TF32)"
        tol = TOLERANCES[self.precision]
        return f"{self.label}: {what}; tolerance {tol:g}"

    # ---- applying it ---------------------------------------------------------------
    def enforce(self) -> None:
        """Set this mode's switches now."""
        _write_switches(self.switches())

    @contextlib.contextmanager
    def enforced(self) -> Iterator[None]:
        """This mode's switches for the block, the previous ones after it."""
        try:
            saved: Optional[dict[str, Any]] = _read_switches()
        except RuntimeError:            # switches left mixed by someone else: restore the defaults
            saved = None
        self.enforce()
        try:
            yield
        finally:
            _write_switches(saved if saved is not None else TORCH_DEFAULTS)

    def cast(self, value: Any) -> Any:
        """A floating-point tensor (or a list/tuple of values) in this precision; anything else unchanged."""
        if isinstance(value, torch.Tensor):
            return value.to(self.dtype) if value.is_floating_point() and value.dtype != self.dtype else value
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast(v) for v in value)
        return value

    def cast_model(self, model: Any) -> Any:
        """The model's floating-point parameters and buffers in this precision (fp32: unchanged)."""
        if self.precision != "fp32" and isinstance(model, torch.nn.Module):
            model = model.to(self.dtype)
        return model


STRICT_FP32 = Numerics(precision="fp32", math="strict")


def parse_numerics(precision: Optional[str], math: Optional[str], base: Optional[Numerics] = None) -> Numerics:
    """``--precision`` and ``--math`` as a ``Numerics`` (unset ones from ``base``, else the
    defaults); a clear ``ValueError`` naming the option otherwise."""
    base = base or Numerics()
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if math is not None and math not in MATH_MODES:
        raise ValueError(f"--math must be one of {', '.join(MATH_MODES)}, not {math!r}")
    return base.model_copy(update={k: v for k, v in (("precision", precision), ("math", math)) if v is not None})


def numerics_of_run_config(config: Any) -> tuple[Numerics, bool]:
    """(numerics, recorded) of a stored run's config (``config["eval"]["numerics"]``). Runs from
    before numerics were recorded ran IEEE fp32: ``(STRICT_FP32, False)``. An unreadable entry
    raises pydantic's ``ValidationError``."""
    ev = config.get("eval") if isinstance(config, dict) else None
    raw = ev.get("numerics") if isinstance(ev, dict) else None
    if raw is None:
        return STRICT_FP32, False
    return Numerics.model_validate(raw), True
