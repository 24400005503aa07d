"""Flags degenerate tasks: ones where a wrong kernel could pass the correctness check.

A task is only a good benchmark when its reference output carries information: a kernel
that returns a constant, zeros, or ignores its inputs or weights must fail. The check runs
the reference at the device's sizes (CPU_SIZES on cpu) and flags, per output tensor:

``nonfinite``           NaN or inf in the reference output.
``constant``            one value (the median) is within the fp32 tolerance of every element,
                        so a kernel returning that constant would pass.
``near_zero``           every element has ``|y| < 1e-2``.
``tiny_spread``         ``std(y) < 1e-3 * mean(|y|)``: the output is nearly one value.
``input_insensitive``   fresh inputs (another seed) leave the output within tolerance.
``weight_insensitive``  other weights (another init seed) leave the output within tolerance
                        (only checked when the weights do differ between the two seeds).
``nondeterministic``    the same model and inputs give different outputs (randomness in forward).

and, for the task as a whole, ``load_error`` (the file cannot be loaded) and
``runtime_error`` (building the model, making inputs or the forward raised).
"""
from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass
from typing import Any, Optional

from sandbox.numerics import Numerics
from sandbox.tasks import TaskError, TaskSpec, load_task, with_device_sizes

FLAGS: dict[str, str] = {
    "load_error": "the task file cannot be loaded",
    "runtime_error": "building the model, making inputs or running the forward raised",
    "nonfinite": "the reference output has NaN or inf",
    "constant": "a single constant passes the correctness check against the reference output",
    "near_zero": "every element of the reference output is smaller than 1e-2 in magnitude",
    "tiny_spread": "the reference output is nearly one value (std < 1e-3 of the mean magnitude)",
    "input_insensitive": "the output does not change when the inputs change",
    "weight_insensitive": "the output does not change when the weights change",
    "nondeterministic": "the same model and inputs give different outputs",
    "too_large": "the task's measured memory needs exceed the device's budget even with nothing else running",
}

# The correctness check's fp32 tolerance (sandbox.numerics: 1e-4 at fp32; check_task uses its numerics').
ATOL = 1e-4
RTOL = 1e-4
NEAR_ZERO = 1e-2
TINY_SPREAD = 1e-3
# An output "did not change" when at most this fraction of its elements moved beyond tolerance.
UNCHANGED_FRACTION = 1e-3


@dataclass
class CheckIssue:
    task: str
    flag: str
    message: str
    output: Optional[int] = None        # index of the output tensor concerned, if any

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- helpers

def _clone(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _outputs(out: Any) -> list[Any]:
    from sandbox.harness import flatten_outputs

    return [o.detach().clone() if hasattr(o, "detach") else o for o in flatten_outputs(out)]


def _as_float(t: Any):
    """fp32 for floating outputs of 32 bits or fewer (enough for these statistics), else fp64."""
    import torch

    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    t = t.detach()
    if t.is_floating_point() and t.element_size() <= 4:
        return t.to(torch.float32)
    return t.to(torch.float64)


def _changed_fraction(a: Any, b: Any, atol: float, rtol: float) -> float:
    """Fraction of elements of ``b`` outside ``atol + rtol*|a|`` of ``a`` (1.0 when shapes differ)."""
    import torch

    a, b = _as_float(a), _as_float(b)
    if a.shape != b.shape:
        return 1.0
    if a.numel() == 0:
        return 0.0
    both_nan = torch.isnan(a) & torch.isnan(b)
    moved = ((a - b).abs() > atol + rtol * a.abs()) & ~both_nan
    moved |= torch.isnan(a) ^ torch.isnan(b)
    return moved.double().mean().item()


def _same_weights(m1: Any, m2: Any) -> bool:
    import torch

    s1, s2 = m1.state_dict(), m2.state_dict()
    if s1.keys() != s2.keys():
        return False
    for k in s1:
        a, b = s1[k], s2[k]
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            if a.shape != b.shape or not torch.equal(a, b):
                return False
    return True


def _shape(t: Any) -> str:
    return "x".join(str(s) for s in getattr(t, "shape", ())) or "scalar"


# --------------------------------------------------------------------------- value checks

def value_issues(name: str, index: int, y: Any, atol: float = ATOL, rtol: float = RTOL) -> list[CheckIssue]:
    """Flags from one reference output tensor alone (nonfinite, constant, near_zero, tiny_spread)."""
    import torch

    issues: list[CheckIssue] = []
    if not isinstance(y, torch.Tensor):
        return issues
    where = f"output {index} ({_shape(y)})"
    y = _as_float(y)
    finite = torch.isfinite(y)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        issues.append(CheckIssue(name, "nonfinite", f"{where}: {bad} of {y.numel()} elements are NaN or inf", index))
        return issues
    if y.numel() == 0:
        return issues
    mag = y.abs()
    if float(mag.max()) < NEAR_ZERO:
        issues.append(CheckIssue(name, "near_zero", f"{where}: max |y| = {float(mag.max()):.3g} < {NEAR_ZERO:g}", index))
    if y.numel() < 2:
        return issues
    c = y.flatten().median()
    if bool(((y - c).abs() <= atol + rtol * mag).all()):
        issues.append(CheckIssue(
            name, "constant", f"{where}: every element is within tolerance of {float(c):.6g} "
            f"(range {float(y.min()):.6g} .. {float(y.max()):.6g})", index))
        return issues
    std, mean_abs = float(y.std()), float(mag.mean())
    if mean_abs > 0 and std < TINY_SPREAD * mean_abs:
        issues.append(CheckIssue(
            name, "tiny_spread", f"{where}: std {std:.3g} is {std / mean_abs:.2g} of mean |y| {mean_abs:.3g} "
            f"(threshold {TINY_SPREAD:g})", index))
    return issues


def _sensitivity_issue(name: str, flag: str, what: str, index: int, y: Any, y2: Any,
                       atol: float, rtol: float) -> Optional[CheckIssue]:
    frac = _changed_fraction(y, y2, atol, rtol)
    if frac <= UNCHANGED_FRACTION:
        return CheckIssue(name, flag, f"output {index} ({_shape(y)}): {what} changed only {frac:.2%} of "
                                      f"its elements beyond tolerance", index)
    return None


# --------------------------------------------------------------------------- the check

def check_task(spec: TaskSpec, device: str = "cpu", seed: int = 0,
               numerics: Optional[Numerics] = None) -> list[CheckIssue]:
    """Every degeneracy flag of ``spec`` at the sizes used on ``device``, under ``numerics``
    (model and inputs in its precision, its math mode, its tolerance); empty when the task is fine."""
    numerics = numerics or Numerics()
    with numerics.enforced():
        return _check_task(spec, device, seed, numerics)


def _check_task(spec: TaskSpec, device: str, seed: int, numerics: Numerics) -> list[CheckIssue]:
    import torch

    from sandbox.harness import make_inputs, make_model

    atol, rtol = numerics.tolerance.atol, numerics.tolerance.rtol

    spec = with_device_sizes(spec, device)
    name = spec.name
    try:
        task = load_task(spec)
    except TaskError as exc:
        return [CheckIssue(name, "load_error", str(exc))]

    stage = "building the model"
    try:
        with torch.no_grad():
            model = make_model(task.Model, task, seed, device, numerics)
            stage = "building the model with another seed"
            other = make_model(task.Model, task, seed + 3, device, numerics)
            # Compared before any forward: training-mode norms update their running stats.
            weights_differ = not _same_weights(model, other)
            stage = "making inputs"
            x1 = make_inputs(task, seed + 1, device, numerics)
            x2 = make_inputs(task, seed + 2, device, numerics)
            stage = "running the forward"
            y1 = _outputs(model(*_clone(x1)))
            y1_again = _outputs(model(*_clone(x1)))
            y2 = _outputs(model(*_clone(x2)))
            y3 = _outputs(other(*_clone(x1))) if weights_differ else None
            del model, other
    except Exception as exc:  # noqa: BLE001 - every failure of task code is reported, not raised
        tb = traceback.format_exc(limit=4)
        return [CheckIssue(name, "runtime_error", f"{stage} raised {type(exc).__name__}: {exc}\n{tb}")]

    issues: list[CheckIssue] = []
    if len(y1) != len(y2) or len(y1) != len(y1_again):
        issues.append(CheckIssue(name, "nondeterministic", "the number of outputs changes between calls"))
        return issues
    for i, y in enumerate(y1):
        if not isinstance(y, torch.Tensor):
            continue
        found = value_issues(name, i, y, atol, rtol)
        issues.extend(found)
        if any(f.flag == "nonfinite" for f in found):
            continue
        if _changed_fraction(y, y1_again[i], atol, rtol) > 0:
            issues.append(CheckIssue(name, "nondeterministic",
                                     f"output {i} ({_shape(y)}): two calls with the same model and inputs differ", i))
            continue
        issue = _sensitivity_issue(name, "input_insensitive", "fresh inputs (another seed)", i, y, y2[i], atol, rtol)
        if issue:
            issues.append(issue)
        if y3 is not None and i < len(y3):
            issue = _sensitivity_issue(name, "weight_insensitive", "other weights (another init seed)", i, y,
                                       y3[i], atol, rtol)
            if issue:
                issues.append(issue)
    return issues


def check_paths(paths: list[str] | None, device: str = "cpu",
                overrides: Optional[dict[str, Any]] = None) -> dict[str, list[CheckIssue]]:
    """``check_task`` for every task file that ``sandbox.tasks.discover`` finds under ``paths``."""
    from sandbox.tasks import discover, read_spec

    results: dict[str, list[CheckIssue]] = {}
    for path in discover(paths):
        try:
            spec = read_spec(path, overrides)
        except TaskError as exc:
            results[str(path)] = [CheckIssue(str(path), "load_error", str(exc))]
            continue
        results[spec.name] = check_task(spec, device)
    return results
