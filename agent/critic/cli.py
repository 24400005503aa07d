"""``kernelloop critique``: regenerate a run's analyses from stored evidence.

Nothing is evaluated again: each task's attempts and their latest evaluations are read
from the store (``agent.critic.evidence``), the critic writes a new analysis, and that
is stored as a new ``Analysis`` row (round = the task's last round) and printed.
"""
from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, Optional

import typer

from agent.types import AttemptView
from kernelloop.cli_common import DbOption, err_console, fail, open_store

CRITICS = ("grounded", "llm")


def messages_sha256(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _can_critique(model: str) -> bool:
    """builtin and replay:<run> models cannot write analyses."""
    prefix = (model or "").partition(":")[0]
    return prefix not in ("", "builtin", "replay")


def make_critic(name: str, model: Optional[str], explicit: bool = True, **backend_options: Any):
    """The critic ``name`` for a run whose proposals came from ``model``; returns (critic, note).

    ``llm`` needs a backend built from the run's model; a builtin or replay model (or one
    that cannot be built, when the llm critic was not asked for explicitly) gives the
    grounded critic and a note saying why.
    """
    from agent.critic.base import get_critic

    if name not in CRITICS:
        raise ValueError(f"--critic must be one of {', '.join(CRITICS)}, not {name!r}")
    if name == "grounded":
        return get_critic("grounded"), None
    if not _can_critique(model or ""):
        return get_critic("grounded"), (f"the run's model {model!r} cannot write analyses; "
                                        f"using the grounded critic")
    from agent.backends.base import BackendError, get_backend

    try:
        backend = get_backend(model, **backend_options)
    except BackendError as exc:
        if explicit:
            raise
        return get_critic("grounded"), f"the llm critic is not available ({exc}); using the grounded critic"
    return get_critic("llm", backend=backend), None


def _match_tasks(session, run_id: int, wanted: Optional[str]) -> list[Any]:
    from agent.critic.evidence import run_task_ids
    from store.models import Task

    tasks = [session.get(Task, tid) for tid in run_task_ids(session, run_id)]
    if wanted is None:
        return tasks
    w = wanted.strip().removesuffix(".py")
    hits = [t for t in tasks if t.name == w]
    if not hits:
        hits = [t for t in tasks if t.name.endswith("/" + w) or t.name.split("/")[-1] == w.split("/")[-1]]
    return hits


def critique_run(store: Any, run_id: int, task: Optional[str] = None, critic: Optional[str] = None,
                 explicit: bool = True, backend_options: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """Write and store a new analysis per task of ``run_id``; returns one record per task
    (task name, analysis id, critic, round, markdown, note).

    The evidence is read in one read session and each analysis written in a short write
    session of its own, so a slow model call never holds the store's write lock.
    ``explicit``: the critic was asked for by name (an llm critic that cannot be built is
    then an error rather than a fallback to the grounded one).
    """
    from agent.critic.evidence import attempt_views, device_facts, task_spec
    from store.models import Analysis, ModelCall
    from store.repo import call_fields, get_run

    work: list[tuple[int, str, Any, list[AttemptView]]] = []
    with store.reader() as session:
        run = get_run(session, run_id)
        model, run_critic = run.model, run.critic
        tasks = _match_tasks(session, run_id, task)
        if task is not None and not tasks:
            raise LookupError(f"run {run_id} has no task matching {task!r}")
        device = device_facts(session, run)
        for t in tasks:
            # harness failures (infra_error) are no verdicts: nothing to explain to the model
            views = [v for v in attempt_views(session, run_id, t.id) if not (v.result and v.result.infra)]
            if views:
                work.append((t.id, t.name, task_spec(session, run, t, views), views))
    name = critic or run_critic or "grounded"
    critic_obj, note = make_critic(name, model, explicit=explicit and critic is not None, **(backend_options or {}))
    out: list[dict[str, Any]] = []
    for task_id, task_name, spec, views in work:
        analysis = critic_obj.analyze(spec, views, device)
        last_round = max(v.round for v in views)
        with store.session() as session:
            call_id = None
            c = analysis.completion
            if c is not None and analysis.messages is not None:
                call = ModelCall(run_id=run_id, task_id=task_id, round=last_round, purpose="critique",
                                 model=c.model or model, template=analysis.template or "critic_task",
                                 prompt_sha256=messages_sha256(analysis.messages), messages=analysis.messages,
                                 **call_fields(c, analysis.left_out))
                session.add(call)
                session.flush()
                call_id = call.id
            row = Analysis(run_id=run_id, task_id=task_id, round=last_round, critic=analysis.critic,
                           markdown=analysis.markdown, findings=[f.to_dict() for f in analysis.findings],
                           model_call_id=call_id)
            session.add(row)
            session.flush()
            out.append({"task": task_name, "analysis_id": row.id, "critic": analysis.critic, "round": last_round,
                        "markdown": analysis.markdown, "note": note})
    return out


def critique_command(
    run: int = typer.Argument(..., help="run id (kernelloop runs lists them)"),
    task: Optional[str] = typer.Option(None, "--task", "-t", help="only this task (its name, e.g. seeds/conv2d_divide_leakyrelu)"),
    critic: Optional[str] = typer.Option(None, "--critic", "-c",
                                         help="grounded or llm [default: the critic the run used]"),
    db: Optional[str] = DbOption,
) -> None:
    """Regenerate analyses for a run's tasks from stored evidence (nothing is evaluated again);
    each is stored as a new analysis and printed."""
    from agent.backends.base import BackendError

    if critic is not None and critic not in CRITICS:
        fail(f"--critic must be one of {', '.join(CRITICS)}, not {critic!r}")
    store = open_store(db)
    try:
        records = critique_run(store, run, task=task, critic=critic)
    except (LookupError, ValueError, BackendError) as exc:
        fail(str(exc))
    finally:
        store.close()
    if not records:
        err_console.print(f"run {run} has no attempts to analyse", highlight=False)
        return
    notes = {r["note"] for r in records if r["note"]}
    for n in notes:
        err_console.print(f"note: {n}", highlight=False)
    for i, r in enumerate(records):
        if i:
            sys.stdout.write("\n")
        sys.stdout.write(r["markdown"])
        err_console.print(f"stored analysis {r['analysis_id']} for {r['task']} ({r['critic']}, round {r['round']})",
                          highlight=False)
    sys.stdout.flush()
