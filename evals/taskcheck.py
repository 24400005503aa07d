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
    "unchecked": "the harness could not check the task (its checks, or the measurement of its memory needs, "
                 "ran out of device memory): the detail says which; not a verdict on the task",
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


# Statistics run over flat chunks of this many elements, so their temporaries stay a few hundred
# MB whatever the output's size: KernelBench's published sizes have 6 GiB outputs
# (level1/19_ReLU), whose whole-tensor median and |y - c| temporaries needed 18 GiB more.
CHUNK = 1 << 26
# The constant checked against every element is the median of at most this many of them.
MEDIAN_SAMPLE = 1 << 22


def _chunks(*tensors: Any):
    """Matching flat chunks of same-shaped tensors, each as ``_as_float``."""
    flats = [t.detach().reshape(-1) for t in tensors]
    for start in range(0, flats[0].numel(), CHUNK):
        yield [_as_float(f[start:start + CHUNK]) for f in flats]


def _changed_fraction(a: Any, b: Any, atol: float, rtol: float) -> float:
    """Fraction of elements of ``b`` outside ``atol + rtol*|a|`` of ``a`` (1.0 when shapes differ)."""
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        a, b = _as_float(a), _as_float(b)
    if a.shape != b.shape:
        return 1.0
    if a.numel() == 0:
        return 0.0
    moved_count = 0
    for ca, cb in _chunks(a, b):
        both_nan = torch.isnan(ca) & torch.isnan(cb)
        moved = ((ca - cb).abs() > atol + rtol * ca.abs()) & ~both_nan
        moved |= torch.isnan(ca) ^ torch.isnan(cb)
        moved_count += int(moved.sum())
    return moved_count / a.numel()


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
    """Flags from one reference output tensor alone (nonfinite, constant, near_zero, tiny_spread),
    computed chunk by chunk (``CHUNK``)."""
    import torch

    issues: list[CheckIssue] = []
    if not isinstance(y, torch.Tensor):
        return issues
    where = f"output {index} ({_shape(y)})"
    n = y.numel()
    bad, max_abs, low, high, total, total_abs = 0, 0.0, float("inf"), float("-inf"), 0.0, 0.0
    for (c,) in _chunks(y):
        bad += int((~torch.isfinite(c)).sum())
        if bad or c.numel() == 0:
            continue
        max_abs = max(max_abs, float(c.abs().max()))
        low, high = min(low, float(c.min())), max(high, float(c.max()))
        total += float(c.sum(dtype=torch.float64))
        total_abs += float(c.abs().sum(dtype=torch.float64))
    if bad:
        issues.append(CheckIssue(name, "nonfinite", f"{where}: {bad} of {n} elements are NaN or inf", index))
        return issues
    if n == 0:
        return issues
    if max_abs < NEAR_ZERO:
        issues.append(CheckIssue(name, "near_zero", f"{where}: max |y| = {max_abs:.3g} < {NEAR_ZERO:g}", index))
    if n < 2:
        return issues
    flat = y.detach().reshape(-1)
    if n > MEDIAN_SAMPLE:
        gen = torch.Generator(device=flat.device).manual_seed(0)
        flat = flat[torch.randint(0, n, (MEDIAN_SAMPLE,), generator=gen, device=flat.device)]
    center = _as_float(flat).median()
    if all(bool(((c - center).abs() <= atol + rtol * c.abs()).all()) for (c,) in _chunks(y)):
        issues.append(CheckIssue(
            name, "constant", f"{where}: every element is within tolerance of {float(center):.6g} "
            f"(range {low:.6g} .. {high:.6g})", index))
        return issues
    mean, mean_abs = total / n, total_abs / n
    squares = sum(float(((c.double() - mean) ** 2).sum()) for (c,) in _chunks(y))
    std = (squares / (n - 1)) ** 0.5
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

def checker_version() -> str:
    """A hash of these checks' source: a verdict stored by other checks is never read back as theirs."""
    import hashlib
    from pathlib import Path

    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def check_task(spec: TaskSpec, device: str = "cpu", seed: int = 0,
               numerics: Optional[Numerics] = None) -> list[CheckIssue]:
    """Every degeneracy flag of ``spec`` at the sizes used on ``device``, under ``numerics``
    (model and inputs in its precision, its math mode, its tolerance); empty when the task is fine."""
    numerics = numerics or Numerics()
    try:
        with numerics.enforced():
            return _check_task(spec, device, seed, numerics)
    finally:
        if device == "cuda":
            # what the checks held goes back to the GPU: the caching allocator kept it reserved
            # in this process (40 GiB after level1/19_ReLU on an H100), and the next task's memory
            # was then measured beside it and ran out
            import gc

            import torch

            gc.collect()
            torch.cuda.empty_cache()


def _check_task(spec: TaskSpec, device: str, seed: int, numerics: Numerics) -> list[CheckIssue]:
    import torch

    atol, rtol = numerics.tolerance.atol, numerics.tolerance.rtol

    spec = with_device_sizes(spec, device)
    name = spec.name
    try:
        task = load_task(spec)
    except TaskError as exc:
        return [CheckIssue(name, "load_error", str(exc))]

    try:
        with torch.no_grad():
            return _checked_values(spec, task, device, seed, numerics, atol, rtol)
    except torch.OutOfMemoryError as exc:
        return [CheckIssue(name, "unchecked", f"the checks ran out of {device} memory ({str(exc).splitlines()[0]}); "
                                              f"they hold two models, an input set and two outputs at a time")]
    except _TaskRaised as exc:
        return [CheckIssue(name, "runtime_error", str(exc))]


class _TaskRaised(Exception):
    """The task's own code raised while the check ran it."""


def _checked_values(spec: TaskSpec, task: Any, device: str, seed: int, numerics: Numerics,
                    atol: float, rtol: float) -> list[CheckIssue]:
    """Run the task's model and judge its outputs, keeping few full-size tensors alive at once
    (KernelBench's published sizes reach 6-8 GiB per input or output): the repeat's outputs, the
    other inputs' and the other weights' are each compared with the first outputs and dropped."""
    import torch

    from sandbox.harness import make_inputs, make_model

    name = spec.name

    def task_code(stage: str, fn: Any) -> Any:
        try:
            return fn()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of task code is reported, not raised
            raise _TaskRaised(f"{stage} raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}") from None

    model = task_code("building the model", lambda: make_model(task.Model, task, seed, device, numerics))
    other = task_code("building the model with another seed",
                      lambda: make_model(task.Model, task, seed + 3, device, numerics))
    # Compared before any forward: training-mode norms update their running stats.
    weights_differ = not _same_weights(model, other)
    x1 = task_code("making inputs", lambda: make_inputs(task, seed + 1, device, numerics))
    y1 = task_code("running the forward", lambda: _outputs(model(*_clone(x1))))
    again = task_code("running the forward", lambda: _outputs(model(*_clone(x1))))
    if len(again) != len(y1):
        return [CheckIssue(name, "nondeterministic", "the number of outputs changes between calls")]
    tensors = [i for i, y in enumerate(y1) if isinstance(y, torch.Tensor)]
    found = {i: value_issues(name, i, y1[i], atol, rtol) for i in tensors}
    finite = [i for i in tensors if not any(f.flag == "nonfinite" for f in found[i])]
    nondeterministic = {i for i in finite if _changed_fraction(y1[i], again[i], atol, rtol) > 0}
    del again
    judged = [i for i in finite if i not in nondeterministic]
    sensitivity: dict[int, list[CheckIssue]] = {i: [] for i in tensors}
    if judged and weights_differ:
        y3 = task_code("running the forward", lambda: _outputs(other(*_clone(x1))))
        for i in judged:
            if i < len(y3):
                issue = _sensitivity_issue(name, "weight_insensitive", "other weights (another init seed)", i,
                                           y1[i], y3[i], atol, rtol)
                sensitivity[i] += [issue] if issue else []
        del y3
    other = x1 = None                 # freed before the second input set is made
    if judged:
        x2 = task_code("making inputs", lambda: make_inputs(task, seed + 2, device, numerics))
        y2 = task_code("running the forward", lambda: _outputs(model(*_clone(x2))))
        del x2
        if len(y2) != len(y1):
            return [CheckIssue(name, "nondeterministic", "the number of outputs changes between calls")]
        for i in judged:
            issue = _sensitivity_issue(name, "input_insensitive", "fresh inputs (another seed)", i, y1[i], y2[i],
                                       atol, rtol)
            sensitivity[i] = ([issue] if issue else []) + sensitivity[i]
        del y2
    issues: list[CheckIssue] = []
    for i in tensors:
        issues.extend(found[i])
        if i in nondeterministic:
            issues.append(CheckIssue(name, "nondeterministic",
                                     f"output {i} ({_shape(y1[i])}): two calls with the same model and inputs differ", i))
        issues.extend(sensitivity[i])
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
