"""The numerics table: per task, KernelBench's published eager time beside kernelloop's eager
under `default` and `strict` math, from the store's newest baselines (kernelloop baseline
--math default / --math strict) on this device. Prints markdown.

    python scripts/numerics_table.py [--db PATH]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sqlalchemy as sa  # noqa: E402

from evals.kernelbench import kernelbench_root  # noqa: E402
from evals.published import lookup_published  # noqa: E402
from store import Store  # noqa: E402
from store.models import Baseline, Task  # noqa: E402


def _local(path: str, name: str) -> Path:
    """The task file here: the stored path, else the same task in this host's KernelBench checkout
    (a store brought back from a GPU host names that host's copy)."""
    p = Path(path)
    return p if p.is_file() else kernelbench_root() / f"{name}.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default=None)
    args = ap.parse_args()
    store = Store(args.db)
    latest: dict[tuple[str, str], Baseline] = {}
    paths: dict[str, str] = {}
    with store.reader() as s:
        for b, t in s.execute(sa.select(Baseline, Task).join(Task, Task.id == Baseline.task_id).order_by(Baseline.id)):
            latest[(t.name, b.numerics or "")] = b
            paths[t.name] = t.path
            device = b.device_name
        print("| task | published eager ms | default eager ms | default/published | strict eager ms | strict/default | "
              "published compile ms | default compile ms |")
        print("|---|---|---|---|---|---|---|---|")
        for name in sorted(paths, key=lambda n: (n.split("/")[0], int(n.split("/")[1].split("_")[0]) if "_" in n else 0)):
            d, st = latest.get((name, "fp32/default")), latest.get((name, "fp32/strict"))
            pub = lookup_published(_local(paths[name], name), device).published
            pe = pub.eager.mean_ms if pub and pub.eager else None
            pc = pub.compile.mean_ms if pub and pub.compile else None

            def f(x):
                return "-" if x is None else f"{x:.3g}"

            de, se = (d.eager_ms if d else None), (st.eager_ms if st else None)
            print(f"| {name} | {f(pe)} | {f(de)} | {f(de / pe) if de and pe else '-'} | {f(se)} | "
                  f"{f(se / de) if se and de else '-'} | {f(pc)} | {f(d.compile_ms if d else None)} |")
    store.close()


if __name__ == "__main__":
    main()
