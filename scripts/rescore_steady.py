"""Stored evaluations re-judged by the steady-window rule (``sandbox.quiet.unsteady``), without a GPU.

The judge times a reference again where its median is far above its own fastest run, and flags
the evaluation ``contended`` where the second window is unsteady too. Stores written before that
rule keep every run of every timing (``samples_ms``), so the rule can be applied to them after the
fact: this copies each store given into OUT_DIR (the originals are never written) and flags, in the
copy, each evaluation whose stored eager or compiled reference timing, or (the live rule's since
session af, ``sandbox.steady``) whose candidate's timing, is unsteady. There was no
second window then, so the copy is stricter than the live rule (which keeps an evaluation whose
retime is steady). It also flags each evaluation whose eager (or compiled) median is far above the
fastest eager (compiled) median of the same task in the store (``sandbox.quiet.slower``: a whole window
slow and steady, as launch-bound references ran in session w's lanes, and level2/82's first compiled
window in session ag's); the live rule compares with the evaluations before it only, this one with
all of them. Read the copies with ``report`` or ``scripts/suite_table.py``.

    python scripts/rescore_steady.py /tmp/rescored .gpu-store/u-l2/lane_0.db .gpu-store/u-l2/lane_1.db
"""
from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox.quiet import slower, unsteady  # noqa: E402
from sandbox.result import Timing  # noqa: E402

TIMINGS = ("eager_time", "compile_time", "candidate_time")
REFERENCE_TIMINGS = ("eager_time", "compile_time")


def rescore(store: Path, out_dir: Path) -> tuple[Path, int, int]:
    """The re-scored copy of ``store`` in ``out_dir``; evaluations read and flagged."""
    dst = out_dir / "_".join(store.resolve().parts[-2:])
    shutil.copyfile(store, dst)
    con = sqlite3.connect(dst)
    try:
        rows = con.execute("select id, result from evaluations").fetchall()
        results = {eid: json.loads(raw) for eid, raw in rows}
        fastest: dict[tuple[str, str], float] = {}
        for result in results.values():
            for kind in REFERENCE_TIMINGS:
                key, ms = (_task(result), kind), (result.get(kind) or {}).get("median_ms")
                if ms:
                    fastest[key] = min(ms, fastest.get(key, ms))
        flagged = 0
        for eid, result in results.items():
            why = [f"{k}: {w}" for k in TIMINGS if result.get(k)
                   for w in [unsteady(Timing(**result[k]))] if w]
            for kind in REFERENCE_TIMINGS:
                if result.get(kind):
                    far = slower(result[kind]["median_ms"], fastest.get((_task(result), kind)))
                    if far:
                        why.append(f"{kind}: {far.replace('so far', 'in the store')}")
            if not why:
                continue
            result.setdefault("flags", []).append(
                {"kind": "contended", "reason": "re-scored, not one steady window: " + "; ".join(why)})
            con.execute("update evaluations set result = ?, contended = 1 where id = ?", (json.dumps(result), eid))
            flagged += 1
        con.commit()
    finally:
        con.close()
    return dst, len(rows), flagged


def _task(result: dict) -> str:
    return str(result.get("task_sha256") or result.get("task") or "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="where the re-scored copies go (created)")
    ap.add_argument("stores", type=Path, nargs="+", help="SQLite stores to re-score (read only)")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for store in args.stores:
        if not store.is_file():
            ap.error(f"no store at {store}")
        dst, n, flagged = rescore(store, args.out_dir)
        print(f"{store} -> {dst}: {flagged} of {n} evaluations flagged contended (an unsteady reference or candidate window, "
              "or a reference median over 1.25x the task's fastest of its kind in the store)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
