"""Each generated kernel's achieved memory bandwidth in the best clean builtin candidates of a run:
the least bytes its group must move (``agent.builtin.group_traffic``: every input read once, the
output written once, at the task's sizes) over the kernel's time in the candidate's stored profile.
A kernel with little arithmetic far below the device's bandwidth is where the generator leaves
time: in session ad's level-2 run on an H200 the fused pools with a bias before them moved
1.4-2.2 TB/s where the elementwise kernels after the same convolutions moved 4.0-4.4
(``evals/gpu_runs/2026-11-29-session-ae.md``). A profile whose kernels add up to more than the timed
forward (``prof/timed`` above 1.15: taken beside other work on the device) is marked ``*``; its
figures are not the kernel's.

    python scripts/kernel_bandwidth.py RUN [--db URL] [--kind pool] [--json]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.builtin import group_traffic  # noqa: E402
from agent.builtin.feedback import parse_header  # noqa: E402
from evals.metrics import best_attempt  # noqa: E402
from evals.run_data import evaluation_result, load_run  # noqa: E402
from sandbox.numerics import numerics_of_run_config  # noqa: E402
from sandbox.tasks import TaskSpec  # noqa: E402
from store import Store  # noqa: E402

DISTURBED = 1.15        # a profile's kernels summed to this much more than the timed median


def rows_for(session, run: int) -> tuple[str, list[dict]]:
    """(the run's device and numerics, in words; a row per generated kernel of each task's best)."""
    data = load_run(session, run)
    numerics, _ = numerics_of_run_config(data.run.get("config"))
    rows = []
    for task in data.task_names:
        best = best_attempt(data.records_for(task))
        header = parse_header(best.source) if best is not None else None
        if best is None or best.evaluation_id is None or not header or header.get("generator") != "builtin":
            continue
        result = evaluation_result(session, best.evaluation_id)
        profile = result.get("profile") or []
        if not profile or not best.candidate_ms:
            continue
        spec = TaskSpec(name=task, path=f"{task}.py", source=data.task_sources[task])
        try:
            traffic = group_traffic(spec, header.get("device", "cuda"), header, numerics)
        except Exception as exc:  # noqa: BLE001 - one task's trace failing leaves the others
            print(f"{task}: not traced ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        ratio = sum(k["total_us"] for k in profile) / 1e3 / best.candidate_ms
        for k in profile:
            m = re.search(r"\b(kl_g\d+)_", k["name"])
            if not m or m.group(1) not in traffic or not k.get("total_us"):
                continue
            g = traffic[m.group(1)]
            rows.append({"task": task, "group": m.group(1), "kind": g["kind"], "ops": "+".join(g["ops"]),
                         "kernel": k["name"].split("(")[0], "us": k["total_us"], "bytes": g["bytes"],
                         "tb_s": g["bytes"] / k["total_us"] / 1e6, "prof_over_timed": ratio})
    return f"{data.run['device']} {data.run['device_name']} / {numerics.label}", rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=int)
    ap.add_argument("--db", default=None, help="the store (default: the configured one)")
    ap.add_argument("--kind", default=None, help="only groups of this kind (ew, pool, reduce, norm, conv)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with Store(args.db).reader() as session:
        where, rows = rows_for(session, args.run)
    rows = [r for r in rows if args.kind in (None, r["kind"])]
    rows.sort(key=lambda r: -r["us"])
    if args.json:
        print(json.dumps({"device_and_numerics": where, "kernels": rows}, indent=1))
        return
    print(f"device and numerics: {where}\n")
    print("| task | group | kind | operators | kernel | us per forward | least MB | TB/s | prof/timed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mark = " *" if r["prof_over_timed"] > DISTURBED else ""
        print(f"| {r['task']} | {r['group']} | {r['kind']} | {r['ops'][:60]} | {r['kernel'][-40:]} | {r['us']:.1f} | "
              f"{r['bytes'] / 1e6:.1f} | {r['tb_s']:.2f} | {r['prof_over_timed']:.2f}{mark} |")
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        if r["prof_over_timed"] <= DISTURBED and r["us"] >= 100:
            by_kind.setdefault(r["kind"], []).append(r["tb_s"])
    print("\nmedian TB/s of kernels of 100 us or more, undisturbed profiles: " + "; ".join(
        f"{k} {sorted(v)[len(v) // 2]:.2f} ({len(v)})" for k, v in sorted(by_kind.items())))


if __name__ == "__main__":
    main()
