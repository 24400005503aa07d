"""Evaluating one candidate: the cascade from cheap to expensive checks.

1. static scan (flags only);
2. build, in a worker with the GPU hidden (runs in parallel with other candidates' runs);
3. load: a fresh candidate worker imports the cached build and constructs ``ModelNew``;
4. trials: fresh inputs from secret seeds; the candidate's outputs are compared with the
   reference's by the separate, trusted reference worker, on its device; the candidate
   runs first in trial 0; in trial 1 the same input tensors are refilled with new values
   between two calls (caches keyed by id or data_ptr fail); the cascade stops at the first
   failing trial; every check follows the run's numerics (``sandbox.numerics``: precision,
   math mode, tolerance, the float64 rules); in trial 0 the reference also runs in float64, and
   an output further from that than the reference's (``Numerics.rms_factor``) is flagged
   ``inaccurate``;
5. timing of candidate, reference eager and reference torch.compile by the same code, with
   the device held exclusively (on ``cpu`` in short blocks, the sides interleaved, ABBA), and a
   parent-side clock cross-check; every timed run's output
   checked on a secret sample (``sandbox.runcheck``); the candidate's strays swept before each
   timing and its worker watched while the reference is timed, the GPU watched through NVML
   (``sandbox.quiet``);
6. profiler evidence and the roofline floor.

A crash, hang, CUDA error or cheat ends in a status or a flag for this candidate only. Every
worker runs under a keeper (``sandbox.keeper``): whatever processes the candidate started are
killed when its workers end, counted on the result and flagged.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import sys
import threading
import time
from typing import Any, Optional

import torch

from sandbox import failures, handoff
from sandbox.admission import MemoryGate, TaskTooLarge
from sandbox.backends import backend_for
from sandbox.build import cuda_arch_list
from sandbox.checks import CandidateChecks
from sandbox.footprint import FootprintBook, human_bytes
from hardware.probe import cpu_model
from sandbox.phases import Stages, phase
from sandbox.pool import BUILD_WARM_MESSAGE, BuildPause, DeviceGate, SlotLock, WarmPool, gate_account
from sandbox.quiet import TimingHistory
from sandbox.process import WorkerDied, WorkerProcess, WorkerTimeout, kill_all_workers
from sandbox.reference import Precomputed, ReferenceWorker
from sandbox.result import BuildCheck, BuildInfo, EvalConfig, EvalResult, FlagKind, Status
from sandbox.slots import (build_nice, build_plan, cpu_thread_env, cpu_timing_blocks, cpu_timing_threads,
                           slot_preference, usable_cores, visible_gpus)
from sandbox.tasks import TaskSpec


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible"
    return cpu_model()


# Candidate workers kept started per slot (each one candidate's, then gone), by device. On one
# H200 with 16 cores and 16 candidates in flight, 4 gave 18.25 candidates/min against 2's 15.91,
# side by side in one call (session q: the median wait for a warm worker 8.3 s against 17.5 s, now
# that builds take ~4 s); session o, with 7.5 s builds, had measured no gain. The CPU keeps 2: its
# workers share the cores with the timed runs.
DEFAULT_WARM_WORKERS = {"cuda": 4, "cpu": 2}
class Sandbox:
    """Evaluates candidates for one device kind. Thread-safe: builds run in parallel on the CPU
    cores (up to ``build_slots``); each GPU (or the CPU) is a slot that one candidate holds
    exclusively for its trials and timing, so timings are not disturbed. Workers see only their
    slot's GPU; each slot has its own reference workers."""

    def __init__(self, device: str, config: Optional[EvalConfig] = None, build_slots: Optional[int] = None,
                 init_seed: Optional[int] = None, gpus: Optional[list[str]] = None,
                 arch: Optional[str] = None, footprints: Optional[FootprintBook] = None,
                 memory_budgets: Optional[dict[str, int]] = None, warm_workers: Optional[int] = None,
                 precompute: Optional[bool] = None, prepare: Optional[bool] = None,
                 timing_blocks: Optional[int] = None, cores: Optional[int] = None):
        """``footprints`` and ``memory_budgets``: what tasks need and what may be used
        (``sandbox.admission``); ``warm_workers``: candidate workers kept started per slot (``sandbox.pool``; None: the
        default, 0: each candidate's worker starts when its candidate is ready, as it used to);
        ``precompute``: trial 0's reference outputs computed while the candidate loads (None: when
        workers are kept warm); ``prepare``: a task's footprint measured and its reference started
        while its first candidate builds (``Sandbox.prepare``; None: when workers are kept warm); ``cores``:
        the cores its builds may use (None: those this process may run on; a Ray slot passes its share)."""
        self.device = device
        # Resolved here, where the GPUs are visible, and handed to every worker (build workers
        # run with the GPU hidden); one list for all slots, so every build is a cache hit for all.
        self.arch = (arch or cuda_arch_list()) if device == "cuda" else None
        if device == "cuda" and not self.arch:
            raise ValueError("no CUDA GPU is visible and neither KERNELLOOP_CUDA_ARCH nor TORCH_CUDA_ARCH_LIST is "
                             "set: name the architecture to build CUDA candidates for (e.g. --arch 9.0a)")
        self.config = config or EvalConfig()
        # what candidates are written in: the cascade asks it, never which one it is
        self.backend = backend_for(self.config.backend, device)
        self.build_slots, self.build_jobs = build_plan(cores or usable_cores(), build_slots)
        self._build_sem = threading.Semaphore(self.build_slots)
        self.slots: list[Optional[str]] = (gpus or visible_gpus() or [None]) if device == "cuda" else [None]
        self._slot_locks = [SlotLock() for _ in self.slots]
        self._slot_load = [0 for _ in self.slots]
        self._slot_pick = threading.Lock()
        # cpu: every timed worker with the same small thread count (sandbox.slots.cpu_timing_threads)
        self.cpu_threads = cpu_timing_threads() if device == "cpu" else None
        self.timing_blocks = ((timing_blocks if timing_blocks is not None else cpu_timing_blocks())
                              if device == "cpu" else 1)
        self._refs: dict[tuple[str, int], ReferenceWorker] = {}
        self._refs_lock = threading.Lock()
        self._aborted = threading.Event()
        # KernelBench's convention: one seed before both constructors; secret inputs seeds per trial.
        self.init_seed = init_seed if init_seed is not None else secrets.randbits(31)
        self.device_name = _device_name(device)
        self.torch_version = torch.__version__
        # Workers are admitted against per-GPU, host and outputs budgets (sandbox.admission).
        self.memory = MemoryGate(device, len(self.slots), self.config.numerics, footprints,
                                 memory_budgets, self._slot_env, self._device_work)
        warm = DEFAULT_WARM_WORKERS.get(device, 2) if warm_workers is None else warm_workers
        # cpu: builds stopped while a timing is held (sandbox.pool.BuildPause); the gate keeps the
        # harness's own background work (references starting, warm-ups) out of timings on both targets
        self._build_pause = BuildPause()
        self._gates = [DeviceGate(quiet=self._build_pause.paused if device == "cpu" else None) for _ in self.slots]
        self.handoff = handoff.mode(device)     # how candidates' outputs reach the reference (a bad setting fails here)
        self._pool = WarmPool(self._spawn_candidate, {"device": device, "profile": self.config.profile},
                              warm, background=lambda slot: self._device_work(slot, "warm-up"),
                              turns=device == "cuda") if warm > 0 else None
        # build workers started ahead too (torch's import, 1.5-3 s of every build): one per build slot
        # (on the CPU target their warm-ups, torch's import, wait while a timing is held, as candidates' do)
        self._build_pool = (WarmPool(self._spawn_build, BUILD_WARM_MESSAGE, self.build_slots,
                                     **({"background": lambda slot: self._device_work(slot, "build warm-up")}
                                        if device == "cpu" else {}))
                            if warm > 0 else None)
        self.precompute = (warm > 0) if precompute is None else precompute
        self.prepare_ahead = (warm > 0) if prepare is None else prepare
        self._preparing: set[str] = set()
        self._prepared_on: dict[str, int] = {}    # task key -> the slot its reference is being prepared on
        self._released_while_preparing: set[str] = set()
        self._history = TimingHistory()     # running medians of reference timings (sandbox.quiet)

    # ---------------------------------------------------------------- helpers
    def _device_work(self, slot: int, kind: str = "other") -> Any:
        """Held around the harness's own device work of ``kind`` on ``slot`` (a reference starting,
        a candidate loading, a warm worker's warm-up, a worker's exit): it waits while a candidate
        or reference is timed there. On an H100 such work beside a timed window showed in NVML as
        another process's SM use (1-3%) and flagged honest candidates ``contended``; on the CPU
        target it shares the timed runs' cores. A stopped run does not wait for it (``_aborted``)."""
        return self._gates[slot].background(abandon=self._aborted, kind=kind)

    @property
    def gate_account(self) -> dict[str, dict[str, float]]:
        return gate_account(self._gates)

    def _slot_env(self, slot: int) -> dict[str, str]:
        if self.cpu_threads is not None:
            return cpu_thread_env(self.cpu_threads)
        gpu = self.slots[slot]
        return {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}

    def _build_env(self) -> dict[str, str]:
        env = {"KERNELLOOP_BUILD_JOBS": str(self.build_jobs), **self.backend.worker_env()}
        if self.arch:
            env["KERNELLOOP_CUDA_ARCH"] = self.arch
        return env

    def _spawn_build(self, slot: int = 0) -> WorkerProcess:
        return WorkerProcess("build", hide_gpu=True, env=self._build_env(), nice=build_nice())

    def _spawn_candidate(self, slot: int) -> WorkerProcess:
        return WorkerProcess("candidate", memory_limit_mb=self.config.memory_limit_mb if self.device == "cpu" else None,
                             env={**self._build_env(), **self._slot_env(slot)})

    def _candidate_worker(self, slot: int) -> WorkerProcess:
        """A fresh process for one candidate: a warm one from the pool, else started now."""
        if self._pool is not None:
            return self._pool.take(slot)
        return self._spawn_candidate(slot)

    @property
    def pool_stats(self) -> dict[str, Any]:
        return self._pool.summary() if self._pool is not None else {}

    @property
    def build_pool_stats(self) -> dict[str, Any]:
        return self._build_pool.summary() if self._build_pool is not None else {}

    def reference(self, spec: TaskSpec, slot: int = 0) -> ReferenceWorker:
        with self._refs_lock:
            ref = self._refs.get((spec.key, slot))
            if ref is None:
                ref = self._refs[(spec.key, slot)] = ReferenceWorker(
                    spec, self.device, self.init_seed, warm_compile=self.config.time_compile,
                    env=self._slot_env(slot), numerics=self.config.numerics)
            return ref

    def _start_reference(self, ref: ReferenceWorker, slot: int) -> None:
        """``ref.ensure()``, with the slot's gate where the reference must start (its model, the
        warm-up compile's runs). On cuda its process and imports come first, off the gate
        (``ReferenceWorker.spawn``: they held back the slot's timings for 3-5 s of each start),
        and the worker then asks for the gate in turns, not while torch.compile generates its code
        (``sandbox.warm_compile``; ``KERNELLOOP_REFERENCE_TURNS=0``: the whole load under the gate,
        to compare). On the CPU target the whole start stays under it: imports and compilation
        share the timed runs' cores."""
        if not ref.needs_start():
            ref.ensure()
        elif self.device == "cuda":
            ref.spawn()
            if os.environ.get("KERNELLOOP_REFERENCE_TURNS", "1") == "0":     # the whole load under the gate, as before
                with self._device_work(slot, "reference start"):
                    ref.ensure()
            else:
                ref.ensure(device_turns=lambda: self._device_work(slot, "reference start"))
        else:
            with self._device_work(slot, "reference start"):
                ref.ensure()

    def _pick_slot(self, spec: Optional[TaskSpec] = None) -> int:
        """The least-loaded slot, where a slot running the task's reference counts
        ``REFERENCE_AFFINITY`` candidates less (each slot starts its own reference worker,
        torch.compile included); among equals, one with the reference, then the first."""
        with self._slot_pick:
            key = spec.key if spec is not None else None
            with self._refs_lock:     # started there, or being started there (Sandbox.prepare)
                has_ref = [(key, i) in self._refs or self._prepared_on.get(key) == i for i in range(len(self.slots))]
            slot = min(range(len(self.slots)),
                       key=lambda i: slot_preference(self._slot_load[i], has_ref[i]))
            self._slot_load[slot] += 1
            return slot

    def _release_slot(self, slot: int) -> None:
        with self._slot_pick:
            self._slot_load[slot] -= 1

    def _close_reference(self, key: tuple[str, int]) -> None:
        """Close one idle reference worker (admission needs its memory for another task)."""
        with self._refs_lock:
            ref = self._refs.pop(key, None)
        if ref is not None:
            with ref.lock, self._device_work(key[1], "reference exit"):
                ref.close("idle, its memory admitted to another task's run")

    def prepare(self, spec: TaskSpec) -> None:
        """Start the task's reference in the background (never blocks): its footprint measured if
        not known (``MemoryGate.footprint``), then, where its memory fits now beside what is
        admitted (closing nothing), its worker started on the slot its candidates will most
        likely get (its model, the warm-up ``torch.compile``: 15-19 s on an H100 for KernelBench's
        level-2 tasks). ``evaluate`` calls it before the build, so that start overlaps the build
        instead of following it. A failure here is left to the evaluation, which meets it itself
        and says why (a reference that failed to start is started again there)."""
        if not self.prepare_ahead or self._aborted.is_set():
            return
        with self._refs_lock:
            if spec.key in self._preparing or any(k[0] == spec.key for k in self._refs):
                return
            self._preparing.add(spec.key)
        with self._slot_pick, self._refs_lock:
            # the slot with the fewest tasks' references (started or starting), then the least loaded:
            # at a run's start every slot's load is 0 and each task's candidates follow its reference
            on = set(self._refs) | set(self._prepared_on.items())
            tasks = [sum(1 for k in on if k[1] == i) for i in range(len(self.slots))]
            slot = min(range(len(self.slots)), key=lambda i: (tasks[i], self._slot_load[i]))
            self._prepared_on[spec.key] = slot
        threading.Thread(target=self._prepare, args=(spec, slot), daemon=True, name="prepare").start()

    def _prepare(self, spec: TaskSpec, slot: int) -> None:
        try:
            self.memory.footprint(spec, slot, self._check_aborted, self._close_reference)
            token = self.memory.try_admit_reference(spec, slot)
            if token is None:
                return                  # too large, or no room now: the first run admits and starts it
            try:
                ref = self.reference(spec, slot)
                with ref.lock:
                    self._check_aborted()
                    if ref.needs_start():
                        self._start_reference(ref, slot)
            finally:
                self.memory.leave(token)
        except Exception:  # noqa: BLE001 - see the docstring: the evaluation meets it and says why
            pass
        finally:
            with self._refs_lock:
                released = spec.key in self._released_while_preparing
            if released:
                self._close_task(spec)  # the task ended while its reference started: not kept
            with self._refs_lock:
                self._preparing.discard(spec.key)
                self._released_while_preparing.discard(spec.key)
                self._prepared_on.pop(spec.key, None)

    def too_large(self, spec: TaskSpec) -> Optional[TaskTooLarge]:
        """Whether the task cannot fit even alone (its footprint is measured first if not known)."""
        fp = self.memory.footprint(spec, 0, self._check_aborted, self._close_reference)
        return self.memory.too_large(spec, fp, 0)

    def release(self, spec: TaskSpec) -> None:
        """Stop the task's reference workers (on every slot): a finished task's workers would
        otherwise keep their GPU memory and host memory for the rest of a long run."""
        with self._refs_lock:
            if spec.key in self._preparing:
                self._released_while_preparing.add(spec.key)
        self._close_task(spec)

    def _close_task(self, spec: TaskSpec) -> None:
        with self._refs_lock:
            refs = [(k[1], self._refs.pop(k)) for k in [k for k in self._refs if k[0] == spec.key]]
        for slot, ref in refs:
            with ref.lock, self._device_work(slot, "reference exit"):
                ref.close("its task ended")
        for slot in range(len(self.slots)):
            self.memory.forget_reference((spec.key, slot))

    def abort(self) -> None:
        """Kill every worker now (an interrupted run): evaluations in flight end at once with
        an error status, which the caller must not store as a verdict, and no evaluation starts
        another worker afterwards (one waiting for a build slot would otherwise build for a minute)."""
        self._aborted.set()
        for pool in (self._pool, self._build_pool):
            if pool is not None:
                pool.close()
        kill_all_workers()

    def _check_aborted(self) -> None:
        if self._aborted.is_set():
            raise WorkerDied("the sandbox was stopped (the run was interrupted)", None)

    def close(self) -> None:
        for pool in (self._pool, self._build_pool):
            if pool is not None:
                pool.close()
        if self._aborted.is_set():
            kill_all_workers()          # whatever started in the moment before the abort
        with self._refs_lock:
            for key, ref in self._refs.items():
                ref.close()
                self.memory.forget_reference(key)
            self._refs.clear()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self, spec: TaskSpec, source: str, result: EvalResult) -> bool:
        cfg = self.config
        t0 = time.monotonic()
        worker = self._build_pool.take(0) if self._build_pool is not None else self._spawn_build()
        self._build_pause.add(worker)
        try:
            reply = self._build_pause.ask(worker, {"role": "build", "device": self.device,
                                                   "out_dir": str(worker.out_dir), "task": spec.__dict__,
                                                   "source": source, "init_seed": 0, "backend": cfg.backend},
                                          cfg.build_timeout_s)
        except WorkerTimeout:
            result.status = Status.timeout
            result.error_type = "BuildTimeout"
            result.error_message = f"building the candidate took longer than {cfg.build_timeout_s:.0f} s"
            result.build = BuildInfo(ok=False, seconds=time.monotonic() - t0, log=worker.output("stdout")[-4000:])
            return False
        except WorkerDied as exc:
            if self._aborted.is_set():      # killed by the abort: no verdict, no harness failure
                result.status, result.error_type = Status.runtime_error, "Interrupted"
                result.error_message = f"the sandbox was stopped (the run was interrupted) while building: {exc}"
                return False
            verdict = failures.classify(exc, worker)
            result.status = Status.infra_error if verdict.infra else Status.load_error
            result.error_type = verdict.error_type
            result.error_message = f"{verdict.message} while importing the candidate to build it"
            result.stderr = worker.output("stderr")
            return False
        finally:
            self._build_pause.discard(worker)
            worker.kill()
            contained(result, worker, "after its build")
            stdout, stderr = worker.output("stdout"), worker.output("stderr")
            worker.cleanup()
        builds = reply.get("builds") or []
        log = "\n".join(b.get("log", "") for b in builds if b.get("log")) or ""
        info = BuildInfo(ok=reply.get("stage") != "build", seconds=round(time.monotonic() - t0, 3),
                         cached=bool(builds) and all(b.get("cached") for b in builds),
                         extensions=[b["name"] for b in builds], log=log[-20_000:],
                         notes=[n for b in builds for n in b.get("notes", [])])
        result.build = info
        if reply.get("stage") == "build":
            full_log = log + "\n" + (reply.get("error_message") or "") + "\n" + stdout + "\n" + stderr
            info.log = full_log[-20_000:]
            info.first_error, info.first_error_line = self.backend.first_error(
                full_log, source, [b["directory"] for b in builds])
            result.status = Status.compile_error
            result.error_type = reply.get("error_type")
            result.error_message = (info.first_error or reply.get("error_message") or "")[:2000]
            return False
        return True

    # ---------------------------------------------------------------- evaluate
    def _new_result(self, spec: TaskSpec, source: str) -> EvalResult:
        result = EvalResult(status=Status.runtime_error, task=spec.name, task_sha256=spec.sha256,
                            candidate_sha256=sha256_text(source), device=self.device,
                            device_name=self.device_name, torch_version=self.torch_version,
                            config=self.config)
        result.flags.extend(self.backend.scan(source))
        return result

    def evaluate(self, spec: TaskSpec, source: str) -> EvalResult:
        """The candidate's verdict; a failure of the harness (``sandbox.failures``) is retried up
        to ``MAX_INFRA_RETRIES`` times with fresh workers, then returned as ``infra_error``."""
        t0 = time.monotonic()
        retried: list[str] = []
        self.prepare(spec)
        while True:
            result = self._evaluate_once(spec, source)
            if not result.infra or self._aborted.is_set() or len(retried) >= failures.MAX_INFRA_RETRIES:
                break
            retried.append(f"{result.error_type}: {result.error_message}")
            # said as it happens: a harness failure that repeats (a task too large for a step the
            # footprint does not count) otherwise shows nothing until its third try is stored
            print(f"[kernelloop] {spec.name}: a harness failure, not the candidate's ({retried[-1][:400]}); "
                  f"evaluating it again with fresh workers (try {len(retried) + 1} of {failures.MAX_INFRA_RETRIES + 1})",
                  file=sys.stderr, flush=True)
        result.infra_retries = retried
        result.seconds = round(time.monotonic() - t0, 3)
        return result

    def _evaluate_once(self, spec: TaskSpec, source: str) -> EvalResult:
        t0 = time.monotonic()
        result = self._new_result(spec, source)
        if self._pool is not None and not self._aborted.is_set():
            for slot in range(len(self.slots)):
                self._pool.prime(slot)      # warm while this candidate builds
        if self._build_pool is not None and not self._aborted.is_set():
            self._build_pool.prime(0)
        try:
            with phase(result, "build_wait"):
                self._build_sem.acquire()
            try:
                self._check_aborted()
                built = self._build(spec, source, result)
            finally:
                self._build_sem.release()
            result.phases["build"] = result.build.seconds if result.build else 0.0
            if built:
                self._run(spec, source, result)
        except (WorkerDied, WorkerTimeout, failures.InfraFailure) as exc:
            # the reference failed to start (a candidate's own failures end inside _run_on)
            verdict = failures.classify(exc)
            if self._aborted.is_set():
                result.status, result.error_type, result.error_message = Status.runtime_error, "Interrupted", str(exc)
            elif not verdict.infra:
                raise
            else:
                result.status, result.error_type, result.error_message = \
                    Status.infra_error, verdict.error_type, verdict.message
        finally:
            result.seconds = round(time.monotonic() - t0, 3)
        return result

    def build_only(self, spec: TaskSpec, source: str) -> BuildCheck:
        """The cascade's first two stages alone (static scan, build): no device is touched."""
        t0 = time.monotonic()
        result = self._new_result(spec, source)
        with self._build_sem:
            ok = self._build(spec, source, result)
        return BuildCheck(task=spec.name, device=self.device, arch=self.arch, torch_version=self.torch_version,
                          ok=ok, status=None if ok else result.status, error_type=result.error_type,
                          error_message=result.error_message, build=result.build, flags=result.flags,
                          seconds=round(time.monotonic() - t0, 3))

    def _run(self, spec: TaskSpec, source: str, result: EvalResult) -> None:
        """Load the candidate (outside the device lock: imports and CUDA start-up overlap with
        other candidates' runs), then hold the device for trials, timing and profiling."""
        slot = self._pick_slot(spec)
        result.gpu = self.slots[slot]
        try:
            with phase(result, "memory_wait"):      # raises TaskTooLarge: no verdict for this task
                admitted = self.memory.admit(spec, slot, self._close_reference, self._check_aborted)
            # what its runs leave out or move to fit this device (MemoryGate.plan)
            fp = self.memory.footprint(spec, slot)
            planned, fp64 = self.memory.plan(spec, fp, slot)
            note = ""
            if self.config.numerics.fp64_check and not fp64:
                # the float64 copy and run do not fit beside the run: the tolerance alone judges
                result.config = self.config.model_copy(update={"numerics": self.config.numerics.model_copy(
                    update={"fp64_check": False})})
                note = (f"\n[kernelloop] float64 check skipped: the task's float64 copy and run "
                        f"({human_bytes(fp.fp64_bytes)}) do not fit beside it on this device; "
                        f"judged by the tolerance alone")
            if planned.inputs_copy_on_host:
                note += ("\n[kernelloop] the inputs' copy for the mutation check is kept in host memory: "
                         "the task fits this device only so")
            try:
                self._run_on(slot, spec, source, result, planned.inputs_copy_on_host)
                result.stderr += note
            finally:
                self.memory.leave(admitted)
        finally:
            self._release_slot(slot)

    def _run_on(self, slot: int, spec: TaskSpec, source: str, result: EvalResult,
                inputs_copy_on_host: bool = False) -> None:
        cfg = result.config or self.config      # this evaluation's (without the float64 check where it does not fit)
        ref = self.reference(spec, slot)
        with phase(result, "reference"), ref.lock:
            self._check_aborted()
            # a reference starting runs on the device (its model, a warm-up compile); one running
            # already needs nothing, and need not wait for another candidate's timing
            self._start_reference(ref, slot)
        result.device_name = ref.device_name or result.device_name
        self._check_aborted()
        first = (Precomputed(ref, bool(cfg.numerics.fp64_check), self._gates[slot],
                             hold=lambda: self.memory.hold_ahead(spec, slot), release=self.memory.leave)
                 if self.precompute else None)
        try:
            with phase(result, "worker"):
                cand = self._candidate_worker(slot)
            cand.device_share = self.memory.candidate_share(spec, slot)     # read by sandbox.failures.candidate_oom
        except BaseException:
            if first is not None:
                first.discard()
            raise
        try:
            # loading builds the model on the device (and Triton's warm-up forward compiles and
            # runs kernels): kept off the device while another candidate on this slot is timed
            # (``load_wait``: the wait for that, behind timings held or asked for on the slot)
            loading = Stages(result)
            try:
                loading.enter("load_wait")
                with self._device_work(slot, "candidate load"):
                    loading.enter("load")
                    loaded = self._load_candidate(spec, source, result, cand)
            finally:
                loading.enter(None)
            if loaded:
                with phase(result, "device_wait"):
                    self._slot_locks[slot].acquire()
                stages = Stages(result)
                try:
                    CandidateChecks(cfg, self.device, self.slots[slot], self._history, inputs_copy_on_host,
                                    self.timing_blocks,
                                    quiet=self._build_pause.paused if self.device == "cuda" else contextlib.nullcontext).run(
                        result, ref, cand, stages, first, self._gates[slot], self._slot_locks[slot])
                finally:
                    stages.enter(None)
                    # its exit (its CUDA context torn down; anything it left running) before the slot's
                    # next timing can begin: killed after the slot was let go, it overlapped it (docs/judge.md)
                    cand.kill()
                    self._slot_locks[slot].release()
        except (WorkerTimeout, WorkerDied, failures.InfraFailure) as exc:
            verdict = failures.classify(exc, cand)
            result.status = (Status.infra_error if verdict.infra else
                             Status.timeout if isinstance(exc, WorkerTimeout) else Status.runtime_error)
            result.error_type, result.error_message = verdict.error_type, verdict.message
            if verdict.infra:
                ref.broken = True       # the next try, or evaluation, starts a fresh reference worker
        finally:
            if first is not None:
                first.discard()
            cand.kill()             # where it did not reach the slot, at once (it may be hung there)
            contained(result, cand, "after its evaluation")
            result.stdout = cand.output("stdout")
            # the harness's notes from its checks (retimes, skipped checks) after the candidate's own stderr
            result.stderr = cand.output("stderr") + result.stderr
            cand.cleanup()

    def _load_candidate(self, spec: TaskSpec, source: str, result: EvalResult, cand: WorkerProcess) -> bool:
        cfg = self.config
        fraction = None
        if self.device == "cuda" and cfg.memory_limit_mb:
            total = torch.cuda.get_device_properties(0).total_memory
            fraction = min(1.0, (cfg.memory_limit_mb << 20) / total)
        reply = cand.ask({"role": "candidate", "device": self.device, "out_dir": str(cand.out_dir),
                          "task": spec.__dict__, "source": source, "init_seed": self.init_seed,
                          "memory_fraction": fraction, "profile": cfg.profile, "backend": cfg.backend,
                          "handoff": self.handoff,
                          "numerics": cfg.numerics.model_dump(mode="json")},
                         cfg.build_timeout_s + cfg.run_timeout_s)
        if not reply.get("ok"):
            stage = reply.get("stage")
            result.status = Status.compile_error if stage == "build" else Status.load_error
            result.error_type = reply.get("error_type")
            result.error_message = reply.get("error_message")
            result.traceback = reply.get("traceback")
            if stage == "build":
                # a compile on first use (the backend's warm-up) failed: the build's verdict, at its line
                builds = reply.get("builds") or []
                log = "\n".join(b.get("log", "") for b in builds if b.get("log")) + "\n" + (result.error_message or "")
                info = result.build or BuildInfo(ok=False)
                info.ok, info.log = False, log[-20_000:]
                info.first_error, info.first_error_line = self.backend.first_error(log, source, [])
                result.build = info
                result.error_message = (info.first_error or result.error_message or "")[:2000]
            return False
        if reply.get("threads_started"):
            result.add_flag(FlagKind.suspicious, f"started {reply['threads_started']} thread(s) while constructing ModelNew")
        return True


def contained(result: EvalResult, worker: WorkerProcess, when: str) -> None:
    """What the worker's keeper killed besides the worker (the candidate's strays), on the result."""
    result.containment = worker.containment or result.containment
    result.add_strays(worker.strays, when)
    if worker.keeper_lost and "candidate_code" in worker.events:
        result.add_flag(FlagKind.suspicious, f"the process keeper of its {worker.role} worker was killed: "
                        "processes it started may have escaped")


def evaluate(spec: TaskSpec, source: str, device: str = "cpu", config: Optional[EvalConfig] = None,
             arch: Optional[str] = None) -> EvalResult:
    """Evaluate one candidate with a sandbox of its own (see ``Sandbox`` to evaluate many)."""
    with Sandbox(device, config, arch=arch, warm_workers=0) as sandbox:
        return sandbox.evaluate(spec, source)
