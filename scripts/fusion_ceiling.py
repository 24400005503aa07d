"""How far fusion alone can go: per task of a stored run, the reference's eager time against
the time its library kernels (GEMM, convolution, FFT convolution: what the builtin leaves on
PyTorch) take by themselves in the reference's own profile. A candidate that keeps those
kernels cannot beat ``eager / library`` even if everything else were free, so the geomean of
that ceiling bounds the builtin's geomean on the run's tasks.

    python scripts/fusion_ceiling.py RUN [--db kernelloop.db]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.critic.grounded import is_library_kernel  # noqa: E402
from evals.metrics import best_attempt  # noqa: E402
from evals.run_data import evaluation_result, load_run  # noqa: E402
from store import Store  # noqa: E402


NORMS = ("bn_fw", "bn_bw", "batch_norm", "layer_norm", "group_norm", "instance_norm")


def library_kernel(name: str) -> bool:
    low = name.lower()
    if any(n in low for n in NORMS):        # cuDNN's batch norm: the builtin fuses those
        return False
    return is_library_kernel(name) or "fft" in low      # cuDNN's FFT convolutions


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=int)
    ap.add_argument("--db", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    store = Store(args.db)
    rows = []
    with store.reader() as session:
        data = load_run(session, args.run)
        for task in data.task_names:
            best = best_attempt(data.records_for(task))
            if best is None or best.evaluation_id is None or not best.eager_ms:
                continue
            result = evaluation_result(session, best.evaluation_id)
            ref = result.get("reference_profile") or []
            lib_ms = sum(k["total_us"] for k in ref if library_kernel(k["name"])) / 1e3
            rows.append({"task": task, "eager_ms": best.eager_ms, "best_ms": best.candidate_ms,
                         "speedup": best.eager_ms / best.candidate_ms, "library_ms": lib_ms or None,
                         "ceiling": best.eager_ms / lib_ms if lib_ms else None})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| task | eager ms | best ms | vs eager | library kernels ms | ceiling (eager / library) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lib = f"{r['library_ms']:.3g}" if r["library_ms"] else "-"
        ceil = f"{r['ceiling']:.2f}x" if r["ceiling"] else "-"
        print(f"| {r['task']} | {r['eager_ms']:.3g} | {r['best_ms']:.3g} | {r['speedup']:.2f}x | {lib} | {ceil} |")
    ceilings = [r["ceiling"] for r in rows if r["ceiling"]]
    print(f"\n{len(rows)} tasks: geomean vs eager {geomean([r['speedup'] for r in rows]):.3f}x; "
          f"geomean ceiling over the {len(ceilings)} tasks with library kernels {geomean(ceilings):.3f}x")


if __name__ == "__main__":
    main()
