"""Run metrics: KernelBench's fast_p, geomean speedups, roofline fractions, tokens and cost.

The functions here are pure: they take plain per-attempt records (``AttemptRecord``) and
per-model-call records (``CallRecord``) and return numbers. ``evals.run_data.load_run`` is the
one place that reads the store and builds those records.

Definitions (every figure in ``kernelloop report`` and ``compare`` comes from these):

* **Correct kernel.** An attempt counts as correct only when its latest evaluation is
  ``EvalResult.clean``: status ``correct`` *and* no flag of ``DISQUALIFYING_FLAGS``
  (``suspicious``, ``impossible``, ``no_custom_kernel``, ``fallback``, ``inputs_mutated``,
  ``inaccurate``, ``contended``). A
  correct-but-flagged attempt is not a correct kernel; it is counted separately
  (``flagged_attempts``, ``tasks_flagged_only``, ``flag_counts``). A ``precision`` flag (the
  source asks for a narrower format) alone does not disqualify: the float64 check measures
  whether accuracy was lost (``inaccurate``).
* **Tasks of a run.** Every task the run touched: any task with an attempt, a model call or
  an analysis in the run. A task whose model calls all failed still counts (as not correct).
* **Best attempt per task.** For each baseline separately, the clean-correct attempt with the
  highest speedup against that baseline (ties: lower candidate time, then earlier attempt).
  So "best vs eager" and "best vs compile" may be different attempts. When a task has no
  clean-correct attempt its displayed best is the attempt that got furthest
  (flagged-correct > incorrect > runtime error > timeout > load error > compile error >
  not evaluated; ties: the latest).
* **fast_p** (KernelBench): the fraction of ALL tasks of the run whose best attempt is
  correct and has speedup > p (strictly), for p in ``FAST_P_THRESHOLDS``; computed against
  eager PyTorch and against torch.compile. ``fast_0`` is the correctness rate over tasks
  (a correct task counts for p = 0 even when that baseline was not timed). When no correct
  attempt of the run has a torch.compile speedup, the compile fast_p values are ``None``.
* **Geomean speedup**: geometric mean of the per-task best speedup, over the tasks that have
  a correct kernel with a speedup against that baseline.
* **Floor fraction** (KernelBench-Hard's peak fraction): ``floor_fraction`` (roofline floor
  time / candidate time) of each correct task's best-vs-eager attempt; the run's median and
  geometric mean of it over correct tasks where it is known. The floor (``hardware.floors``,
  ``CONVENTION``) is what no legitimate kernel beats, so a clean fraction is at most 100%.
* **Attempts**: every attempt of the run, parsed or not; attempt-level correctness rate is
  clean-correct attempts / all attempts.
* **Harness failures** (``infra_error``) are no verdicts: in no rate, and a task with nothing
  else (``tasks_infra_only``) in no task count; ``infra_error_attempts`` counts them.
* **Tokens and cost**: prompt + completion tokens and ``cost_usd`` summed over every model
  call of the run (proposals and critiques, failed calls included; unknown counts as 0);
  per correct kernel = total / number of tasks with a correct kernel (``None`` if none).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

FAST_P_THRESHOLDS: tuple[float, ...] = (0.0, 0.5, 0.8, 1.0, 1.5, 2.0)
BASELINES = ("eager", "compile")

# How far a non-correct attempt got, for choosing what to show for a task with no correct kernel.
_PROGRESS = {"correct": 6, "incorrect": 5, "runtime_error": 4, "timeout": 3, "load_error": 2,
             "compile_error": 1, None: 0}


def p_key(p: float) -> str:
    """The label of a threshold: 0, 0.5, 0.8, 1, 1.5, 2."""
    return f"{p:g}"


@dataclass
class AttemptRecord:
    """One attempt and the verdict of its latest evaluation, as plain data."""

    attempt_id: int
    task: str
    round: int
    sample: int = 0
    task_id: Optional[int] = None
    parse_status: str = "ok"
    parse_error: Optional[str] = None
    status: Optional[str] = None           # EvalResult.status; None when never evaluated
    clean: bool = False                    # EvalResult.clean
    flags: list[str] = field(default_factory=list)
    flag_reasons: list[str] = field(default_factory=list)
    candidate_ms: Optional[float] = None
    eager_ms: Optional[float] = None
    compile_ms: Optional[float] = None
    compile_within: Optional[bool] = None  # torch.compile's own output within the tolerance (EvalResult)
    compile_fp64: Optional[str] = None     # why it fails the float64 rule (EvalResult.compile_fp64_note)
    speedup_eager: Optional[float] = None
    speedup_compile: Optional[float] = None
    speedup_eager_ci: Optional[list[float]] = None     # [low, high]: 95% interval (sandbox.intervals)
    speedup_compile_ci: Optional[list[float]] = None
    floor_fraction: Optional[float] = None
    error: Optional[str] = None            # first error / failing check, in words
    parent_ids: list[int] = field(default_factory=list)
    evaluation_id: Optional[int] = None
    source: Optional[str] = None
    timing: Optional[str] = None           # how its times were taken (sandbox.result.Timing.convention)

    @property
    def correct(self) -> bool:
        """Counted as a correct kernel (clean); see the module docstring."""
        return self.clean

    @property
    def infra(self) -> bool:
        """A harness failure, no verdict (see the module docstring)."""
        return self.status == "infra_error"

    @property
    def flagged(self) -> bool:
        """The harness said correct, but a flag disqualifies it."""
        return self.status == "correct" and not self.clean

    @property
    def runtime_ms(self) -> float:
        """The seeds' ``Runtime``: the candidate's median time if correct, else -1.0."""
        return self.candidate_ms if (self.clean and self.candidate_ms is not None) else -1.0

    def speedup(self, baseline: str) -> Optional[float]:
        return self.speedup_eager if baseline == "eager" else self.speedup_compile

    def speedup_ci(self, baseline: str) -> Optional[list[float]]:
        return self.speedup_eager_ci if baseline == "eager" else self.speedup_compile_ci

    def to_dict(self, with_source: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_source:
            d.pop("source")
        d.update(correct=self.correct, flagged=self.flagged, runtime_ms=self.runtime_ms)
        return d


@dataclass
class CallRecord:
    """One model call of the run."""

    call_id: int
    task: Optional[str] = None
    round: Optional[int] = None
    purpose: str = "propose"
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    cost_usd: Optional[float] = None


@dataclass
class TaskMetrics:
    task: str
    attempts: int
    correct_attempts: int
    flagged_attempts: int
    best_eager: Optional[AttemptRecord]    # best clean-correct attempt vs eager
    best_compile: Optional[AttemptRecord]  # best clean-correct attempt vs torch.compile
    best: Optional[AttemptRecord]          # what to show: best_eager, else the furthest attempt
    best_by_round: dict[int, Optional[float]]  # round -> best clean speedup vs eager so far
    infra_only: bool = False               # every attempt a harness failure: no verdict for the task

    @property
    def correct(self) -> bool:
        return self.best_eager is not None

    @property
    def flagged_only(self) -> bool:
        return not self.correct and self.flagged_attempts > 0

    def best_for(self, baseline: str) -> Optional[AttemptRecord]:
        return self.best_eager if baseline == "eager" else self.best_compile

    def speedup(self, baseline: str) -> Optional[float]:
        best = self.best_for(baseline)
        return best.speedup(baseline) if best else None

    def speedup_ci(self, baseline: str) -> Optional[list[float]]:
        best = self.best_for(baseline)
        return best.speedup_ci(baseline) if best else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task, "attempts": self.attempts, "correct": self.correct,
            "correct_attempts": self.correct_attempts, "flagged_attempts": self.flagged_attempts,
            "flagged_only": self.flagged_only,
            "best_attempt_id": self.best.attempt_id if self.best else None,
            "best_status": self.best.status if self.best else None,
            "best_eager_attempt_id": self.best_eager.attempt_id if self.best_eager else None,
            "best_compile_attempt_id": self.best_compile.attempt_id if self.best_compile else None,
            "speedup_eager": self.speedup("eager"), "speedup_compile": self.speedup("compile"),
            "speedup_eager_ci": self.speedup_ci("eager"), "speedup_compile_ci": self.speedup_ci("compile"),
            "runtime_ms": self.best.runtime_ms if self.best else -1.0,
            "floor_fraction": self.best_eager.floor_fraction if self.best_eager else None,
            "best_by_round": {str(r): v for r, v in sorted(self.best_by_round.items())},
        }


@dataclass
class RunMetrics:
    tasks: int
    tasks_correct: int
    tasks_flagged_only: int
    correctness_rate: float
    attempts: int
    evaluated_attempts: int
    correct_attempts: int
    flagged_attempts: int
    attempt_correctness_rate: float
    fast_p_eager: dict[str, Optional[float]]
    fast_p_compile: dict[str, Optional[float]]
    geomean_speedup_eager: Optional[float]
    geomean_speedup_compile: Optional[float]
    median_floor_fraction: Optional[float]
    prompt_tokens: int
    completion_tokens: int
    tokens: int
    cost_usd: Optional[float]
    tokens_per_correct_kernel: Optional[float]
    cost_per_correct_kernel: Optional[float]
    flag_counts: dict[str, int]
    status_counts: dict[str, int]
    per_task: list[TaskMetrics]
    infra_error_attempts: int = 0          # harness failures: in no rate
    tasks_infra_only: int = 0              # tasks with nothing but harness failures: in no rate
    fast_p_eager_ci: dict[str, Optional[list[float]]] = field(default_factory=dict)   # see fast_p_interval
    fast_p_compile_ci: dict[str, Optional[list[float]]] = field(default_factory=dict)
    geomean_floor_fraction: Optional[float] = None

    def task(self, name: str) -> TaskMetrics:
        for t in self.per_task:
            if t.task == name:
                return t
        raise KeyError(name)

    def fast_p(self, baseline: str) -> dict[str, Optional[float]]:
        return self.fast_p_eager if baseline == "eager" else self.fast_p_compile

    def summary_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "per_task"}
        d["fast_p_thresholds"] = [p_key(p) for p in FAST_P_THRESHOLDS]
        return d

    def to_dict(self) -> dict[str, Any]:
        d = self.summary_dict()
        d["per_task"] = [t.to_dict() for t in self.per_task]
        return d


# ----------------------------------------------------------------------------- pure functions

def json_safe(x: Any) -> Any:
    """A copy with every non-finite float (NaN, inf) replaced by None, so it is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def geomean(values: Iterable[Optional[float]]) -> Optional[float]:
    """Geometric mean of the positive values; None when there are none."""
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def _speed_key(rec: AttemptRecord, baseline: str) -> tuple:
    s = rec.speedup(baseline)
    ms = rec.candidate_ms if rec.candidate_ms is not None else math.inf
    return (s if s is not None else -math.inf, -ms, -rec.attempt_id)


def best_attempt(records: Iterable[AttemptRecord], baseline: str = "eager") -> Optional[AttemptRecord]:
    """The clean-correct attempt with the highest speedup against ``baseline`` (None if none).

    For compile, only attempts with a compile speedup are candidates (a correct task whose
    compile baseline was not timed has no best-vs-compile)."""
    pool = [r for r in records if r.correct]
    if baseline == "compile":
        pool = [r for r in pool if r.speedup_compile is not None]
    if not pool:
        return None
    return max(pool, key=lambda r: _speed_key(r, baseline))


def furthest_attempt(records: Iterable[AttemptRecord]) -> Optional[AttemptRecord]:
    """For a task without a correct kernel: the attempt that got furthest (ties: latest)."""
    recs = list(records)
    if not recs:
        return None
    return max(recs, key=lambda r: (_PROGRESS.get(r.status, 0), r.round, r.attempt_id))


def best_by_round(records: Iterable[AttemptRecord]) -> dict[int, Optional[float]]:
    """Round -> best clean-correct speedup vs eager among attempts up to that round."""
    recs = list(records)
    out: dict[int, Optional[float]] = {}
    best: Optional[float] = None
    for rnd in sorted({r.round for r in recs}):
        for r in recs:
            if r.round == rnd and r.correct and r.speedup_eager is not None:
                best = r.speedup_eager if best is None else max(best, r.speedup_eager)
        out[rnd] = best
    return out


def task_metrics(task: str, records: list[AttemptRecord]) -> TaskMetrics:
    best_e = best_attempt(records, "eager")
    if best_e is None:
        # correct but never timed against eager: still a correct kernel
        pool = [r for r in records if r.correct]
        best_e = max(pool, key=lambda r: _speed_key(r, "eager")) if pool else None
    return TaskMetrics(
        task=task, attempts=len(records),
        correct_attempts=sum(r.correct for r in records),
        flagged_attempts=sum(r.flagged for r in records),
        best_eager=best_e, best_compile=best_attempt(records, "compile"),
        best=best_e or furthest_attempt(records), best_by_round=best_by_round(records),
        infra_only=bool(records) and all(r.infra for r in records))


def fast_p(per_task: list[TaskMetrics], p: float, baseline: str = "eager") -> Optional[float]:
    """KernelBench fast_p: share of all tasks whose best is correct with speedup > p."""
    if not per_task:
        return None
    hits = 0
    for t in per_task:
        if not t.correct:
            continue
        if p == 0:
            hits += 1
            continue
        s = t.speedup(baseline)
        if s is not None and s > p:
            hits += 1
    return hits / len(per_task)


def fast_p_interval(per_task: list[TaskMetrics], p: float, baseline: str = "eager") -> Optional[list[float]]:
    """fast_p as the best attempts' speedup intervals allow it: [the share whose whole interval
    exceeds p, the share whose interval reaches above p] (a speedup without an interval counts
    by its point estimate on both sides). fast_p itself stays KernelBench's point estimate."""
    if not per_task:
        return None
    low = high = 0
    for t in per_task:
        if not t.correct:
            continue
        if p == 0:
            low, high = low + 1, high + 1
            continue
        s, ci = t.speedup(baseline), t.speedup_ci(baseline)
        if s is None:
            continue
        lo, hi = (ci[0], ci[1]) if ci else (s, s)
        low += lo > p
        high += hi > p
    return [low / len(per_task), high / len(per_task)]


def compute_metrics(records: list[AttemptRecord], calls: Iterable[CallRecord] = (),
                    task_names: Iterable[str] = ()) -> RunMetrics:
    """All run metrics from plain records. ``task_names`` adds tasks that have no attempt."""
    calls = list(calls)
    by_task: dict[str, list[AttemptRecord]] = {}
    for name in task_names:
        by_task.setdefault(name, [])
    for c in calls:
        if c.task is not None:
            by_task.setdefault(c.task, [])
    for r in records:
        by_task.setdefault(r.task, []).append(r)
    for recs in by_task.values():
        recs.sort(key=lambda r: (r.round, r.sample, r.attempt_id))

    per_task = [task_metrics(name, recs) for name, recs in sorted(by_task.items())]
    scored = [t for t in per_task if not t.infra_only]      # harness failures are no verdicts
    n_tasks = len(scored)
    n_correct = sum(t.correct for t in per_task)
    correct_tasks = [t for t in per_task if t.correct]

    fp: dict[str, dict[str, Optional[float]]] = {}
    fp_ci: dict[str, dict[str, Optional[list[float]]]] = {}
    for baseline in BASELINES:
        measured = any(r.correct and r.speedup(baseline) is not None for r in records)
        fp[baseline] = {p_key(p): (fast_p(scored, p, baseline) if (measured or baseline == "eager") and n_tasks
                                   else None) for p in FAST_P_THRESHOLDS}
        fp_ci[baseline] = {p_key(p): (fast_p_interval(scored, p, baseline) if (measured or baseline == "eager")
                                      and n_tasks else None) for p in FAST_P_THRESHOLDS}

    flag_counts: dict[str, int] = {}
    status_counts: dict[str, int] = {}
    for r in records:
        status_counts[r.status or f"not_evaluated:{r.parse_status}"] = \
            status_counts.get(r.status or f"not_evaluated:{r.parse_status}", 0) + 1
        for f in dict.fromkeys(r.flags):     # attempts per flag: one flag may come with two reasons
            flag_counts[f] = flag_counts.get(f, 0) + 1

    prompt_tokens = sum(c.prompt_tokens or 0 for c in calls)
    completion_tokens = sum(c.completion_tokens or 0 for c in calls)
    tokens = prompt_tokens + completion_tokens
    costs = [c.cost_usd for c in calls if c.cost_usd is not None]
    cost = sum(costs) if costs else None
    n_infra = sum(r.infra for r in records)
    n_attempts = len(records) - n_infra
    n_correct_attempts = sum(r.correct for r in records)

    return RunMetrics(
        tasks=n_tasks, tasks_correct=n_correct,
        tasks_flagged_only=sum(t.flagged_only for t in per_task),
        correctness_rate=n_correct / n_tasks if n_tasks else 0.0,
        attempts=n_attempts, evaluated_attempts=sum(r.status is not None and not r.infra for r in records),
        correct_attempts=n_correct_attempts, flagged_attempts=sum(r.flagged for r in records),
        attempt_correctness_rate=n_correct_attempts / n_attempts if n_attempts else 0.0,
        fast_p_eager=fp["eager"], fast_p_compile=fp["compile"],
        geomean_speedup_eager=geomean(t.speedup("eager") for t in correct_tasks),
        geomean_speedup_compile=geomean(t.speedup("compile") for t in correct_tasks),
        median_floor_fraction=median(t.best_eager.floor_fraction for t in correct_tasks),
        geomean_floor_fraction=geomean(t.best_eager.floor_fraction for t in correct_tasks),
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, tokens=tokens, cost_usd=cost,
        tokens_per_correct_kernel=tokens / n_correct if n_correct else None,
        cost_per_correct_kernel=(cost / n_correct) if (n_correct and cost is not None) else None,
        flag_counts=dict(sorted(flag_counts.items())), status_counts=dict(sorted(status_counts.items())),
        per_task=per_task, infra_error_attempts=n_infra,
        fast_p_eager_ci=fp_ci["eager"], fast_p_compile_ci=fp_ci["compile"],
        tasks_infra_only=len(per_task) - len(scored))


def fast_p_curve(per_task: list[TaskMetrics], baseline: str, ps: Iterable[float]) -> list[Optional[float]]:
    return [fast_p(per_task, p, baseline) for p in ps]


# ----------------------------------------------------------------------------- compare

SAME_BAND = 0.05   # a best speedup within 5% of the other run's counts as "same"


def _side(t: Optional[TaskMetrics]) -> dict[str, Any]:
    if t is None:
        return {"present": False, "correct": False, "status": None, "speedup_eager": None,
                "speedup_compile": None, "runtime_ms": None, "attempt_id": None}
    best = t.best
    status = None
    if best is not None:
        status = best.status or f"not evaluated ({best.parse_status})"
        if best.flagged:
            status = f"correct (flagged: {', '.join(best.flags)})"
    return {"present": True, "correct": t.correct, "status": status or "no attempt",
            "speedup_eager": t.speedup("eager"), "speedup_compile": t.speedup("compile"),
            "runtime_ms": best.runtime_ms if best else -1.0, "attempt_id": best.attempt_id if best else None}


def compare_metrics(a: RunMetrics, b: RunMetrics) -> dict[str, Any]:
    """Task-by-task comparison of two runs (matched by task name), B against A.

    Per task: each side's best status, speedup and runtime; ``delta_speedup_eager`` is
    B - A and ``speedup_ratio`` B / A (both correct only); ``change`` is one of
    newly_correct, newly_incorrect, faster, slower, same (within ``SAME_BAND``),
    both_incorrect, only_a, only_b. Summary: the lists of newly correct/incorrect tasks,
    each run's geomean speedup and fast_p, the geomean change (B / A), and the geomean of
    the per-task ratios over tasks correct in both runs."""
    ta = {t.task: t for t in a.per_task}
    tb = {t.task: t for t in b.per_task}
    rows = []
    for name in sorted(set(ta) | set(tb)):
        sa_, sb_ = _side(ta.get(name)), _side(tb.get(name))
        delta = ratio = None
        if not sa_["present"]:
            change = "only_b"
        elif not sb_["present"]:
            change = "only_a"
        elif sa_["correct"] and not sb_["correct"]:
            change = "newly_incorrect"
        elif sb_["correct"] and not sa_["correct"]:
            change = "newly_correct"
        elif not sa_["correct"]:
            change = "both_incorrect"
        else:
            ea, eb = sa_["speedup_eager"], sb_["speedup_eager"]
            if ea is not None and eb is not None:
                delta = eb - ea
                ratio = eb / ea if ea > 0 else None
            if ratio is None:
                change = "same"
            elif ratio > 1 + SAME_BAND:
                change = "faster"
            elif ratio < 1 - SAME_BAND:
                change = "slower"
            else:
                change = "same"
        rows.append({"task": name, "a": sa_, "b": sb_, "delta_speedup_eager": delta,
                     "speedup_ratio": ratio, "change": change})

    def names(kind: str) -> list[str]:
        return [r["task"] for r in rows if r["change"] == kind]

    ga, gb = a.geomean_speedup_eager, b.geomean_speedup_eager
    gca, gcb = a.geomean_speedup_compile, b.geomean_speedup_compile
    summary = {
        "tasks_a": a.tasks, "tasks_b": b.tasks, "tasks_common": sum(1 for r in rows if r["a"]["present"] and r["b"]["present"]),
        "correct_a": a.tasks_correct, "correct_b": b.tasks_correct,
        "correctness_rate_a": a.correctness_rate, "correctness_rate_b": b.correctness_rate,
        "newly_correct": names("newly_correct"), "newly_incorrect": names("newly_incorrect"),
        "faster": names("faster"), "slower": names("slower"), "same": names("same"),
        "both_incorrect": names("both_incorrect"), "only_a": names("only_a"), "only_b": names("only_b"),
        "geomean_speedup_eager_a": ga, "geomean_speedup_eager_b": gb,
        "geomean_change_eager": (gb / ga) if (ga and gb) else None,
        "geomean_speedup_compile_a": gca, "geomean_speedup_compile_b": gcb,
        "geomean_change_compile": (gcb / gca) if (gca and gcb) else None,
        "geomean_ratio_common": geomean(r["speedup_ratio"] for r in rows if r["speedup_ratio"] is not None),
        "fast_p_eager_a": a.fast_p_eager, "fast_p_eager_b": b.fast_p_eager,
        "fast_p_compile_a": a.fast_p_compile, "fast_p_compile_b": b.fast_p_compile,
        "tokens_per_correct_kernel_a": a.tokens_per_correct_kernel,
        "tokens_per_correct_kernel_b": b.tokens_per_correct_kernel,
        "cost_per_correct_kernel_a": a.cost_per_correct_kernel, "cost_per_correct_kernel_b": b.cost_per_correct_kernel,
    }
    return {"tasks": rows, "summary": summary}
