"""Seed-style documents: per task, what the user's example analyses (``../shared/seeds/``) hold.

The task, then every candidate in the seeds' block layout (``Kernel:`` / ``Evaluation:`` /
``Runtime:``), then an analysis: the candidates side by side with verdict and runtime, why each
is correct or not, why some are faster (each speed with its interval, and the fastest against
the others), and a summary table. Written from stored evidence only, by the grounded critic's
diagnoses and ``templates/seed_doc.txt.j2`` (StrictUndefined): every number in the analysis is
a stored figure (``tests`` check each one).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import jinja2

from agent.critic.fmt import fmt_ms, fmt_x
from agent.critic.grounded import GroundedCritic, best_attempt
from agent.critic.uncertainty import interval_text, speed_claim
from agent.types import AttemptView, DeviceFacts
from sandbox.intervals import speedup_interval
from sandbox.tasks import TaskSpec

TEMPLATES = Path(__file__).resolve().parent / "templates"


def seed_runtime(a: AttemptView) -> str:
    """The seeds' runtime: the median in ms of a clean correct kernel, else -1.0."""
    r = a.result
    if r is None or not r.clean or r.candidate_time is None:
        return "-1.0"
    return repr(float(round(r.candidate_time.median_ms, 4)))


def _versus_best(a: AttemptView, best: AttemptView) -> Optional[str]:
    iv = speedup_interval(a.result.candidate_time, best.result.candidate_time)
    if iv is None:
        return None
    label = {"faster": "faster than", "slower": "slower than"}.get(iv.label, "inconclusive against")
    if iv.label != "inconclusive" and fmt_x(iv.low if iv.label == "faster" else iv.high) == fmt_x(1.0):
        label = "inconclusive against"
    return (f"attempt {best.attempt_id} ({fmt_ms(best.result.candidate_time.median_ms)}) is {fmt_x(iv.point)} "
            f"the speed of attempt {a.attempt_id} ({fmt_ms(a.result.candidate_time.median_ms)}): "
            f"{'faster' if label == 'faster than' else 'slower' if label == 'slower than' else 'inconclusive'} "
            f"({interval_text(iv)})")


def seed_context(task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts) -> dict[str, Any]:
    critic = GroundedCritic()
    diags = critic.diagnose(task, attempts, device)
    best = best_attempt(attempts)
    rows = []
    for d in diags:
        a, r = d.attempt, d.attempt.result
        claim = speed_claim(r, "eager") if r is not None and r.correct and r.candidate_time else None
        rows.append({"id": a.attempt_id, "round": a.round, "sample": a.sample, "verdict": d.verdict,
                     "evaluation": bool(r is not None and r.clean), "runtime": seed_runtime(a),
                     "source": (a.source or "").rstrip("\n"), "short": d.short.replace("|", "\\|"),
                     "bullets": d.bullets,
                     "speed": claim.sentence if claim else None,
                     "speed_cell": (f"{fmt_x(claim.interval.point)} [{fmt_x(claim.interval.low)}-"
                                    f"{fmt_x(claim.interval.high)}]") if claim else "-",
                     "label": claim.label if claim else None,
                     "versus_best": (_versus_best(a, best) if best is not None and a is not best and r is not None
                                     and r.clean and r.candidate_time else None)})
    return {"task": task, "rows": rows, "best": best.attempt_id if best is not None else None,
            "correct": [r for r in rows if r["evaluation"]], "incorrect": [r for r in rows if not r["evaluation"]]}


def seed_document(task: TaskSpec, attempts: list[AttemptView], device: DeviceFacts) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             autoescape=False, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    return env.get_template("seed_doc.txt.j2").render(**seed_context(task, attempts, device))
