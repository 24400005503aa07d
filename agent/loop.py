"""The optimisation loop: propose, evaluate, critique, refine — every step stored.

Per task and round: render the prompt from the task's stored history (best and most
instructive attempts, the critic's latest analysis), ask the backend for N samples
(concurrently), store each model call with the attempt parsed from it (one transaction,
so a kill never leaves a call without its attempt), evaluate the attempts through the
shared sandbox (builds in parallel, the device held for runs; a candidate already
evaluated on the same device, torch and config is not evaluated again), then critique.
A task stops after R rounds, at a target speedup, or after K rounds without improvement.

Every decision is derived from the store, so ``--resume RUN`` continues an interrupted
run (Ctrl-C or kill -9) where it stopped: stored samples are not asked for again, stored
evaluations are not redone, nothing is duplicated.
"""
from __future__ import annotations

import datetime as dt
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import sqlalchemy as sa

from agent.backends.base import ModelBackend
from agent.critic.evidence import attempt_views
from agent.parse import parse_answer
from agent.fitting import budget_of
from agent.prompts import fit_proposal_messages
from agent.types import AttemptView, Completion, DeviceFacts, ProposalRequest
from sandbox.admission import TaskTooLarge
from sandbox.evaluate import Sandbox, sha256_text
from sandbox.result import EvalConfig, EvalResult
from sandbox.tasks import TaskSpec, with_device_sizes
from store import Store
from store.models import Analysis, Attempt, Evaluation, ModelCall, Run
from store.repo import cached_evaluation, call_fields, evaluation_row, has_verdict, save_task_stop, upsert_task


@dataclass
class LoopConfig:
    model: str
    device: str
    rounds: int = 3
    samples: int = 2
    critic: Optional[str] = None            # grounded | llm; default follows the backend
    target_speedup: Optional[float] = None  # stop a task once its best clean speedup reaches this
    patience: Optional[int] = None          # stop after this many rounds without improvement
    eval: EvalConfig = field(default_factory=EvalConfig)
    backend_options: dict[str, Any] = field(default_factory=dict)
    seed_with: Optional[str] = None         # round 0 answered by this backend (agent.backends.seeded)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "device": self.device, "rounds": self.rounds, "samples": self.samples,
                **({"seed_with": self.seed_with} if self.seed_with else {}),
                "critic": self.critic, "target_speedup": self.target_speedup, "patience": self.patience,
                "eval": self.eval.model_dump(mode="json"),
                "backend_options": {k: v for k, v in self.backend_options.items() if k != "store"}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LoopConfig":
        return cls(model=data["model"], device=data["device"], rounds=data["rounds"], samples=data["samples"],
                   critic=data.get("critic"), target_speedup=data.get("target_speedup"),
                   patience=data.get("patience"), eval=EvalConfig(**data.get("eval", {})),
                   backend_options=dict(data.get("backend_options") or {}), seed_with=data.get("seed_with"))


@dataclass
class TaskProgress:
    name: str
    round: int = 0
    attempts: int = 0
    correct: int = 0                    # the verdict correct
    clean: int = 0                      # correct, and no disqualifying flag (sandbox.result.EvalResult.clean)
    best_speedup: Optional[float] = None
    best_ms: Optional[float] = None
    eager_ms: Optional[float] = None
    compile_ms: Optional[float] = None
    compile_within: Optional[bool] = None   # torch.compile's own output within the tolerance (EvalResult)
    compile_fp64: Optional[str] = None      # why its output fails the float64 rule (EvalResult.compile_fp64_note)
    floor_ms: Optional[float] = None
    best_compile_speedup: Optional[float] = None
    stopped: str = ""
    error: Optional[str] = None


# Candidates kept in flight per device slot (OptimizeLoop.tasks_in_flight).
CANDIDATES_PER_SLOT = 8
# Said on stderr the moment Ctrl-C reaches the loop, before it waits for the answers in flight
# (kept: --resume does not ask for them again); evaluations in flight are abandoned.
STOPPING = ("[kernelloop] interrupted: stopping at the next step; answers in flight are kept, "
            "evaluations in flight are abandoned (--resume continues)")


def best_clean(views: list[AttemptView]) -> Optional[AttemptView]:
    clean = [v for v in views if v.result is not None and v.result.clean and v.result.speedup_eager]
    return max(clean, key=lambda v: v.result.speedup_eager) if clean else None


def choose_parents(views: list[AttemptView], limit: int = 3) -> list[int]:
    """The best clean attempt (``best_clean``: the highest speedup vs eager, each read against the
    reference timed in its own evaluation), then the latest instructive failures of distinct kinds."""
    parents: list[int] = []
    best = best_clean(views)
    if best is not None:
        parents.append(best.attempt_id)
    seen: set[str] = set()
    for v in sorted(views, key=lambda v: (-v.round, v.sample)):
        kind = v.result.status.value if v.result is not None else v.parse_status
        if v.correct and v.result.clean or kind in seen or v.attempt_id in parents:
            continue
        seen.add(kind)
        parents.append(v.attempt_id)
        if len(parents) >= limit:
            break
    return parents


class OptimizeLoop:
    def __init__(self, store: Store, backend: ModelBackend, sandbox: Sandbox, config: LoopConfig,
                 device_facts: DeviceFacts, on_progress: Optional[Callable[[TaskProgress], None]] = None):
        self.store = store
        self.backend = backend
        self.sandbox = sandbox
        self.config = config
        self.device = device_facts
        self.on_progress = on_progress or (lambda p: None)
        self.critic_name = config.critic or getattr(backend, "default_critic", "grounded")
        self._stop = threading.Event()

    # ------------------------------------------------------------------ runs
    def start_run(self, specs: list[TaskSpec], code_version: str, parent_run_id: Optional[int] = None,
                  kind: str = "optimize") -> int:
        with self.store.session() as s:
            run = Run(kind=kind, status="running", model=self.config.model, critic=self.critic_name,
                      device=self.config.device, backend=self.config.eval.backend or self.config.device,
                      device_name=self.device.name,
                      torch_version=self.device.torch_version, code_version=code_version,
                      config={**self.config.to_json(),
                              "tasks": [{"name": sp.name, "path": sp.path, "sha256": sp.sha256} for sp in specs],
                              "overrides": {sp.name: sp.overrides for sp in specs}},
                      parent_run_id=parent_run_id)
            s.add(run)
            for sp in specs:
                upsert_task(s, sp)
            s.flush()
            return run.id

    def finish_run(self, run_id: int, status: str) -> None:
        # What the backend had to change in the run (e.g. a server that does not stream, asked
        # without streaming) is stored with the run, beside what earlier processes stored.
        notes = list(getattr(self.backend, "run_notes", None) or [])
        with self.store.session() as s:
            run = s.get(Run, run_id)
            kept = list((run.config or {}).get("backend_notes") or [])
            if any(n not in kept for n in notes):
                run.config = {**run.config, "backend_notes": kept + [n for n in notes if n not in kept]}
            run.status = status
            run.finished_at = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)

    def stop(self) -> None:
        self._stop.set()

    def tasks_in_flight(self) -> int:
        """Enough tasks in flight to keep the model's concurrency busy, and every device slot fed
        with ``CANDIDATES_PER_SLOT`` candidates in flight (building on the CPU cores, loading,
        waiting for or holding the device): with one sample a task, four tasks kept a GPU
        fed with four candidates, whose builds (20-26 s on an H100 host) left it idle."""
        slots = len(getattr(self.sandbox, "slots", [None]))
        feed = -(-CANDIDATES_PER_SLOT * slots // max(1, self.config.samples))
        return max(getattr(self.backend, "max_concurrency", 4), 2 * slots, feed)

    def run(self, run_id: int, specs: list[TaskSpec], task_parallelism: Optional[int] = None) -> list[TaskProgress]:
        workers = task_parallelism or max(1, min(len(specs), self.tasks_in_flight()))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="task") as pool:
            futures = [pool.submit(self._optimize_task, run_id, sp) for sp in specs]
            try:
                return [f.result() for f in futures]
            except BaseException as exc:
                # Ctrl-C (or a configuration error in one task): without this the pool's exit
                # would wait for every task to finish all its rounds. Tasks stop at their next
                # check; what they stored so far is what --resume continues from.
                self.stop()
                if isinstance(exc, KeyboardInterrupt):
                    print(STOPPING, file=sys.stderr, flush=True)
                for f in futures:
                    f.cancel()
                # Evaluations in flight would hold the exit for minutes: their workers are
                # killed and what they return is not stored (--resume evaluates them again).
                abort = getattr(self.sandbox, "abort", None)
                if abort is not None:
                    abort()
                raise

    # ------------------------------------------------------------------ one task
    def _task_id(self, spec: TaskSpec) -> int:
        with self.store.session() as s:
            return upsert_task(s, spec).id

    def _views(self, run_id: int, task_id: int) -> list[AttemptView]:
        with self.store.reader() as s:
            return attempt_views(s, run_id, task_id)

    def _progress(self, progress: TaskProgress, views: list[AttemptView], announce: bool = True) -> None:
        progress.attempts = len(views)
        progress.correct = sum(1 for v in views if v.correct)
        progress.clean = sum(1 for v in views if v.correct and v.result.clean)
        best = best_clean(views)
        # The reference times shown are those measured in the same evaluation as the best
        # attempt (its speedups were computed from them), else the latest measured.
        timed = [v.result for v in views if v.result is not None and v.result.eager_time is not None]
        source = best.result if best is not None else (timed[-1] if timed else None)
        if best is not None:
            r = best.result
            progress.best_speedup, progress.best_ms = r.speedup_eager, r.candidate_time.median_ms
            progress.best_compile_speedup = r.speedup_compile
        if source is not None:
            progress.eager_ms = source.eager_time.median_ms
            progress.compile_ms = source.compile_time.median_ms if source.compile_time else None
            progress.compile_within = source.compile_within_tolerance if source.compile_time else None
            progress.compile_fp64 = source.compile_fp64_note if source.compile_time else None
            progress.floor_ms = source.floor_ms
        if announce:
            self.on_progress(progress)

    def _stopped(self, run_id: int, spec: TaskSpec, status: str, reason: str) -> None:
        """Store why the task ended without verdicts (reports list it; a store that cannot take
        it, the likely cause of an ``error``, leaves the run to go on)."""
        try:
            with self.store.session() as s:
                save_task_stop(s, run_id, upsert_task(s, spec).id, status, reason[:4000])
        except Exception as exc:  # noqa: BLE001
            print(f"[kernelloop] {spec.name}'s {status} was not stored: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)

    def _optimize_task(self, run_id: int, spec: TaskSpec) -> TaskProgress:
        from agent.backends.base import BackendError

        progress = TaskProgress(name=spec.name)
        try:
            self._optimize_task_inner(run_id, spec, progress)
        except BackendError:
            raise                       # a configuration error: the run cannot go on (the CLI says why)
        except TaskTooLarge as exc:     # the task's status, not a candidate's verdict (none was stored)
            progress.stopped = exc.reason
            self._stopped(run_id, spec, "too_large", exc.reason)
            self.on_progress(progress)
        except Exception as exc:  # noqa: BLE001 - one task's failure never ends the run
            progress.error = f"{type(exc).__name__}: {exc}"
            progress.stopped = "error"
            self._stopped(run_id, spec, "error", progress.error)
            self.on_progress(progress)
        finally:
            release = getattr(self.sandbox, "release", None)
            if release is not None and not self._stop.is_set():
                release(with_device_sizes(spec, self.config.device))
        return progress

    def _optimize_task_inner(self, run_id: int, spec: TaskSpec, progress: TaskProgress) -> None:
        cfg = self.config
        task_id = self._task_id(spec)
        eval_spec = with_device_sizes(spec, cfg.device)
        # A task that cannot fit in memory even alone stops before any model call.
        too_large = getattr(self.sandbox, "too_large", None)
        big = too_large(eval_spec) if too_large is not None else None
        if big is not None:
            raise big
        best_so_far: Optional[float] = None
        rounds_without_gain = stored_rounds = 0
        for rnd in range(cfg.rounds):
            if self._stop.is_set():
                progress.stopped = "interrupted"
                return
            progress.round = rnd
            views = self._views(run_id, task_id)
            done_rounds = {v.round for v in views}
            # A round whose attempts and analysis are all stored is complete; skip it on resume
            # (unannounced: a resumed run says "round N started" only for rounds it runs).
            stored = rnd in done_rounds and self._round_complete(run_id, task_id, rnd)
            if stored:
                prior = [v for v in views if v.round <= rnd]
                stored_rounds += 1
            else:
                self._progress(progress, views)
                # harness failures (infra_error) are no verdicts: not shown to the model
                self._propose_round(run_id, task_id, spec, eval_spec, rnd,
                                    [v for v in views if v.round < rnd and not (v.result and v.result.infra)])
                if self._stop.is_set():
                    progress.stopped = "interrupted"
                    return
                self._evaluate_round(run_id, task_id, eval_spec, rnd)
                if self._stop.is_set():
                    progress.stopped = "interrupted"
                    return
                self._critique(run_id, spec)
                prior = self._views(run_id, task_id)
            self._progress(progress, prior, announce=not stored)
            best = best_clean(prior)
            best_speed = best.result.speedup_eager if best is not None else None
            if best_speed is not None and (best_so_far is None or best_speed > best_so_far * 1.001):
                best_so_far, rounds_without_gain = best_speed, 0
            else:
                rounds_without_gain += 1
            if cfg.target_speedup is not None and best_speed is not None and best_speed >= cfg.target_speedup:
                progress.stopped = f"target {cfg.target_speedup:g}x reached"
                break
            if cfg.patience is not None and rounds_without_gain >= cfg.patience:
                progress.stopped = f"no improvement in {cfg.patience} round(s)"
                break
        else:
            progress.stopped = f"{cfg.rounds} round(s) done" + (
                f", {stored_rounds} of them stored before this --resume" if stored_rounds else "")
        self.on_progress(progress)

    def _round_complete(self, run_id: int, task_id: int, rnd: int) -> bool:
        with self.store.reader() as s:
            attempts = list(s.scalars(sa.select(Attempt).where(Attempt.run_id == run_id, Attempt.task_id == task_id,
                                                               Attempt.round == rnd)))
            if len(attempts) < self.config.samples:
                return False
            if any(a.parse_status == "ok" and not has_verdict(a) for a in attempts):
                return False
            return s.scalar(sa.select(sa.func.count(Analysis.id)).where(
                Analysis.run_id == run_id, Analysis.task_id == task_id, Analysis.round >= rnd)) > 0

    # ------------------------------------------------------------------ propose
    def _propose_round(self, run_id: int, task_id: int, spec: TaskSpec, eval_spec: TaskSpec, rnd: int,
                       history: list[AttemptView]) -> None:
        with self.store.reader() as s:
            stored = {a.sample for a in s.scalars(sa.select(Attempt).where(
                Attempt.run_id == run_id, Attempt.task_id == task_id, Attempt.round == rnd))}
            analysis = s.scalar(sa.select(Analysis.markdown).where(Analysis.run_id == run_id, Analysis.task_id == task_id)
                                .order_by(Analysis.id.desc()).limit(1))
        missing = [i for i in range(self.config.samples) if i not in stored]
        if not missing:
            return
        floor = next((v.result.floor_ms for v in reversed(history) if v.result and v.result.floor_ms), None)
        def build() -> ProposalRequest:
            # Fitted to the model's window where the backend knows it (raises PromptTooLarge:
            # this task's error, naming the sizes).
            budget, count = budget_of(self.backend)
            template, messages, sha, left_out = fit_proposal_messages(
                eval_spec, self.device, rnd, history, analysis, floor, self.config.eval.numerics, budget, count,
                self.config.eval.backend)
            return ProposalRequest(task=eval_spec, device=self.device, round=rnd, samples=self.config.samples,
                                   messages=messages, template=template, prompt_sha256=sha, history=history,
                                   analysis=analysis, run_id=run_id, numerics=self.config.eval.numerics,
                                   left_out=left_out, kernel_backend=self.config.eval.backend)

        request = build()
        parents = choose_parents(history)

        def ask(sample: int) -> None:
            if self._stop.is_set():
                return                  # interrupted: not asked; --resume asks for it
            asked = request
            completion = self._complete(asked, sample)
            if completion.overflow:
                # The server refused it as larger than the window, which the backend has now
                # learned: fitted again, it is asked once more.
                refitted = build()
                if refitted.messages != asked.messages:
                    asked = refitted
                    completion = self._complete(asked, sample)
            # Stored as soon as it arrives: a kill during another sample's call keeps this one.
            self._store_attempt(run_id, task_id, rnd, sample, asked, completion, parents)

        workers = max(1, min(len(missing), getattr(self.backend, "max_concurrency", 1)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="propose") as pool:
            list(pool.map(ask, missing))

    def _complete(self, request: ProposalRequest, sample: int) -> Completion:
        try:
            return self.backend.complete(request, sample)
        except Exception as exc:  # noqa: BLE001 - configuration errors surface as the call's error
            from agent.backends.base import BackendError

            if isinstance(exc, BackendError):
                raise
            return Completion(text="", model=getattr(self.backend, "name", "?"), error=f"{type(exc).__name__}: {exc}")

    def _store_attempt(self, run_id: int, task_id: int, rnd: int, sample: int, request: ProposalRequest,
                       c: Completion, parents: list[int]) -> None:
        parsed = parse_answer(c.text, c.finish_reason) if not c.error else None
        with self.store.session() as s:
            call = ModelCall(run_id=run_id, task_id=task_id, round=rnd, purpose="propose", model=c.model or self.config.model,
                             template=request.template, prompt_sha256=request.prompt_sha256, messages=request.messages,
                             **call_fields(c, request.left_out))
            s.add(call)
            s.flush()
            if parsed is None:
                status, source, error = "error", None, c.error
            else:
                status, source, error = parsed.status, parsed.source, parsed.error
            s.add(Attempt(run_id=run_id, task_id=task_id, round=rnd, sample=sample, model_call_id=call.id,
                          parse_status=status, parse_error=error, source=source,
                          sha256=sha256_text(source) if source else None,
                          parent_ids=parents))

    # ------------------------------------------------------------------ evaluate
    def _evaluate_round(self, run_id: int, task_id: int, eval_spec: TaskSpec, rnd: int) -> None:
        with self.store.reader() as s:
            pending = [(a.id, a.source, a.sha256) for a in s.scalars(
                sa.select(Attempt).where(Attempt.run_id == run_id, Attempt.task_id == task_id, Attempt.round == rnd,
                                         Attempt.parse_status == "ok").order_by(Attempt.sample))
                       if not has_verdict(a)]
        if not pending:
            return
        # Identical sources in one round: evaluate the first; the others then reuse its
        # evaluation (evaluated concurrently, each would miss the cache and be run again).
        first: list[tuple[int, str, str]] = []
        repeats: list[tuple[int, str, str]] = []
        seen: set[str] = set()
        for p in pending:
            (repeats if p[2] in seen else first).append(p)
            seen.add(p[2])
        with ThreadPoolExecutor(max_workers=len(first), thread_name_prefix="eval") as pool:
            list(pool.map(lambda p: self._evaluate_attempt(run_id, eval_spec, *p), first))
        for p in repeats:
            self._evaluate_attempt(run_id, eval_spec, *p)

    def _evaluate_attempt(self, run_id: int, eval_spec: TaskSpec, attempt_id: int, source: str, sha: str) -> None:
        if self._stop.is_set():
            return                      # interrupted: --resume evaluates it
        evaluate_attempt(self.store, self.sandbox, eval_spec, attempt_id, run_id, source, sha,
                         keep=lambda: not self._stop.is_set())

    # ------------------------------------------------------------------ critique
    def _critique(self, run_id: int, spec: TaskSpec) -> None:
        from agent.critic.cli import critique_run

        critique_run(self.store, run_id, task=spec.name, critic=self.critic_name, explicit=False,
                     backend_options=self.config.backend_options)


def evaluate_attempt(store: Store, sandbox: Sandbox, spec: TaskSpec, attempt_id: int, run_id: int,
                     source: str, sha: str, force: bool = False,
                     keep: Optional[Callable[[], bool]] = None) -> EvalResult:
    """Evaluate an attempt's candidate and store the evaluation; an earlier evaluation of the
    same candidate on the same device, torch and config is reused (stored with ``reused_from``)
    unless ``force``. Where ``keep()`` is false once the evaluation ends (the run was
    interrupted and its workers killed), nothing is stored."""
    with store.session() as s:
        hit = None if force else cached_evaluation(s, sha, spec.key, sandbox.device_name, sandbox.torch_version,
                                                   sandbox.config)
        if hit is not None:
            result = EvalResult.model_validate(hit.result)
            s.add(evaluation_row(result, spec.key, attempt_id, run_id, reused_from=hit.id))
            return result
    result = sandbox.evaluate(spec, source)
    if keep is not None and not keep():
        return result
    with store.session() as s:
        s.add(evaluation_row(result, spec.key, attempt_id, run_id))
    return result


def result_of(ev: Evaluation) -> EvalResult:
    return EvalResult.model_validate(ev.result)
