"""A run's analysis report as Markdown, one self-contained HTML file, or JSON.

``build_report`` turns a loaded run (``evals.run_data.RunData``) into one JSON-ready dict
(all the numbers and per-task data); the Markdown and HTML renderings are Jinja templates
(``evals/templates/``) over that dict plus the plots (matplotlib, Agg, PNG).

HTML is a single file with no external resource: inline CSS, plots as ``data:`` URIs, the
critic's markdown rendered by markdown-it-py with raw HTML off (so it is escaped) and
images off, and every other value escaped by Jinja's autoescape.

The header states the run's numerics convention (``run.config["eval"]["numerics"]``; runs
from before it was recorded ran fp32/strict). Where a task file sits in a KernelBench
checkout with published timings for the run's GPU (``evals.published``), the task shows the
reference's measured eager and torch.compile times (median over its evaluations in the run)
beside the published ones, with the ratio, flagged when more than 10% off.
"""
from __future__ import annotations

import base64
import difflib
import io
import json
import re
import statistics
from pathlib import Path
from typing import Any, Optional

from evals.metrics import FAST_P_THRESHOLDS, AttemptRecord, geomean, json_safe, p_key
from evals.run_data import RunData
from hardware.floors import CONVENTION as FLOOR_CONVENTION

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
PLOTS = (("fast_p", "fast_p curve"),
         ("speedup_distribution", "Speedup distribution"),
         ("best_by_round", "Best speedup per task by round"))
FORMATS = ("md", "html", "json")
MAX_LEGEND_TASKS = 12   # beyond this the by-round plot names no task and shows their geomean


# ----------------------------------------------------------------------------- data

def attempt_cause(rec: AttemptRecord, analysis: Optional[dict[str, Any]]) -> str:
    """Why an attempt ended as it did: the critic's finding if it has one, else status + first error."""
    if analysis:
        for f in analysis.get("findings") or []:
            if isinstance(f, dict) and f.get("attempt_id") == rec.attempt_id and f.get("cause"):
                cat = f.get("category")
                return f"{cat}: {f['cause']}" if cat else str(f["cause"])
    if rec.status is None:
        return rec.error or f"not evaluated ({rec.parse_status})"
    if rec.correct:
        parts = []
        if rec.speedup_eager is not None:
            parts.append(f"{rec.speedup_eager:.2f}x vs eager")
        if rec.speedup_compile is not None:
            parts.append(f"{rec.speedup_compile:.2f}x vs compile")
        notes = [f"{k}: {r}" for k, r in zip(rec.flags, rec.flag_reasons)]
        return "correct" + (f", {', '.join(parts)}" if parts else "") + (f" ({'; '.join(notes)})" if notes else "")
    if rec.flagged:
        notes = "; ".join(f"{k}: {r}" for k, r in zip(rec.flags, rec.flag_reasons))
        return f"not counted, flagged: {notes}"
    return f"{rec.status}: {rec.error}" if rec.error else rec.status


def status_label(rec: AttemptRecord) -> str:
    if rec.status is None:
        return f"not evaluated ({rec.parse_status})"
    if rec.flagged:
        return f"correct (flagged: {', '.join(rec.flags)})"
    return rec.status


def unified_diff(parent: Optional[str], child: Optional[str], parent_label: str, child_label: str) -> str:
    return "".join(difflib.unified_diff((parent or "").splitlines(keepends=True),
                                        (child or "").splitlines(keepends=True),
                                        fromfile=parent_label, tofile=child_label))


def run_numerics(run: dict[str, Any]) -> dict[str, Any]:
    """The run's numerics convention, from ``run["config"]["eval"]["numerics"]``: label, the
    one-line description, whether it was recorded, and a note when it was not (runs from before
    numerics were recorded ran IEEE fp32, ``fp32/strict``) or could not be read."""
    from pydantic import ValidationError

    from sandbox.numerics import numerics_of_run_config

    try:
        n, recorded = numerics_of_run_config(run.get("config"))
    except ValidationError as exc:
        return {"label": "unknown", "describe": "unknown convention", "recorded": False,
                "note": f"the run's numerics config could not be read: {str(exc).splitlines()[0]}"}
    note = None if recorded else ("not recorded in the run's config: runs from before numerics were "
                                  "recorded ran fp32/strict")
    return {"label": n.label, "describe": n.describe(), "recorded": recorded, "note": note}


def timing_conventions(records: list) -> str:
    """How the run's times were taken (``Timing.convention`` of its timed evaluations), for the
    header: one convention, or each with its count where evaluations were timed under several
    (an evaluation reused from before cpu's interleaved blocks keeps its one-block convention)."""
    from collections import Counter

    seen = Counter(r.timing for r in records if getattr(r, "timing", None))
    if not seen:
        return "no evaluation was timed"
    if len(seen) == 1:
        return f"each side's time the {next(iter(seen))}"
    return "the evaluations' times under several conventions: " + "; ".join(
        f"{conv} ({n} evaluations)" for conv, n in seen.most_common())


def task_paths_of(session, data: RunData) -> dict[str, str]:
    """Task name -> the task file's path as stored with the task row."""
    import sqlalchemy as sa

    from store.models import Task

    ids = {tid: name for name, tid in data.task_ids.items() if tid is not None}
    if not ids:
        return {}
    return {ids[t.id]: t.path for t in session.scalars(sa.select(Task).where(Task.id.in_(list(ids))))}


def _published_path(path: Optional[str], source: Optional[str]) -> Optional[str]:
    """The stored path if it leads into a KernelBench checkout; for a relative path stored by a
    run started elsewhere, the same path from the repository, or the file of that name in the
    KernelBench checkout (``evals.kernelbench``) when its source is the task's."""
    from evals.kernelbench import REPO, kernelbench_root
    from evals.published import find_checkout

    if not path:
        return None
    p = Path(path)
    tries = [p] + ([REPO / p] if not p.is_absolute() else [])
    for cand in tries:
        if find_checkout(cand)[0] is not None:
            return str(cand)
    fallback = kernelbench_root() / p.parent.name / p.name
    try:
        if (source is not None and re.match(r"^level\d+$", p.parent.name) and fallback.is_file()
                and fallback.read_text() == source):
            return str(fallback)
    except (OSError, UnicodeDecodeError):
        pass
    return path


def _median(values: list[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None and v > 0]
    return statistics.median(vals) if vals else None


def task_published(data: RunData, task: str, path: Optional[str], numerics: str) -> dict[str, Any]:
    """A task's published KernelBench figures beside the reference times measured in the run
    (``evals.published.published_record`` plus ``measured_*``), or why there are none."""
    from evals.published import lookup_published, published_record

    recs = data.records_for(task)
    measured = {"eager": _median([r.eager_ms for r in recs]), "compile": _median([r.compile_ms for r in recs])}
    extra = {"measured_eager_ms": measured["eager"], "measured_compile_ms": measured["compile"],
             "measured_evaluations": sum(1 for r in recs if r.eager_ms is not None)}
    if not path:
        return {"available": False, "reason": "the task's path is not known", **extra}
    lookup = lookup_published(_published_path(path, data.task_sources.get(task)), data.run.get("device_name"))
    return {**published_record(lookup, measured, numerics), **extra}


def build_report(data: RunData, task_paths: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """All the numbers and per-task data of a run's report, JSON-ready. ``task_paths`` (task
    name -> file, ``task_paths_of``) lets tasks show KernelBench's published timings."""
    m = data.metrics
    numerics = run_numerics(data.run)
    task_paths = task_paths or {}
    tasks = []
    for tm in m.per_task:
        analysis = data.analyses.get(tm.task)
        attempts = []
        for rec in data.records_for(tm.task):
            attempts.append({
                "attempt_id": rec.attempt_id, "round": rec.round, "sample": rec.sample,
                "evaluation": rec.correct, "status": rec.status, "status_label": status_label(rec),
                "parse_status": rec.parse_status, "runtime_ms": rec.runtime_ms,
                "candidate_ms": rec.candidate_ms, "eager_ms": rec.eager_ms, "compile_ms": rec.compile_ms,
                "speedup_eager": rec.speedup_eager, "speedup_compile": rec.speedup_compile,
                "speedup_eager_ci": rec.speedup_eager_ci, "speedup_compile_ci": rec.speedup_compile_ci,
                "floor_fraction": rec.floor_fraction, "flags": list(dict.fromkeys(rec.flags)),
                "cause": attempt_cause(rec, analysis), "parent_ids": list(rec.parent_ids),
                "evaluation_id": rec.evaluation_id, "is_best": tm.best is not None and rec.attempt_id == tm.best.attempt_id,
            })
        best = tm.best
        best_block = None
        if best is not None:
            parent_id = best.parent_ids[0] if best.parent_ids else None
            parent_source = data.source_of(parent_id) if parent_id is not None else None
            diff = None
            if parent_id is not None and parent_source is not None:
                diff = unified_diff(parent_source, best.source, f"attempt {parent_id}", f"attempt {best.attempt_id}")
            best_block = {
                "attempt_id": best.attempt_id, "round": best.round, "status": best.status,
                "status_label": status_label(best), "correct": best.correct, "source": best.source,
                "parent_id": parent_id, "parent_found": parent_source is not None, "diff": diff,
            }
        tasks.append({
            "task": tm.task, "task_id": data.task_ids.get(tm.task), "anchor": anchor(tm.task),
            "correct": tm.correct, "flagged_only": tm.flagged_only,
            "attempts_count": tm.attempts, "correct_attempts": tm.correct_attempts,
            "flagged_attempts": tm.flagged_attempts,
            "speedup_eager": tm.speedup("eager"), "speedup_compile": tm.speedup("compile"),
            "speedup_eager_ci": tm.speedup_ci("eager"), "speedup_compile_ci": tm.speedup_ci("compile"),
            "runtime_ms": best.runtime_ms if best else -1.0,
            "floor_fraction": tm.best_eager.floor_fraction if tm.best_eager else None,
            "best_by_round": {str(r): v for r, v in sorted(tm.best_by_round.items())},
            "best": best_block, "attempts": attempts,
            "published": task_published(data, tm.task, task_paths.get(tm.task), numerics["label"]),
            "analysis": ({"id": analysis["id"], "round": analysis["round"], "critic": analysis["critic"],
                          "markdown": analysis["markdown"], "findings": analysis["findings"]}
                         if analysis else None),
        })
    summary = m.summary_dict()
    fast_p_rows = [{"p": p_key(p), "eager": m.fast_p_eager[p_key(p)], "compile": m.fast_p_compile[p_key(p)],
                    "eager_ci": m.fast_p_eager_ci.get(p_key(p)), "compile_ci": m.fast_p_compile_ci.get(p_key(p))}
                   for p in FAST_P_THRESHOLDS]
    flagged = [{"task": t["task"], "attempt_id": a["attempt_id"], "round": a["round"], "flags": a["flags"],
                "cause": a["cause"]}
               for t in tasks for a in t["attempts"] if a["status"] == "correct" and not a["evaluation"]]
    not_run = [{"task": name, "reason": why} for name, why in sorted(data.not_run.items())]
    summary["floor_convention"] = FLOOR_CONVENTION
    timing = timing_conventions(data.records)
    return json_safe({"run": data.run, "numerics": numerics, "timing": timing, "summary": summary, "fast_p": fast_p_rows,
                      "flagged": flagged, "not_run": not_run, "tasks": tasks,
                      "published": published_summary(tasks, numerics)})


def published_summary(tasks: list[dict[str, Any]], numerics: dict[str, Any]) -> dict[str, Any]:
    """What the report says once about the published figures: how many tasks have them, where
    they come from, and the line of each flagged comparison."""
    from evals.published import FLAG_THRESHOLD, PUBLISHED_NUMERICS, record_notes

    have = [t for t in tasks if t["published"].get("available")]
    sources = sorted({f"{t['published']['timing_dir']} ({t['published']['hardware']}; "
                      f"{t['published']['match_note']})" for t in have})
    return {"tasks": len(have), "numerics": PUBLISHED_NUMERICS, "threshold": FLAG_THRESHOLD,
            "same_convention": numerics["label"] == PUBLISHED_NUMERICS, "sources": sources,
            "flagged": [line for t in have for line in record_notes(t["task"], t["published"])]}


def anchor(name: str) -> str:
    return "task-" + re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-").lower()


# ----------------------------------------------------------------------------- plots

def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return buf.getvalue()


def make_plots(report: dict[str, Any]) -> dict[str, bytes]:
    """The report's three plots as PNG bytes, keyed by name (see ``PLOTS``)."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    tasks = report["tasks"]
    n = len(tasks)
    plots: dict[str, bytes] = {}

    # fast_p curve
    best_e = [t["speedup_eager"] for t in tasks if t["correct"]]
    best_c = [t["speedup_compile"] for t in tasks if t["correct"]]
    top = max([2.5] + [s * 1.1 for s in best_e + best_c if s is not None])
    ps = [top * i / 400 for i in range(401)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, speeds, color in (("eager", "vs eager", best_e, "tab:blue"),
                                      ("compile", "vs torch.compile", best_c, "tab:orange")):
        if all(row[key] is None for row in report["fast_p"]):
            continue
        ys = [(len(speeds) if p == 0 else sum(1 for s in speeds if s is not None and s > p)) / n if n else 0
              for p in ps]
        ax.step(ps, ys, where="post", label=label, color=color)
        ax.plot([float(row["p"]) for row in report["fast_p"]], [row[key] or 0 for row in report["fast_p"]],
                "o", color=color, ms=4)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("speedup threshold p")
    ax.set_ylabel("fast_p (fraction of all tasks)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"fast_p over {n} task(s)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right")
    else:
        ax.text(0.5, 0.5, "no tasks", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    plots["fast_p"] = _png(fig)

    # speedup distribution: every correct attempt
    se = [a["speedup_eager"] for t in tasks for a in t["attempts"] if a["evaluation"] and a["speedup_eager"]]
    sc = [a["speedup_compile"] for t in tasks for a in t["attempts"] if a["evaluation"] and a["speedup_compile"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    if se or sc:
        lo = min(se + sc) / 1.2
        hi = max(se + sc) * 1.2
        if hi / lo < 4:
            lo, hi = min(lo, 0.5), max(hi, 2.0)
        bins = [lo * (hi / lo) ** (i / 20) for i in range(21)]
        ax.hist([se, sc], bins=bins, label=["vs eager", "vs torch.compile"], color=["tab:blue", "tab:orange"])
        ax.set_xscale("log")
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator
        ticks = [t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64) if lo <= t <= hi]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.legend(loc="best")
    else:
        ax.text(0.5, 0.5, "no correct kernels", ha="center", va="center", transform=ax.transAxes)
    from matplotlib.ticker import MaxNLocator
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("speedup (log scale)")
    ax.set_ylabel("correct attempts")
    ax.set_title("Speedup distribution of correct attempts")
    ax.grid(alpha=0.3)
    plots["speedup_distribution"] = _png(fig)

    # best speedup per task by round
    fig, ax = plt.subplots(figsize=(7, 4))
    series = []
    for t in tasks:
        pts = [(int(r), v) for r, v in t["best_by_round"].items()]
        if any(v is not None for _, v in pts):
            series.append((t["task"], pts))
    many = len(series) > MAX_LEGEND_TASKS
    for name, pts in series:
        ax.plot([r for r, _ in pts], [v if v is not None else float("nan") for _, v in pts],
                marker="o", ms=3 if many else 6, lw=0.8 if many else 1.5, alpha=0.35 if many else 1.0,
                label=None if many else name)
    if series:
        rounds = sorted({int(r) for t in tasks for r in t["best_by_round"]})
        if many:   # too many tasks to name: overlay the geomean over tasks correct by each round
            gm = [geomean(t["best_by_round"].get(str(r)) for t in tasks) for r in rounds]
            ax.plot(rounds, [g if g is not None else float("nan") for g in gm], color="black", lw=2.5,
                    label=f"geomean over correct tasks ({len(series)} tasks)")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.legend(fontsize=8, loc="best")
        ax.set_xticks(rounds)
    else:
        ax.text(0.5, 0.5, "no correct kernels", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("round")
    ax.set_ylabel("best speedup vs eager so far")
    ax.set_title("Best speedup per task by round")
    ax.grid(alpha=0.3)
    plots["best_by_round"] = _png(fig)
    return plots


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# ----------------------------------------------------------------------------- formatting

def fmt_x(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def fmt_pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def fmt_ms(v: Optional[float]) -> str:
    if v is None or v < 0:
        return "-1.0"
    text = f"{v:.4g}"
    return text if ("." in text or "e" in text or "inf" in text) else text + ".0"


def fmt_num(v: Optional[float], digits: int = 0) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.{digits}f}"


def fmt_cost(v: Optional[float]) -> str:
    return "n/a" if v is None else f"${v:.4f}"


def md_cell(v: Any) -> str:
    """A value made safe for one Markdown table cell."""
    s = "" if v is None else str(v)
    return s.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ").strip()


def fence(text: Optional[str], lang: str = "") -> str:
    """A fenced code block whose fence is longer than any backtick run inside."""
    text = text or ""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    f = "`" * max(3, longest + 1)
    return f"{f}{lang}\n{text}{'' if text.endswith(chr(10)) or not text else chr(10)}{f}"


def _heading_lines(markdown: str):
    """(index, level, rest) of each ATX heading outside fenced code, and the lines."""
    lines = (markdown or "").splitlines()
    found, in_fence, fence_mark = [], False, ""
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        m = re.match(r"(`{3,}|~{3,})", stripped)
        if m and indent < 4:
            if not in_fence:
                in_fence, fence_mark = True, m.group(1)
            elif stripped.startswith(fence_mark) and not stripped[len(fence_mark):].strip(fence_mark[0]).strip():
                in_fence = False
            continue
        if not in_fence and indent < 4:
            h = re.match(r"^(#{1,6})(\s.*|)$", stripped)
            if h:
                found.append((i, len(h.group(1)), h.group(2)))
    return found, lines


def demote_headings(markdown: str, top: int) -> str:
    """Shift ATX headings so the shallowest becomes level ``top`` (at most 6), keeping their
    relative depth: the critic's '#'/'##' then sit under the report's own headings."""
    found, lines = _heading_lines(markdown)
    if not found:
        return markdown or ""
    shift = top - min(level for _, level, _ in found)
    for i, level, rest in found:
        lines[i] = "#" * max(1, min(6, level + shift)) + rest
    return "\n".join(lines) + ("\n" if (markdown or "").endswith("\n") else "")


def render_markdown_html(markdown: str, demote: int = 0) -> str:
    """Critic markdown -> safe HTML (raw HTML escaped, images and unsafe links off)."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable(["table", "strikethrough"])
    md.disable("image")
    return md.render(demote_headings(markdown, demote) if demote else (markdown or ""))


def fmt_ci(ci: Optional[list[float]]) -> str:
    """A speedup's interval beside its point estimate: `` [1.93x-2.08x]``, empty without one."""
    return f" [{fmt_x(ci[0])}-{fmt_x(ci[1])}]" if ci else ""


def fmt_pct_ci(ci: Optional[list[float]]) -> str:
    """fast_p's range over the speedups' intervals: `` [25%-50%]``, empty without one or when equal."""
    return f" [{fmt_pct(ci[0])}-{fmt_pct(ci[1])}]" if ci and ci[0] != ci[1] else ""


def _env(html: bool):
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
                             autoescape=html, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    from evals.published import published_ms_cell, ratio_cell

    env.filters.update(x=fmt_x, pct=fmt_pct, ci=fmt_ci, pct_ci=fmt_pct_ci, ms=fmt_ms, num=fmt_num, cost=fmt_cost, cell=md_cell,
                       fence=fence, demote=demote_headings, ratio=ratio_cell, pub_ms=published_ms_cell,
                       ms_na=lambda v: "n/a" if v is None else f"{v:.3f}")
    if html:
        from markupsafe import Markup
        env.filters["markdown"] = lambda text, demote=0: Markup(render_markdown_html(text, demote))
    return env


# ----------------------------------------------------------------------------- renderings

def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n"


def render_md(report: dict[str, Any], image_srcs: dict[str, str]) -> str:
    return _env(False).get_template("report.md.j2").render(
        r=report, plots=[(k, title, image_srcs[k]) for k, title in PLOTS if k in image_srcs])


def render_html(report: dict[str, Any], plots: dict[str, bytes]) -> str:
    return _env(True).get_template("report.html.j2").render(
        r=report, plots=[(k, title, data_uri(plots[k])) for k, title in PLOTS if k in plots])


def write_report(data: RunData, fmt: str = "md", output: Optional[Path] = None, embed: bool = False,
                 task_paths: Optional[dict[str, str]] = None) -> str:
    """Render a run's report; write it to ``output`` when given. Returns the text.

    Markdown written to a file keeps its plots as PNG files in ``<stem>_plots/`` beside it
    (``embed=True`` puts them inline as data URIs, as when printing to stdout).
    ``task_paths``: see ``build_report``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown report format {fmt!r}; use one of {', '.join(FORMATS)}")
    report = build_report(data, task_paths)
    if fmt == "json":
        text = render_json(report)
    elif fmt == "html":
        text = render_html(report, make_plots(report))
    else:
        plots = make_plots(report)
        if output is not None and not embed:
            output = Path(output)
            plot_dir = output.parent / f"{output.stem}_plots"
            plot_dir.mkdir(parents=True, exist_ok=True)
            srcs = {}
            for name, png in plots.items():
                (plot_dir / f"{name}.png").write_bytes(png)
                srcs[name] = f"{plot_dir.name}/{name}.png"
        else:
            srcs = {name: data_uri(png) for name, png in plots.items()}
        text = render_md(report, srcs)
    if output is not None:
        output = Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
    return text
