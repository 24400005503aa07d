"""The last optimisation run of each (backend, numerics) in a store, per task, side by side:
eager and torch.compile (the fastest of the run's measurements), the fastest clean candidate and
the roofline floor, in ms, each row under its run's numerics convention (precision/math, as
``Numerics.label``: ``fp32/default``). ``python scripts/backend_table.py STORE.db`` (gpu_check.sh triton-table)."""
from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sandbox.result import DISQUALIFYING_FLAGS  # noqa: E402

# the best is the fastest clean candidate (EvalResult.clean): correct, no disqualifying flag
BAD = sorted(f.value for f in DISQUALIFYING_FLAGS)
# a run's numerics label; runs stored before numerics were recorded say so rather than guess
NUMERICS = ("coalesce(json_extract({c}, '$.eval.numerics.precision') || '/' || "
            "json_extract({c}, '$.eval.numerics.math'), 'not recorded')")
QUERY = f"""
select r.id, coalesce(r.backend, r.device), {NUMERICS.format(c="r.config")}, t.name,
  min(json_extract(e.result, '$.eager_time.median_ms')), min(json_extract(e.result, '$.compile_time.median_ms')),
  min(case when e.status = 'correct' and not exists (select 1 from json_each(e.result, '$.flags') f
           where json_extract(f.value, '$.kind') in ({", ".join(f"'{k}'" for k in BAD)}))
      then json_extract(e.result, '$.candidate_time.median_ms') end),
  min(json_extract(e.result, '$.floor_ms'))
from runs r join attempts a on a.run_id = r.id join tasks t on t.id = a.task_id join evaluations e on e.attempt_id = a.id
where r.id in (select max(id) from runs where kind = 'optimize'
               group by coalesce(backend, device), {NUMERICS.format(c="config")})
group by r.id, t.name order by t.name, 3, 2
"""


def main() -> None:
    rows = sqlite3.connect(sys.argv[1]).execute(QUERY).fetchall()
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print("| task | backend | numerics | run | eager ms | compile ms | best ms | floor ms | best vs eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run, backend, numerics, task, eager, comp, best, floor in rows:
        ratio = f"{eager / best:.2f}x" if eager and best else "-"
        print(f"| {task} | {backend} | {numerics} | {run} | {fmt(eager)} | {fmt(comp)} | {fmt(best)} | {fmt(floor)} | {ratio} |")


if __name__ == "__main__":
    main()
