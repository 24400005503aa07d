"""Whether a run's record is whole: no (task, round, sample) attempt stored twice, every attempt
with code evaluated exactly once, no evaluation without its attempt. What the fault tests and
``scripts/gpu_ray.sh`` check after a node or the driver was killed mid-run (any store URL).

    python -m executors.audit RUN [--db URL]      # prints the audit as JSON; exit 1 if not whole
"""
from __future__ import annotations

import json
import sys
from typing import Any

import sqlalchemy as sa

from store.models import Attempt, Evaluation, Run


def run_audit(store: Any, run_id: int) -> dict[str, Any]:
    with store.reader() as s:
        run = s.get(Run, run_id)
        attempts = list(s.execute(sa.select(Attempt.id, Attempt.task_id, Attempt.round, Attempt.sample,
                                            Attempt.parse_status).where(Attempt.run_id == run_id)))
        evals = dict(s.execute(sa.select(Evaluation.attempt_id, sa.func.count(Evaluation.id))
                               .where(Evaluation.run_id == run_id).group_by(Evaluation.attempt_id)).all())
        statuses = dict(s.execute(sa.select(Evaluation.status, sa.func.count(Evaluation.id))
                                  .where(Evaluation.run_id == run_id).group_by(Evaluation.status)).all())
        infra_retried = sum(1 for (r,) in s.execute(sa.select(Evaluation.result).where(Evaluation.run_id == run_id))
                            if r.get("infra_retries"))
    keys = [(a.task_id, a.round, a.sample) for a in attempts]
    duplicated = sorted({k for k in keys if keys.count(k) > 1})
    with_code = {a.id for a in attempts if a.parse_status == "ok"}
    not_once = {a_id: evals.get(a_id, 0) for a_id in with_code if evals.get(a_id, 0) != 1}
    stray = sorted(a_id for a_id in evals if a_id not in with_code)
    return {"run": run_id, "status": run.status if run else None, "attempts": len(attempts),
            "attempts_with_code": len(with_code), "evaluations": sum(evals.values()), "statuses": statuses,
            "evaluations_with_infra_retries": infra_retried, "duplicated_attempts": duplicated,
            "not_evaluated_once": not_once, "evaluations_without_code": stray,
            "whole": bool(run) and not duplicated and not not_once and not stray}


def main(argv: list[str]) -> int:
    import argparse

    from store import Store

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=int)
    ap.add_argument("--db", default=None, help="store file or SQLAlchemy URL [default: KERNELLOOP_DB]")
    args = ap.parse_args(argv)
    store = Store(args.db)
    try:
        audit = run_audit(store, args.run)
    finally:
        store.close()
    print(json.dumps(audit, default=str))
    return 0 if audit["whole"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
