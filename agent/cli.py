"""``kernelloop optimize``, ``runs``, ``show`` and ``replay``."""
from __future__ import annotations

import signal
import threading
from typing import Any, Optional

import sqlalchemy as sa
import typer
from rich.live import Live
from rich.table import Table

from kernelloop.cli_common import (BackendOption, DbOption, DeviceOption, MathOption, PrecisionOption, SetOption, console,
                                   err_console, fail, open_store, resolve_device, resolve_kernel_backend, resolve_numerics)
from kernelloop.cli_executor import ExecutorOption, RayAddressOption, resolve_executor_device


def _fmt_pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def _fmt(x: Optional[float], unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}g}{unit}"


def device_facts(device: str, sandbox_name: str, store: Any = None) -> Any:
    import torch

    from agent.types import DeviceFacts

    facts = DeviceFacts(device=device, name=sandbox_name, torch_version=torch.__version__)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts.compute_capability = f"{props.major}.{props.minor}"
        facts.sm_count = props.multi_processor_count
    try:
        from store.probes import get_probe

        probe = get_probe(device, store=store, measure=True)   # measured once per device and torch, then cached
        if device == "cuda":
            torch.cuda.empty_cache()                            # the probe's buffers are not the run's
    except Exception:  # noqa: BLE001 - device facts are optional context
        probe = None
    if probe is not None:
        facts.bandwidth_gbps = probe.bandwidth_gbps
        facts.tflops = dict(probe.tflops)
    return facts


def _load_specs(tasks: list[str], overrides: dict[str, Any]) -> list[Any]:
    from sandbox.tasks import TaskError, discover, load_task, read_spec

    try:
        specs = [read_spec(p, overrides) for p in discover(tasks)]
        for sp in specs:
            load_task(sp)   # validate every task before anything is stored or asked
    except TaskError as exc:
        fail(str(exc))
    if not specs:
        fail("no task files found in " + " ".join(tasks))
    return specs


def _same_tasks_or_fail(run_id: int, specs: list[Any], tasks: list[str]) -> None:
    """``--resume`` goes on with the run's own tasks: task arguments given with it must name those
    (by content), or the command fails saying which differ, instead of leaving them unrun."""
    from sandbox.tasks import TaskError, discover, read_spec

    try:
        given = {read_spec(p, {}).sha256: p for p in discover(tasks)}
    except TaskError as exc:
        fail(str(exc))
    own = {sp.sha256: sp.name for sp in specs}
    extra = [str(p) for h, p in given.items() if h not in own]
    missing = [n for h, n in own.items() if h not in given]
    if extra or missing:
        def few(names: list[str]) -> str:
            return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts = ([f"not in it: {few(extra)}"] if extra else []) + ([f"left out: {few(missing)}"] if missing else [])
        fail(f"run {run_id} is over {len(own)} task(s) of its own, and --resume continues those; the tasks given "
             f"differ ({'; '.join(parts)}). Drop the task arguments to continue run {run_id}, or leave out "
             f"--resume to start a new run over them")


def _summary_table(progress: list[Any], title: str) -> Table:
    table = Table(title=title)
    from statistics import geometric_mean

    from hardware.floors import CONVENTION

    for col in ("task", "round", "attempts", "correct", "clean", "eager ms", "compile ms", "best ms", "floor ms",
                "floor %", "vs eager", "vs compile", "stopped"):
        table.add_column(col, justify="left" if col in ("task", "stopped") else "right")
    table.caption = ("correct: the verdict; clean: correct with no disqualifying flag (no custom kernel, fallback, "
                     "inaccurate, suspicious, ...); "
                     "best ms and speedups: the clean attempt with the highest speedup vs eager, reference and candidate "
                     "timed in one evaluation (not always the lowest ms: each attempt is read against its own reference)")
    fractions = {p.name: p.floor_ms / p.best_ms for p in progress if p.floor_ms and p.best_ms}
    for p in progress:
        table.add_row(p.name, str(p.round), str(p.attempts), str(p.correct), str(p.clean), _fmt(p.eager_ms),
                      _fmt(p.compile_ms) + (" †" if p.compile_within is False else " ‡" if p.compile_fp64 else ""),
                      _fmt(p.best_ms), _fmt(p.floor_ms), _fmt_pct(fractions.get(p.name)),
                      _fmt(p.best_speedup, "x"), _fmt(p.best_compile_speedup, "x"), p.error or p.stopped)
    if any(p.compile_within is False for p in progress):
        table.caption += ("; †: torch.compile's own output is outside the tolerance of eager's (KernelBench's "
                          "check would refuse it)")
    if any(p.compile_within is not False and p.compile_fp64 for p in progress):
        table.caption += ("; ‡: torch.compile's own output is within the tolerance but fails the float64 rule "
                          "(a candidate computing so would be flagged inaccurate)")
    if fractions:
        table.caption += (f"; floor %: the best clean attempt's {CONVENTION}; geomean "
                          f"{_fmt_pct(geometric_mean(fractions.values()))} over {len(fractions)} task(s)")
    return table


def optimize_command(
    tasks: list[str] = typer.Argument(None, help="task files, directories or bundled names (seeds, level1/...)"),
    model: str = typer.Option("builtin", "--model", "-m", help="builtin | openai:<model> | replay:<run>"),
    rounds: Optional[int] = typer.Option(None, "--rounds", "-r", min=1,
                                         help="rounds per task [default: 3]; with --resume, the run's own "
                                              "rounds raised (or lowered) to this: its stored rounds are kept"),
    samples: int = typer.Option(2, "--samples", "-n", min=1, help="candidates per task per round"),
    device: Optional[str] = DeviceOption,
    critic: Optional[str] = typer.Option(None, "--critic", help="grounded | llm [default: follows the model]"),
    target_speedup: Optional[float] = typer.Option(None, "--target-speedup", help="stop a task at this speedup over eager"),
    patience: Optional[int] = typer.Option(None, "--patience", help="stop a task after K rounds without improvement"),
    trials: int = typer.Option(5, "--trials", min=1, help="correctness trials per candidate"),
    timed_runs: int = typer.Option(20, "--timed-runs", min=1),
    no_compile: bool = typer.Option(False, "--no-compile", help="do not time the reference under torch.compile"),
    temperature: Optional[float] = typer.Option(None, "--temperature"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens",
                                             help="the answer's token limit, lowered per call to what the window "
                                                  "leaves (0: not sent; default 8192)"),
    concurrency: Optional[int] = typer.Option(None, "--concurrency",
                                              help="model calls in flight at once (never more than the server's "
                                                   "slots where it says); default 4"),
    context_tokens: Optional[int] = typer.Option(None, "--context-tokens",
                                                 help="the model's context window in tokens (default: asked of the "
                                                      "server, else learned from its first overflow refusal)"),
    reasoning_effort: Optional[str] = typer.Option(None, "--reasoning-effort",
                                                   help="passed through to the model (e.g. low, medium, high)"),
    first_token_timeout: Optional[float] = typer.Option(None, "--first-token-timeout",
                                                        help="seconds to the first streamed chunk (default 600)"),
    stall_timeout: Optional[float] = typer.Option(None, "--stall-timeout",
                                                  help="longest silence between chunks, in seconds; past it the partial "
                                                       "answer is kept, cut off (default 120)"),
    call_budget: Optional[float] = typer.Option(None, "--call-budget",
                                                help="one model call's total seconds; past it the partial answer is "
                                                     "kept, cut off (0: none; default 1800)"),
    set_: Optional[list[str]] = SetOption,
    precision: Optional[str] = PrecisionOption,
    math: Optional[str] = MathOption,
    kernel_backend: Optional[str] = BackendOption,
    resume: Optional[int] = typer.Option(None, "--resume", help="continue run RUN where it stopped (over its own "
                                                                 "tasks: task arguments, if given, must be those)"),
    seed_with: Optional[str] = typer.Option(None, "--seed-with",
                                            help="builtin: the built-in proposer answers an extra first round, "
                                                 "and the model's first round refines its fastest correct "
                                                 "candidate (its measured profile in the prompt)"),
    executor: str = ExecutorOption,
    ray_address: Optional[str] = RayAddressOption,
    db: Optional[str] = DbOption,
) -> None:
    """Optimise tasks: each round samples candidates, evaluates, critiques and refines."""
    from agent.backends.base import BackendError, get_backend
    from agent.loop import LoopConfig, OptimizeLoop
    from kernelloop.cli_executor import cli_device_facts, open_cli_executor
    from kernelloop.paths import code_version
    from sandbox.result import EvalConfig
    from sandbox.tasks import TaskError, TaskSpec, parse_overrides
    from store.models import Run, Task

    store = open_store(db)
    if resume is not None:
        with store.reader() as s:
            run = s.get(Run, resume)
            if run is None:
                fail(f"no run {resume} in {store.url} (kernelloop runs lists them)")
            cfg = LoopConfig.from_json(run.config)
            specs = []
            for t in run.config["tasks"]:
                task_row = s.scalar(sa.select(Task).where(Task.sha256 == t["sha256"]))
                specs.append(TaskSpec(name=t["name"], path=t["path"], source=task_row.source,
                                      overrides=run.config["overrides"].get(t["name"], {})))
        run_id = resume
        if tasks:
            _same_tasks_or_fail(resume, specs, tasks)
        resolve_executor_device(cfg.device, executor)
        if (precision or math) and resolve_numerics(precision, math, cfg.eval.numerics) != cfg.eval.numerics:
            fail(f"run {resume} was started under {cfg.eval.numerics.label}: --resume keeps its numerics "
                 f"(drop --precision/--math, or start a new run)")
        if kernel_backend and resolve_kernel_backend(kernel_backend, cfg.device) != cfg.eval.backend:
            fail(f"run {resume} was started with --backend {cfg.eval.backend or cfg.device}: --resume keeps its "
                 f"backend (drop --backend, or start a new run)")
        if rounds is not None:      # the seeded round 0 (--seed-with) stays one of the run's rounds
            cfg.rounds = rounds + (1 if cfg.seed_with else 0)
    else:
        dev = resolve_executor_device(device, executor)
        try:
            overrides = parse_overrides(set_)
        except TaskError as exc:
            fail(str(exc))
        specs = _load_specs(tasks or ["seeds"], overrides)
        options = {k: v for k, v in {"temperature": temperature, "max_tokens": max_tokens,
                                     "concurrency": concurrency, "context_tokens": context_tokens,
                                     "reasoning_effort": reasoning_effort,
                                     "first_token_timeout_s": first_token_timeout, "stall_timeout_s": stall_timeout,
                                     "call_budget_s": call_budget}.items() if v is not None}
        cfg = LoopConfig(model=model, device=dev, rounds=(rounds or 3) + (1 if seed_with else 0), samples=samples,
                         critic=critic, seed_with=seed_with,
                         target_speedup=target_speedup, patience=patience,
                         eval=EvalConfig(trials=trials, timed_runs=timed_runs, time_compile=not no_compile,
                                         numerics=resolve_numerics(precision, math),
                                         backend=resolve_kernel_backend(kernel_backend, dev)),
                         backend_options=options)
    if cfg.critic not in (None, "grounded", "llm"):
        fail(f"--critic must be grounded or llm, not {cfg.critic!r}")
    try:
        backend = get_backend(cfg.model, store=store, **cfg.backend_options)
        if cfg.seed_with:
            from agent.backends.seeded import seeded_backend
            backend = seeded_backend(backend, cfg.seed_with, cfg.model)
    except BackendError as exc:
        fail(str(exc))

    sandbox = open_cli_executor(executor, cfg.device, cfg.eval, store, ray_address)
    facts = cli_device_facts(sandbox, lambda: device_facts(cfg.device, sandbox.device_name, store))
    state: dict[str, Any] = {}

    def render() -> Table:
        return _summary_table(list(state.values()), f"kernelloop optimize · {cfg.model} · {facts.name} · "
                                                    f"{cfg.eval.numerics.label}")

    loop = OptimizeLoop(store, backend, sandbox, cfg, facts, on_progress=lambda p: state.__setitem__(p.name, p))
    if resume is None:
        run_id = loop.start_run(specs, code_version())
    else:
        with store.session() as s:
            run = s.get(Run, run_id)
            run.status = "running"
            if run.config.get("rounds") != cfg.rounds:
                run.config = {**run.config, "rounds": cfg.rounds}
    console.print(f"run {run_id}: {len(specs)} task(s), {cfg.rounds} round(s) x {cfg.samples} sample(s), "
                  f"model {cfg.model}, device {cfg.device} ({facts.name}), store {store.url}")
    if cfg.seed_with:
        console.print(f"round 0 by {cfg.seed_with}: the model's first round (round 1) refines its fastest "
                      "correct candidate", highlight=False)
    console.print(f"numerics {cfg.eval.numerics.describe()}; backend {cfg.eval.backend or cfg.device}", highlight=False)
    if cfg.device == "cpu":
        from sandbox.slots import cpu_timing_note
        console.print(cpu_timing_note(), highlight=False)
    status = "finished"
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        if console.is_terminal:
            with Live(render(), console=console, refresh_per_second=2) as live:
                loop.on_progress = lambda p: (state.__setitem__(p.name, p), live.update(render()))
                progress = loop.run(run_id, specs)
        else:
            # Logs and pipes: one line whenever something about a task changes, saying only that.
            printed: dict[str, tuple] = {}
            print_lock = threading.Lock()

            def log_line(p: Any) -> None:
                state[p.name] = p
                with print_lock:
                    line, printed[p.name] = progress_line(p, printed.get(p.name))
                    if line:
                        console.print(line, highlight=False)

            loop.on_progress = log_line
            progress = loop.run(run_id, specs)
    except KeyboardInterrupt:
        loop.stop()
        status = "interrupted"
        progress = list(state.values())
        err_console.print(f"interrupted: continue with kernelloop optimize --resume {run_id}")
    except BackendError as exc:
        status = "failed"
        loop.finish_run(run_id, status)
        fail(str(exc))
    finally:
        signal.signal(signal.SIGTERM, previous)
        sandbox.close()
    loop.finish_run(run_id, status)   # per-task errors are in the table; the run itself completed
    console.print(_summary_table(progress, f"run {run_id} · {status} · {cfg.eval.numerics.label}"))
    for p in progress:
        if p.error:
            err_console.print(f"[red]{p.name}[/]: {p.error}", highlight=False)
    if cfg.rounds > 1 and status != "interrupted":
        _print_gains(loop, run_id, specs)
    store.close()
    if status == "interrupted":
        raise typer.Exit(130)


def _print_gains(loop: Any, run_id: int, specs: list) -> None:
    """Each task's round-by-round best and where each gain came from (agent.gains)."""
    from agent.gains import round_gains

    console.print("Gains by round (best clean attempt so far; speedups vs eager and medians from each "
                  "attempt's own evaluation):", highlight=False)
    for spec in specs:
        lines = round_gains(loop._views(run_id, loop._task_id(spec)))
        for line in lines:
            console.print(f"  {spec.name} {line}", highlight=False, soft_wrap=True)


def progress_line(p: Any, last: Optional[tuple]) -> tuple[Optional[str], tuple]:
    """(the log line for a task's progress ``p``, or None when nothing changed since ``last``;
    the new ``last``). A round's start, its results and the task's end are each said once."""
    key = (p.round, p.attempts, p.correct, p.clean, p.best_speedup, p.stopped)
    if key == last:
        return None, key
    tally = (f"{p.correct} of {p.attempts} attempt(s) correct ({p.clean} clean) so far, best "
             + (f"{_fmt(p.best_speedup, 'x')} vs eager" if p.best_speedup is not None else "none yet"))
    if p.stopped:
        if p.error:
            return f"{p.name}: stopped: {p.error}", key
        if last is not None and last[:5] == key[:5]:
            return f"{p.name}: finished ({p.stopped})", key
        return f"{p.name}: finished ({p.stopped}); {tally}", key
    if last is None or last[0] != p.round:
        return f"{p.name}: round {p.round} started" + (f" ({tally})" if p.attempts else ""), key
    return f"{p.name}: round {p.round} evaluated: {tally}", key


def run_numerics(run: Any) -> Any:
    """The numerics a stored run was measured under (runs from before numerics existed: fp32/strict)."""
    from sandbox.numerics import numerics_of_run_config

    return numerics_of_run_config(run.config)[0]


def runs_command(db: Optional[str] = DbOption, limit: int = typer.Option(20, "-n", help="newest N runs")) -> None:
    """List runs: id, kind, status, model, device, tasks, attempts, correct."""
    from store.models import Attempt, Evaluation, Run

    store = open_store(db)
    with store.reader() as s:
        runs = list(s.scalars(sa.select(Run).order_by(Run.id.desc()).limit(limit)))
        table = Table(title=f"runs in {store.url}")
        for col in ("id", "kind", "status", "model", "device", "numerics", "tasks", "attempts", "correct", "started",
                    "parent"):
            table.add_column(col)
        for r in runs:
            n_att = s.scalar(sa.select(sa.func.count(Attempt.id)).where(Attempt.run_id == r.id))
            n_tasks = s.scalar(sa.select(sa.func.count(sa.distinct(Attempt.task_id))).where(Attempt.run_id == r.id))
            n_ok = s.scalar(sa.select(sa.func.count(sa.distinct(Evaluation.attempt_id)))
                            .where(Evaluation.run_id == r.id, Evaluation.status == "correct"))
            table.add_row(str(r.id), r.kind, r.status, r.model, f"{r.device} {r.device_name}", run_numerics(r).label,
                          str(n_tasks),
                          str(n_att), str(n_ok), r.started_at.strftime("%Y-%m-%d %H:%M"), str(r.parent_run_id or ""))
    console.print(table)


def attempts_table(session: Any, run_id: int, task_id: Optional[int] = None, title: str = "") -> Table:
    from agent.critic.evidence import attempt_views, run_task_ids
    from store.models import Task

    table = Table(title=title)
    for col in ("task", "attempt", "round", "sample", "answer", "status", "runtime ms", "vs eager", "vs compile", "flags", "cause"):
        table.add_column(col, overflow="fold")
    for tid in ([task_id] if task_id else run_task_ids(session, run_id)):
        task = session.get(Task, tid)
        for v in attempt_views(session, run_id, tid):
            r = v.result
            cause = ""
            if r is not None and r.status.value != "correct":
                cause = (r.build.first_error if r.build and r.build.first_error else
                         (r.first_failed_trial().reason if r.first_failed_trial() else r.error_message)) or ""
            elif r is None:
                cause = v.parse_error or ""
            table.add_row(task.name, str(v.attempt_id), str(v.round), str(v.sample), v.parse_status,
                          r.status.value if r else "-",
                          _fmt(r.candidate_time.median_ms if r and r.candidate_time else None),
                          _fmt(r.speedup_eager if r else None, "x"), _fmt(r.speedup_compile if r else None, "x"),
                          ",".join(sorted({f.kind.value for f in r.flags})) if r else "", cause[:160])
    return table


def show_command(run: int = typer.Argument(..., help="run id"),
                 task: Optional[str] = typer.Argument(None, help="a task name of the run, e.g. seeds/conv2d_divide_leakyrelu"),
                 db: Optional[str] = DbOption) -> None:
    """Show a run's attempts with their verdicts; with TASK, also its latest analysis."""
    from rich.markdown import Markdown

    from agent.critic.cli import _match_tasks
    from store.repo import get_run, latest_analysis

    store = open_store(db)
    with store.reader() as s:
        try:
            r = get_run(s, run)
        except LookupError as exc:
            fail(str(exc))
        console.print(f"run {r.id} · {r.kind} · {r.status} · model {r.model} · critic {r.critic} · "
                      f"{r.device} {r.device_name} · torch {r.torch_version} · code {r.code_version} · "
                      f"{run_numerics(r).describe()}")
        tasks = _match_tasks(s, run, task) if task else [None]
        if task and not tasks:
            fail(f"run {run} has no task matching {task!r}")
        for t in tasks:
            console.print(attempts_table(s, run, t.id if t else None, title=t.name if t else f"run {run}"))
            if t is not None:
                a = latest_analysis(s, run, t.id)
                if a is not None:
                    console.print(Markdown(a.markdown))


def replay_command(run: int = typer.Argument(..., help="the stored run whose candidates to re-evaluate"),
                   device: Optional[str] = DeviceOption,
                   tasks: Optional[list[str]] = typer.Option(None, "--tasks", "-t", help="only these task names"),
                   force: bool = typer.Option(False, "--force", help="re-evaluate even where this device, torch and config already have a result"),
                   no_compile: bool = typer.Option(False, "--no-compile"),
                   precision: Optional[str] = typer.Option(None, "--precision",
                                                           help="fp32 | fp16 | bf16 [default: the stored run's]"),
                   math: Optional[str] = typer.Option(None, "--math", help="default | strict [default: the stored run's]"),
                   kernel_backend: Optional[str] = typer.Option(None, "--backend",
                                                                help="cuda | triton [default: the stored run's]"),
                   executor: str = ExecutorOption,
                   ray_address: Optional[str] = RayAddressOption,
                   db: Optional[str] = DbOption) -> None:
    """Re-evaluate a run's stored candidates on this machine as a new run linked to the old one,
    and show verdict and speed changes side by side (under the old run's numerics unless told)."""
    from agent.critic.cli import critique_run
    from agent.loop import LoopConfig, evaluate_attempt
    from kernelloop.paths import code_version
    from kernelloop.cli_executor import open_cli_executor
    from sandbox.admission import TaskTooLarge
    from sandbox.result import EvalResult
    from sandbox.tasks import TaskSpec, with_device_sizes
    from store.models import Attempt, Run, Task
    from store.repo import get_run, latest_evaluation

    store = open_store(db)
    dev = resolve_executor_device(device, executor)
    with store.reader() as s:
        try:
            old = get_run(s, run)
        except LookupError as exc:
            fail(str(exc))
        cfg = LoopConfig.from_json(old.config)
        overrides = (old.config or {}).get("overrides", {})
        old_attempts = [a for a in s.scalars(sa.select(Attempt).where(Attempt.run_id == run).order_by(Attempt.id))]
        rows = []
        for a in old_attempts:
            t = s.get(Task, a.task_id)
            if tasks and t.name not in tasks:
                continue
            ev = latest_evaluation(a)
            rows.append((a, t, EvalResult.model_validate(ev.result) if ev else None))
    if not rows:
        fail(f"run {run} has no attempts" + (f" for {', '.join(tasks)}" if tasks else ""))
    numerics = resolve_numerics(precision, math, cfg.eval.numerics)
    backend_name = resolve_kernel_backend(kernel_backend, dev, cfg.eval.backend)     # unset: the stored run's
    eval_cfg = cfg.eval.model_copy(update={"time_compile": cfg.eval.time_compile and not no_compile,
                                           "numerics": numerics, "backend": backend_name})
    if numerics != cfg.eval.numerics:
        err_console.print(f"[yellow]note:[/] run {run} was measured under {cfg.eval.numerics.label}, this replay under "
                          f"{numerics.label}: verdicts and speedups are not comparable one for one", highlight=False)
    sandbox = open_cli_executor(executor, dev, eval_cfg, store, ray_address)
    with store.session() as s:
        new = Run(kind="replay", status="running", model=f"replay:{run}", critic="grounded", device=dev,
                  backend=backend_name or dev,
                  device_name=sandbox.device_name, torch_version=sandbox.torch_version, code_version=code_version(),
                  config={**old.config, "device": dev, "eval": eval_cfg.model_dump(mode="json")}, parent_run_id=run)
        s.add(new)
        s.flush()
        new_id = new.id
    table = Table(title=f"replay of run {run} ({old.device_name}, torch {old.torch_version}, {cfg.eval.numerics.label}) "
                        f"as run {new_id} ({sandbox.device_name}, torch {sandbox.torch_version}, {numerics.label})")
    for col in ("task", "attempt", "old status", "new status", "old ms", "new ms", "old vs eager", "new vs eager", "change"):
        table.add_column(col)
    try:
        for a, t, old_result in rows:
            spec = with_device_sizes(TaskSpec(name=t.name, path=t.path, source=t.source,
                                              overrides=overrides.get(t.name, {})), dev)
            with store.session() as s:
                na = Attempt(run_id=new_id, task_id=t.id, round=a.round, sample=a.sample, model_call_id=a.model_call_id,
                             parse_status=a.parse_status, parse_error=a.parse_error, source=a.source, sha256=a.sha256,
                             parent_ids=[a.id])
                s.add(na)
                s.flush()
                new_attempt_id = na.id
            result = None
            if a.parse_status == "ok" and a.source:
                try:
                    result = evaluate_attempt(store, sandbox, spec, new_attempt_id, new_id, a.source, a.sha256,
                                              force=force)
                except TaskTooLarge as exc:      # the task's status here, not the candidate's verdict
                    table.add_row(t.name, str(a.id), old_result.status.value if old_result else a.parse_status,
                                  "too_large", "", "", "", "", exc.reason)
                    continue
            change = _change(old_result, result)
            table.add_row(t.name, str(a.id), old_result.status.value if old_result else a.parse_status,
                          result.status.value if result else a.parse_status,
                          _fmt(old_result.candidate_time.median_ms if old_result and old_result.candidate_time else None),
                          _fmt(result.candidate_time.median_ms if result and result.candidate_time else None),
                          _fmt(old_result.speedup_eager if old_result else None, "x"),
                          _fmt(result.speedup_eager if result else None, "x"), change)
        critique_run(store, new_id, critic="grounded", explicit=False)
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        sandbox.close()
        with store.session() as s:
            import datetime as dt

            r = s.get(Run, new_id)
            r.status = status
            r.finished_at = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    console.print(table)


def _change(old: Any, new: Any) -> str:
    if old is None or new is None:
        return "-"
    if old.status != new.status:
        return f"{old.status.value} -> {new.status.value}"
    if old.speedup_eager and new.speedup_eager:
        return f"{new.speedup_eager / old.speedup_eager:.2f}x relative speedup"
    return "same verdict"
