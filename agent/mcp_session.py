"""What ``kernelloop mcp`` does for one client, without the protocol: tasks, baselines, and
evaluations stored as attempts of runs of kind ``agent``.

A coding agent's session is one or more runs of kind ``agent`` (model ``mcp:<client name>``,
critic ``grounded``): one run per device and evaluation configuration (numerics, backend), so
every run is measured under one convention as an ``optimize`` run is, and ``runs``, ``report``,
``export``, ``replay`` and ``compare`` read it as they read one. Each ``evaluate`` call stores an
attempt (round = the task's attempts before it in that run, sample 0, parent = the task's previous
attempt), then evaluates it through ``agent.loop.evaluate_attempt`` with the sandbox ``kernelloop
eval`` uses (``sandbox.evaluate.Sandbox``, warm workers off), then has the grounded critic write
the task's analysis, as the loop does after a round. All writes go through ``Store.session``.

Bad input (an unknown task, an empty source or one that is not Python, a device that is not
there, an unknown precision or backend) raises ``ToolInputError`` naming the cause before
anything is stored. A cancelled evaluation (``cancel``) kills the session's workers and stores
no verdict for the evaluations it stopped (their attempts stay, without one, as an interrupted
``optimize`` run's do).
"""
from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import sqlalchemy as sa

from sandbox.result import EvalConfig, EvalResult
from sandbox.tasks import TaskError, TaskSpec

MODEL_PREFIX = "mcp"
KIND = "agent"


class ToolInputError(ValueError):
    """The caller's input cannot be used; the message names the cause."""


class Interrupted(RuntimeError):
    """The evaluation was stopped (its client cancelled it, or went away): no verdict was stored."""


@dataclass
class SessionOptions:
    """How every evaluation of the session is judged (``kernelloop mcp``'s options, as ``eval``'s)."""
    trials: int = 5
    timed_runs: int = 20
    time_compile: bool = True


@dataclass
class Job:
    """One evaluation in flight."""
    run_key: str
    run_id: int
    attempt_id: int
    spec: TaskSpec
    source: str
    sha: str
    interrupted: Optional[str] = None
    done: threading.Event = field(default_factory=threading.Event)


def _round(x: Optional[float], digits: int = 4) -> Optional[float]:
    return None if x is None else round(float(x), digits)


def verdict(result: EvalResult) -> dict[str, Any]:
    """The answer an agent reads: verdict, flags and figures, each saying how it was measured."""
    cfg = result.config
    failed = result.first_failed_trial()
    b = result.build
    out: dict[str, Any] = {
        "task": result.task, "status": result.status.value, "correct": result.correct, "clean": result.clean,
        "flags": [{"kind": f.kind.value, "reason": f.reason} for f in result.flags],
        "speedup_eager": _round(result.speedup_eager), "speedup_compile": _round(result.speedup_compile),
        "candidate_ms": _round(result.candidate_time.median_ms if result.candidate_time else None, 6),
        "eager_ms": _round(result.eager_time.median_ms if result.eager_time else None, 6),
        "compile_ms": _round(result.compile_time.median_ms if result.compile_time else None, 6),
        "compile_within_tolerance": result.compile_within_tolerance,
        "compile_fp64_note": result.compile_fp64_note,
        "floor_ms": _round(result.floor_ms, 6), "floor_fraction": _round(result.floor_fraction),
        "numerics": cfg.numerics.label, "numerics_described": cfg.numerics.describe(),
        "convention": (f"medians of {cfg.timed_runs} timed runs each (candidate, reference eager"
                       + (", reference torch.compile" if cfg.time_compile else "") + f") in the sandbox on "
                       f"{result.device} ({result.device_name}), torch {result.torch_version}, numerics "
                       f"{cfg.numerics.label}"
                       + (f"; each side's time the {result.candidate_time.convention}" if result.candidate_time else "")
                       + "; floor: the roofline floor on this device, floor_fraction = floor_ms / candidate_ms"),
        "device": result.device, "device_name": result.device_name, "backend": cfg.backend or result.device,
        "build": None if b is None else {"ok": b.ok, "seconds": b.seconds, "cached": b.cached,
                                          "first_error": b.first_error, "first_error_line": b.first_error_line},
        "error": None if not result.error_type and not result.error_message else
        {"type": result.error_type, "message": (result.error_message or "")[:2000]},
        "failed_trial": None if failed is None else {"index": failed.index, "reason": failed.reason},
        "trials_passed": sum(1 for t in result.trials if t.passed),
        "timed_runs_checked": result.timed_runs_checked,
        "stray_processes_killed": result.stray_processes_killed,
        "harness_failure": result.infra, "seconds": result.seconds,
    }
    return out


def _device_label(device: str, config: EvalConfig) -> str:
    return f"{device}|{config.hash()}"


class AgentSession:
    """One client's session: its runs, its sandboxes (one per device and configuration) and the
    evaluations in flight. Thread-safe; every method blocks (the MCP layer runs them in threads)."""

    def __init__(self, store: Any, client: str = "unknown", client_version: Optional[str] = None,
                 options: Optional[SessionOptions] = None):
        self.store = store
        self.client = (client or "unknown").strip()[:150] or "unknown"
        self.client_version = client_version
        self.options = options or SessionOptions()
        self._lock = threading.RLock()
        self._runs: dict[str, int] = {}
        self._sandboxes: dict[str, Any] = {}
        self._inflight: set[int] = set()
        self._jobs: dict[int, Job] = {}
        self._stopped = False           # an evaluation was stopped: the runs end interrupted

    @property
    def model(self) -> str:
        return f"{MODEL_PREFIX}:{self.client}"

    @property
    def run_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._runs.values())

    # ------------------------------------------------------------------ inputs
    @staticmethod
    def device(device: Optional[str]) -> str:
        from kernelloop.cli_common import device_here

        try:
            return device_here(device)
        except ValueError as exc:
            raise ToolInputError(str(exc).replace("--device", "device")) from None

    @staticmethod
    def spec(task: str, device: str) -> TaskSpec:
        from sandbox.cli import eval_spec

        if not task or not task.strip():
            raise ToolInputError("task is empty: name a bundled task (seeds/conv2d_divide_leakyrelu) or a task file")
        try:
            return eval_spec(task.strip(), None, device)
        except TaskError as exc:
            raise ToolInputError(f"task {task!r}: {exc}") from None

    def config(self, device: str, precision: Optional[str], backend: Optional[str]) -> EvalConfig:
        from kernelloop.cli_common import kernel_backend
        from sandbox.backends import BackendError
        from sandbox.numerics import parse_numerics

        try:
            numerics = parse_numerics(precision, None)
        except ValueError as exc:
            raise ToolInputError(f"precision {precision!r}: {exc}") from None
        try:
            name = kernel_backend(backend, device)
        except BackendError as exc:
            raise ToolInputError(f"backend {backend!r}: {exc}") from None
        o = self.options
        return EvalConfig(trials=o.trials, timed_runs=o.timed_runs, time_compile=o.time_compile, numerics=numerics,
                          backend=name)

    @staticmethod
    def check_source(source: Optional[str]) -> str:
        from agent.parse import defines_model_new, syntax_error_of

        if source is None or not source.strip():
            raise ToolInputError("source is empty: pass the candidate module's Python source (defining ModelNew)")
        err = syntax_error_of(source)
        if err:
            raise ToolInputError(f"source is not Python: {err}")
        if not defines_model_new(source):
            raise ToolInputError("source defines no class ModelNew(nn.Module): the candidate must define it")
        return source

    # ------------------------------------------------------------------ tasks
    @staticmethod
    def list_tasks(suite: str) -> list[dict[str, Any]]:
        from evals.tasks_cli import module_sizes, ops_summary
        from sandbox.tasks import discover, read_spec, with_device_sizes

        try:
            specs = [read_spec(p) for p in discover([suite.strip()])] if suite and suite.strip() else None
        except TaskError as exc:
            raise ToolInputError(f"suite {suite!r}: {exc}") from None
        if specs is None:
            raise ToolInputError("suite is empty: name a bundled suite (seeds, level1, level2, level3) or a directory")
        return [{"name": s.name, "path": s.path, "ops": ops_summary(s.source), "sizes": module_sizes(s.source),
                 "cpu_sizes": with_device_sizes(s, "cpu").overrides} for s in specs]

    def show_task(self, task: str, device: Optional[str] = None) -> dict[str, Any]:
        from evals.tasks_cli import module_sizes, ops_summary
        from sandbox.numerics import Numerics

        dev = self.device(device)
        spec = self.spec(task, dev)
        default = Numerics()
        return {"name": spec.name, "path": spec.path, "device": dev, "source": spec.source,
                "ops": ops_summary(spec.source), "sizes": {**module_sizes(spec.source), **spec.overrides},
                "size_overrides_on_device": spec.overrides,
                "numerics": {"default": default.label, "described": default.describe(),
                             "precisions": ["fp32", "fp16", "bf16"]},
                "baselines": self._stored_baselines(spec, dev)}

    def _stored_baselines(self, spec: TaskSpec, device: str, limit: int = 5) -> list[dict[str, Any]]:
        from store.models import Baseline

        with self.store.reader() as s:
            rows = s.scalars(sa.select(Baseline).where(Baseline.task_key == spec.key, Baseline.device == device)
                             .order_by(Baseline.id.desc()).limit(limit)).all()
            return [{"eager_ms": r.eager_ms, "compile_ms": r.compile_ms, "floor_ms": r.floor_ms,
                     "numerics": r.numerics, "device_name": r.device_name, "torch_version": r.torch_version,
                     "runs": (r.details or {}).get("runs"), "measured_at": r.created_at.isoformat(),
                     "convention": f"medians of {(r.details or {}).get('runs')} runs by `kernelloop baseline` "
                                   f"({r.numerics}, {r.device_name}, torch {r.torch_version})"} for r in rows]

    def baseline(self, task: str, device: Optional[str] = None, precision: Optional[str] = None,
                 measure: bool = False) -> dict[str, Any]:
        """The task's stored baselines, the reference times this session's evaluations measured,
        and with ``measure`` a new baseline timed now (as ``kernelloop baseline``) and stored."""
        from evals.baseline import measure_baseline, store_baseline

        dev = self.device(device)
        spec = self.spec(task, dev)
        numerics = self.config(dev, precision, None).numerics
        out: dict[str, Any] = {"task": spec.name, "device": dev, "measured_now": None}
        if measure:
            result = measure_baseline(spec, dev, runs=self.options.timed_runs, compile=self.options.time_compile,
                                      numerics=numerics)
            store_baseline(self.store, spec, result)
            out["measured_now"] = {k: result.get(k) for k in ("eager_ms", "compile_ms", "compile_error", "floor_ms",
                                                               "numerics", "device_name", "runs", "cpu_threads")}
        out["stored"] = self._stored_baselines(spec, dev)
        out["in_this_session"] = [
            {k: h[k] for k in ("attempt_id", "eager_ms", "compile_ms", "floor_ms", "numerics", "convention")}
            for h in self.history(task, device=dev) if h["eager_ms"] is not None][:3]
        return out

    # ------------------------------------------------------------------ evaluate
    def _run_for(self, device: str, config: EvalConfig, spec: TaskSpec) -> int:
        """The session's run for this device and configuration (started on first use); the task is
        added to its configuration (replay reads tasks and overrides from there)."""
        from agent.loop import LoopConfig
        from kernelloop.paths import code_version
        from store.models import Run
        from store.repo import upsert_task

        key = _device_label(device, config)
        with self._lock:
            sandbox = self._sandbox(key, device, config)
            run_id = self._runs.get(key)
            with self.store.session() as s:
                if run_id is None:
                    loop = LoopConfig(model=self.model, device=device, rounds=0, samples=1, critic="grounded",
                                      eval=config)
                    run = Run(kind=KIND, status="running", model=self.model, critic="grounded", device=device,
                              backend=config.backend or device, device_name=sandbox.device_name,
                              torch_version=sandbox.torch_version, code_version=code_version(),
                              config={**loop.to_json(), "tasks": [], "overrides": {},
                                      "client": {"name": self.client, "version": self.client_version}})
                    s.add(run)
                    s.flush()
                    run_id = self._runs[key] = run.id
                run = s.get(Run, run_id)
                upsert_task(s, spec)
                if spec.name not in {t["name"] for t in run.config.get("tasks", [])}:
                    cfg = dict(run.config)
                    cfg["tasks"] = [*cfg.get("tasks", []), {"name": spec.name, "path": spec.path,
                                                            "sha256": spec.sha256}]
                    cfg["overrides"] = {**cfg.get("overrides", {}), spec.name: {}}
                    run.config = cfg
            return run_id

    def _sandbox(self, key: str, device: str, config: EvalConfig) -> Any:
        from sandbox.evaluate import Sandbox

        sandbox = self._sandboxes.get(key)
        if sandbox is None:
            try:
                # as ``kernelloop eval`` evaluates (sandbox.evaluate.evaluate); kept for the session,
                # so the task's reference worker stays started between calls
                sandbox = self._sandboxes[key] = Sandbox(device, config, warm_workers=0)
            except ValueError as exc:
                raise ToolInputError(f"device {device!r}: {exc}") from None
        return sandbox

    def submit(self, task: str, source: str, device: Optional[str] = None, precision: Optional[str] = None,
               backend: Optional[str] = None) -> Job:
        """Check the input and store the attempt; ``judge`` then evaluates it."""
        from sandbox.evaluate import sha256_text
        from store.models import Attempt
        from store.repo import upsert_task

        source = self.check_source(source)
        dev = self.device(device)
        config = self.config(dev, precision, backend)
        spec = self.spec(task, dev)
        run_id = self._run_for(dev, config, spec)
        sha = sha256_text(source)
        with self.store.session() as s:
            task_id = upsert_task(s, spec).id
            before = s.scalars(sa.select(Attempt).where(Attempt.run_id == run_id, Attempt.task_id == task_id)
                               .order_by(Attempt.round.desc())).all()
            attempt = Attempt(run_id=run_id, task_id=task_id, round=(before[0].round + 1) if before else 0, sample=0,
                              model_call_id=None, parse_status="ok", parse_error=None, source=source, sha256=sha,
                              parent_ids=[before[0].id] if before else [])
            s.add(attempt)
            s.flush()
            job = Job(run_key=_device_label(dev, config), run_id=run_id, attempt_id=attempt.id, spec=spec,
                      source=source, sha=sha)
        with self._lock:
            self._jobs[job.attempt_id] = job
        return job

    def judge(self, job: Job, on_stage: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
        """Evaluate the job's attempt and store the evaluation and the grounded critic's analysis;
        raises ``Interrupted`` (nothing stored) where it was cancelled meanwhile."""
        from agent.critic.cli import critique_run
        from agent.loop import evaluate_attempt
        from sandbox.phases import listening

        with self._lock:
            if job.interrupted is not None:     # cancelled before it started
                job.done.set()
                raise Interrupted(job.interrupted)
            sandbox = self._sandboxes.get(job.run_key)
            if sandbox is None:          # an earlier cancel stopped it: a fresh one
                cfg = self._config_of(job.run_id)
                sandbox = self._sandbox(job.run_key, cfg[0], cfg[1])
            self._inflight.add(job.attempt_id)
        try:
            with listening(on_stage or (lambda stage: None)):
                result = evaluate_attempt(self.store, sandbox, job.spec, job.attempt_id, job.run_id, job.source,
                                          job.sha, keep=lambda: job.interrupted is None)
            if job.interrupted is not None:
                raise Interrupted(job.interrupted)
            analysis = critique_run(self.store, job.run_id, task=job.spec.name, critic="grounded", explicit=False)
        finally:
            with self._lock:
                self._inflight.discard(job.attempt_id)
            job.done.set()
        out = verdict(result)
        out.update(run_id=job.run_id, attempt_id=job.attempt_id,
                   analysis=analysis[0]["markdown"] if analysis else None,
                   critic="grounded")
        return out

    def _config_of(self, run_id: int) -> tuple[str, EvalConfig]:
        from store.models import Run

        with self.store.reader() as s:
            run = s.get(Run, run_id)
            return run.device, EvalConfig(**run.config["eval"])

    def cancel(self, job: Job, why: str) -> None:
        """Stop ``job`` now: the session's workers are killed (``Sandbox.abort`` kills every worker
        this process started), so every evaluation in flight ends without a verdict, each saying why."""
        with self._lock:
            for attempt_id in self._inflight:
                other = self._jobs.get(attempt_id)
                if other is not None and other.interrupted is None:
                    other.interrupted = why if other is job else f"another evaluation of this session was " \
                                                                 f"cancelled ({why}); call evaluate again"
            job.interrupted = job.interrupted or why
            self._stopped = True
            sandboxes, self._sandboxes = list(self._sandboxes.values()), {}
            # killed under the lock: an evaluation that starts next (a fresh sandbox) starts its
            # workers after this kill, never before it, so it is not stopped without being told
            for sb in sandboxes:
                sb.abort()
        for sb in sandboxes:
            sb.close()

    # ------------------------------------------------------------------ history
    def history(self, task: str, device: Optional[str] = None) -> list[dict[str, Any]]:
        """This session's attempts on ``task`` (every run of it), best first: clean before correct
        before the rest, then the higher speedup over eager, then the newer."""
        from store.models import Attempt, Run, Task
        from store.repo import latest_evaluation

        from sandbox.tasks import discover, read_spec

        if not task or not task.strip():
            raise ToolInputError("task is empty: name a task this session evaluated")
        try:
            paths = discover([task.strip()])
            name = read_spec(paths[0]).name if len(paths) == 1 else task.strip()
        except TaskError:
            name = task.strip().removesuffix(".py")     # a task file since moved: its stored name
        runs = self.run_ids
        rows: list[dict[str, Any]] = []
        with self.store.reader() as s:
            q = (sa.select(Attempt, Task.name, Run.device).join(Task, Task.id == Attempt.task_id)
                 .join(Run, Run.id == Attempt.run_id).where(Attempt.run_id.in_(runs)))
            for a, task_name, run_device in s.execute(q):
                if task_name != name:
                    continue
                if device is not None and run_device != device:
                    continue
                ev = latest_evaluation(a)
                r = EvalResult.model_validate(ev.result) if ev is not None else None
                row = {"attempt_id": a.id, "run_id": a.run_id, "task": task_name, "round": a.round,
                       "sha256": a.sha256, "created_at": a.created_at.isoformat(),
                       "status": "not evaluated (interrupted)" if r is None else r.status.value,
                       "clean": bool(r and r.clean), "correct": bool(r and r.correct),
                       "flags": [] if r is None else [f.kind.value for f in r.flags],
                       "speedup_eager": None, "speedup_compile": None, "candidate_ms": None, "eager_ms": None,
                       "compile_ms": None, "floor_ms": None, "floor_fraction": None, "numerics": None,
                       "convention": None, "device": run_device}
                if r is not None:
                    v = verdict(r)
                    row.update({k: v[k] for k in ("speedup_eager", "speedup_compile", "candidate_ms", "eager_ms",
                                                  "compile_ms", "floor_ms", "floor_fraction", "numerics",
                                                  "convention")})
                rows.append(row)
        rows.sort(key=lambda r: (not r["clean"], not r["correct"], -(r["speedup_eager"] or 0.0), -r["attempt_id"]))
        return rows

    # ------------------------------------------------------------------ end
    def close(self, why: str = "the client went away") -> None:
        """End the session: evaluations in flight are stopped (no verdict stored), the sandboxes
        closed, the runs marked finished (interrupted where an evaluation was stopped)."""
        from store.models import Run

        with self._lock:
            jobs = [self._jobs[a] for a in self._inflight if a in self._jobs]
        if jobs:
            self.cancel(jobs[0], why)
            for j in jobs:
                j.done.wait(30)
        stopped = self._stopped
        with self._lock:
            sandboxes, self._sandboxes = list(self._sandboxes.values()), {}
        for sb in sandboxes:
            sb.close()
        now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
        with self.store.session() as s:
            for run_id in self.run_ids:
                run = s.get(Run, run_id)
                if run is not None and run.status == "running":
                    run.status, run.finished_at = ("interrupted" if stopped else "finished"), now
