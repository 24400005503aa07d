"""``kernelloop logs``: the stored model calls (prompts, responses, tokens, latency, cost).

``kernelloop logs`` (or ``logs list``) lists recent calls, newest first, with filters;
``kernelloop logs show ID`` prints one call's figures (tokens, the limit that ended the
answer, the window and what the prompt left out to fit it), its messages, the model's
reasoning and its response. ``--json`` prints the same as JSON, for scripts. ``--db`` given
to ``logs`` holds for ``list`` and ``show``.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import sqlalchemy as sa
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kernelloop.cli_common import DbOption, console, fail, open_store

app = typer.Typer(add_completion=False, invoke_without_command=True,
                  help="Query stored model calls (prompts, responses, tokens, latency).")

RunOpt = typer.Option(None, "--run", "-r", help="only calls of this run id")
TaskOpt = typer.Option(None, "--task", "-t", help="only calls for tasks whose name contains this (or task id)")
PurposeOpt = typer.Option(None, "--purpose", "-p", help="propose or critique")
ModelOpt = typer.Option(None, "--model", "-m", help="only calls whose model contains this, e.g. gpt-4o")
ErrorsOpt = typer.Option(False, "--errors", help="only calls that failed")
LimitOpt = typer.Option(20, "-n", "--limit", min=1, help="how many calls (newest first)")
JsonOpt = typer.Option(False, "--json", help="print JSON instead of a table")


def _query_calls(session, run: Optional[int], task: Optional[str], purpose: Optional[str],
                 model: Optional[str], errors: bool, limit: int) -> list[tuple[Any, Optional[str]]]:
    from store.models import ModelCall, Task

    q = sa.select(ModelCall, Task.name).outerjoin(Task, Task.id == ModelCall.task_id)
    if run is not None:
        q = q.where(ModelCall.run_id == run)
    if task:
        cond = Task.name.contains(task, autoescape=True)
        if task.isdigit():
            cond = sa.or_(cond, ModelCall.task_id == int(task))
        q = q.where(cond)
    if purpose:
        q = q.where(ModelCall.purpose == purpose)
    if model:
        q = q.where(ModelCall.model.contains(model, autoescape=True))
    if errors:
        q = q.where(ModelCall.error.is_not(None))
    return list(session.execute(q.order_by(ModelCall.id.desc()).limit(limit)).all())


def _summary(call, task_name: Optional[str]) -> dict[str, Any]:
    return {"id": call.id, "run_id": call.run_id, "task_id": call.task_id, "task": task_name,
            "round": call.round, "purpose": call.purpose, "model": call.model, "template": call.template,
            "prompt_sha256": call.prompt_sha256, "prompt_tokens": call.prompt_tokens,
            "completion_tokens": call.completion_tokens, "latency_s": call.latency_s, "cost_usd": call.cost_usd,
            "finish_reason": call.finish_reason, "finish_cause": call.finish_cause,
            "reasoning_tokens": call.reasoning_tokens, "prompt_truncated": call.prompt_truncated,
            "error": call.error,
            "created_at": call.created_at.isoformat() if call.created_at else None}


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _list(db: Optional[str], run: Optional[int], task: Optional[str], purpose: Optional[str],
          model: Optional[str], errors: bool, limit: int, as_json: bool) -> None:
    store = open_store(db)
    try:
        with store.reader() as session:
            rows = _query_calls(session, run, task, purpose, model, errors, limit)
            data = [_summary(call, name) for call, name in rows]
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    # A pipe or file has no width of its own: lines there are as long as the table needs.
    out = console if console.is_terminal else Console(width=max(console.width, 200))
    if not data:
        out.print("no model calls match", highlight=False)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    # Figures never wrap; names and errors fold onto further lines in a narrow terminal.
    for col, justify in [("id", "right"), ("run", "right"), ("task", "left"), ("rnd", "right"),
                         ("purpose", "left"), ("model", "left"), ("template", "left"), ("in", "right"),
                         ("out", "right"), ("latency", "right"), ("cost", "right"), ("error", "left")]:
        wraps = col in ("task", "model", "template", "error")
        table.add_column(col, justify=justify, overflow="fold" if wraps else "ellipsis", no_wrap=not wraps)
    for d in data:
        error = (d["error"] or "").split("\n")[0]
        table.add_row(*(Text(str(v)) for v in (
            d["id"], _num(d["run_id"], "d"), d["task"] or "-", _num(d["round"], "d"), d["purpose"], d["model"],
            d["template"], _num(d["prompt_tokens"], "d"), _num(d["completion_tokens"], "d"),
            _num(d["latency_s"], ".1f") + ("s" if d["latency_s"] is not None else ""),
            ("$" + _num(d["cost_usd"], ".4f")) if d["cost_usd"] is not None else "-",
            error[:100] + ("..." if len(error) > 100 else ""))),
            style="red" if d["error"] else None)
    out.print(table)


@app.callback()
def logs(ctx: typer.Context, db: Optional[str] = DbOption, run: Optional[int] = RunOpt,
         task: Optional[str] = TaskOpt, purpose: Optional[str] = PurposeOpt, model: Optional[str] = ModelOpt,
         errors: bool = ErrorsOpt, limit: int = LimitOpt, as_json: bool = JsonOpt) -> None:
    """Recent model calls, newest first (the same as ``logs list``)."""
    if ctx.invoked_subcommand is None:
        _list(db, run, task, purpose, model, errors, limit, as_json)


@app.command("list")
def list_command(db: Optional[str] = DbOption, run: Optional[int] = RunOpt, task: Optional[str] = TaskOpt,
                 purpose: Optional[str] = PurposeOpt, model: Optional[str] = ModelOpt,
                 errors: bool = ErrorsOpt, limit: int = LimitOpt, as_json: bool = JsonOpt) -> None:
    """Recent model calls, newest first: id, run, task, purpose, model, template, tokens, latency, cost, error."""
    _list(db, run, task, purpose, model, errors, limit, as_json)


@app.command("show")
def show_command(call_id: int = typer.Argument(..., metavar="ID", help="model call id (from logs list)"),
                 db: Optional[str] = DbOption, as_json: bool = JsonOpt) -> None:
    """One model call: its figures, every message sent, the reasoning and the response text."""
    from store.models import ModelCall, Task

    store = open_store(db)
    try:
        with store.reader() as session:
            call = session.get(ModelCall, call_id)
            if call is None:
                fail(f"no model call {call_id} in {store.url} (kernelloop logs lists them)")
            task_name = session.get(Task, call.task_id).name if call.task_id is not None else None
            data = _summary(call, task_name)
            data["messages"] = call.messages
            data["response_text"] = call.response_text
            data["reasoning"] = call.reasoning
            data["context"] = call.context
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    head = [f"model call {data['id']}: run {data['run_id']}, task {data['task'] or '-'}, round {data['round']}, "
            f"{data['purpose']}, {data['model']}",
            f"template {data['template']} (prompt sha256 {data['prompt_sha256'][:16]})",
            f"tokens in {_num(data['prompt_tokens'], 'd')}, out {_num(data['completion_tokens'], 'd')}; "
            f"latency {_num(data['latency_s'], '.2f')} s; cost "
            f"{('$' + _num(data['cost_usd'], '.4f')) if data['cost_usd'] is not None else '-'}; "
            f"finish_reason {data['finish_reason'] or '-'}"
            + (f" (ended by {data['finish_cause']})" if data["finish_cause"] else "")
            + (f"; reasoning tokens {data['reasoning_tokens']}" if data["reasoning_tokens"] is not None else "")]
    c = data["context"] or {}
    if c.get("window"):
        head.append(f"window {c['window']} tokens ({c.get('window_source')}); prompt counted {c.get('prompt_count')} "
                    f"({c.get('counted_by')}); max_tokens sent {c.get('max_tokens_sent')}")
    if c.get("left_out"):
        head.append("left out to fit the window: " + "; ".join(c["left_out"]))
    if c.get("ended"):
        head.append(f"cut off: {c['ended']}")
    if data["prompt_truncated"]:
        head.append("prompt truncated: the server counted far fewer prompt tokens than were sent")
    if data["error"]:
        head.append(f"error: {data['error']}")
    typer.echo("\n".join(head))
    for i, m in enumerate(data["messages"] or []):
        role = m.get("role", "?") if isinstance(m, dict) else "?"
        content = m.get("content", "") if isinstance(m, dict) else str(m)
        typer.echo(f"\n===== message {i}: {role} =====\n{content}")
    if data["reasoning"]:
        typer.echo(f"\n===== reasoning (not fed back into prompts) =====\n{data['reasoning']}")
    typer.echo("\n===== response =====")
    typer.echo(data["response_text"] if data["response_text"] is not None else "(no response)")
