"""``kernelloop report``, ``kernelloop export`` and ``kernelloop compare``."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from kernelloop.cli_common import DbOption, console, fail, open_store


def _load(store, run_id: int):
    from evals.run_data import load_run

    with store.reader() as session:
        try:
            return load_run(session, run_id)
        except LookupError as exc:
            fail(str(exc))


def report_command(
    run: int = typer.Argument(..., help="run id (kernelloop runs lists them)"),
    fmt: str = typer.Option("md", "--format", "-f", help="md, html (one self-contained file) or json"),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="write here instead of stdout (md: plots go to <stem>_plots/)"),
    embed: bool = typer.Option(False, "--embed-images", help="md: put plots inline as data URIs even with -o"),
    db: Optional[str] = DbOption,
) -> None:
    """Write a run's analysis report: numerics, summary, fast_p, plots, and per task the analysis,
    attempts, best kernel and its diff against its parent, and KernelBench's published timings
    beside the measured reference where the task has them."""
    from evals.report import FORMATS, task_paths_of, write_report

    if fmt not in FORMATS:
        fail(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    store = open_store(db)
    try:
        data = _load(store, run)
        with store.reader() as session:
            task_paths = task_paths_of(session, data)
        text = write_report(data, fmt, output, embed=embed, task_paths=task_paths)
    finally:
        store.close()
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        m = data.metrics
        console.print(f"wrote {output} ({fmt}): {m.tasks} tasks, {m.tasks_correct} correct, "
                      f"{m.attempts} attempts", highlight=False)


def export_command(
    run: int = typer.Argument(..., help="run id"),
    jsonl: Optional[Path] = typer.Option(None, "--jsonl", help="write one JSON record per attempt and per analysis here"),
    seed_format: Optional[Path] = typer.Option(None, "--seed-format",
                                               help="write one seed-format text document per task into this folder"),
    db: Optional[str] = DbOption,
) -> None:
    """Export a run's attempts (prompt, completion, candidate, EvalResult) and analyses."""
    from evals.export import export_jsonl, export_seed_format
    from evals.run_data import load_run

    if jsonl is None and seed_format is None:
        fail("say what to write: --jsonl PATH and/or --seed-format DIR")
    store = open_store(db)
    try:
        with store.reader() as session:
            try:
                data = load_run(session, run)
            except LookupError as exc:
                fail(str(exc))
            if jsonl is not None:
                counts = export_jsonl(session, run, jsonl)
                console.print(f"wrote {jsonl}: {counts['attempt']} attempt and {counts['analysis']} analysis records",
                              highlight=False)
            if seed_format is not None:
                paths = export_seed_format(session, run, seed_format, data=data)
                console.print(f"wrote {len(paths)} seed-format documents to {seed_format}", highlight=False)
    finally:
        store.close()


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ms(v: Optional[float]) -> str:
    from evals.report import fmt_ms

    return "-" if v is None else fmt_ms(v)


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


_CHANGE_STYLE = {"newly_correct": "bold green", "newly_incorrect": "bold red", "faster": "green",
                 "slower": "red", "same": "", "both_incorrect": "dim", "only_a": "yellow", "only_b": "yellow"}


def print_comparison(result: dict[str, Any], run_a: int, run_b: int) -> None:
    from rich.table import Table

    conv = result.get("numerics") or {}
    if conv.get("note"):
        console.print(f"[bold yellow]warning:[/] {conv['note']}", highlight=False)
    table = Table(title=f"run {run_a} (A, {conv.get('a', '?')}) vs run {run_b} (B, {conv.get('b', '?')})",
                  show_lines=False)
    for col, justify in (("task", "left"), ("A status", "left"), ("A speedup", "right"), ("A ms", "right"),
                         ("B status", "left"), ("B speedup", "right"), ("B ms", "right"),
                         ("delta", "right"), ("change", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for row in result["tasks"]:
        a, b = row["a"], row["b"]
        d = row["delta_speedup_eager"]
        style = _CHANGE_STYLE.get(row["change"], "")
        table.add_row(row["task"], a["status"] or "-", _x(a["speedup_eager"]), _ms(a["runtime_ms"]),
                      b["status"] or "-", _x(b["speedup_eager"]), _ms(b["runtime_ms"]),
                      "-" if d is None else f"{d:+.2f}x",
                      f"[{style}]{row['change']}[/]" if style else row["change"])
    console.print(table)
    s = result["summary"]
    console.print(f"correct: A {s['correct_a']}/{s['tasks_a']} ({_pct(s['correctness_rate_a'])}), "
                  f"B {s['correct_b']}/{s['tasks_b']} ({_pct(s['correctness_rate_b'])})", highlight=False)
    console.print(f"newly correct in B: {', '.join(s['newly_correct']) or 'none'}", highlight=False)
    console.print(f"newly incorrect in B: {', '.join(s['newly_incorrect']) or 'none'}", highlight=False)
    if s["only_a"] or s["only_b"]:
        console.print(f"only in A: {', '.join(s['only_a']) or 'none'}; only in B: {', '.join(s['only_b']) or 'none'}",
                      highlight=False)
    change = s["geomean_change_eager"]
    console.print(f"geomean speedup vs eager: A {_x(s['geomean_speedup_eager_a'])}, B {_x(s['geomean_speedup_eager_b'])}"
                  + (f" (B/A {change:.3f})" if change is not None else ""), highlight=False)
    change_c = s["geomean_change_compile"]
    console.print(f"geomean speedup vs torch.compile: A {_x(s['geomean_speedup_compile_a'])}, "
                  f"B {_x(s['geomean_speedup_compile_b'])}" + (f" (B/A {change_c:.3f})" if change_c is not None else ""),
                  highlight=False)
    if s["geomean_ratio_common"] is not None:
        console.print(f"tasks correct in both: geomean of B/A speedup ratios {s['geomean_ratio_common']:.3f}",
                      highlight=False)
    fa, fb = s["fast_p_eager_a"], s["fast_p_eager_b"]
    console.print("fast_p vs eager (A -> B): " + ", ".join(f"fast_{p} {_pct(fa[p])} -> {_pct(fb[p])}" for p in fa),
                  highlight=False)


def compare_command(
    run_a: int = typer.Argument(..., help="run id A (the reference)"),
    run_b: int = typer.Argument(..., help="run id B"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON"),
    db: Optional[str] = DbOption,
) -> None:
    """Compare two runs task by task: best status, speedup and runtime in each, and the change."""
    from evals.metrics import compare_metrics, json_safe

    store = open_store(db)
    try:
        a = _load(store, run_a)
        b = _load(store, run_b)
    finally:
        store.close()
    from evals.report import run_numerics

    result = compare_metrics(a.metrics, b.metrics)
    na, nb = run_numerics(a.run), run_numerics(b.run)
    conventions = {"a": na["label"], "b": nb["label"], "same": na["label"] == nb["label"],
                   "note": None if na["label"] == nb["label"] else
                   (f"the runs were measured under different numerics (A {na['label']}, B {nb['label']}): "
                    "their speedups are over different eager baselines and their verdicts under different "
                    "tolerances, so the changes below are not like for like")}
    result = {"run_a": run_a, "run_b": run_b, "numerics": conventions, **result}
    if as_json:
        sys.stdout.write(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
    else:
        print_comparison(result, run_a, run_b)
