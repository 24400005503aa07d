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
5. timing of reference eager, reference torch.compile and candidate by the same code,
   with the device held exclusively, and a parent-side clock cross-check;
6. profiler evidence and the roofline floor.

A crash, hang, CUDA error or cheat ends in a status or a flag for this candidate only.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import threading
import time
from typing import Any, Optional

import torch

from sandbox import anticheat
from sandbox.build import cuda_arch_list, first_compiler_error
from sandbox.compare import fp64_verdict
from sandbox.harness import cpu_model
from sandbox.numerics import Numerics
from sandbox.process import WorkerDied, WorkerProcess, WorkerTimeout, kill_all_workers
from sandbox.result import (BuildCheck, BuildInfo, EvalConfig, EvalResult, FlagKind, KernelStat, OutputCheck,
                             Status, Timing, Trial)
from sandbox.tasks import TaskSpec

REFERENCE_TIMEOUT_S = 900.0
# A candidate whose reported time leaves this much of the parent's wall clock unexplained is flagged.
CLOCK_SLACK_S = 0.25
CLOCK_FACTOR = 3.0


class _Stages:
    """Consecutive stages of one evaluation, their seconds added to ``result.phases`` (where
    an evaluation's time goes): ``enter`` ends the stage before it, ``enter(None)`` the last."""

    def __init__(self, result: EvalResult):
        self.result, self.name, self.t0 = result, None, time.monotonic()

    def enter(self, name: Optional[str]) -> None:
        now = time.monotonic()
        if self.name:
            self.result.phases[self.name] = round(self.result.phases.get(self.name, 0.0) + now - self.t0, 3)
        self.name, self.t0 = name, now


@contextlib.contextmanager
def _phase(result: EvalResult, name: str):
    """One stage, as a block."""
    stages = _Stages(result)
    stages.enter(name)
    try:
        yield
    finally:
        stages.enter(None)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible"
    return cpu_model()


class ReferenceWorker:
    """The trusted side of an evaluation: one persistent worker per task (and sizes)."""

    def __init__(self, spec: TaskSpec, device: str, init_seed: int, warm_compile: bool = False,
                 env: Optional[dict[str, str]] = None, numerics: Optional[Numerics] = None):
        self.spec, self.device, self.init_seed = spec, device, init_seed
        self.numerics = numerics or Numerics()
        self.warm_compile = warm_compile
        self.env = env or {}
        self.lock = threading.Lock()
        self.proc: Optional[WorkerProcess] = None
        self.profile: Optional[list[dict]] = None
        self.counts: Optional[dict] = None
        self.device_name = ""

    def ensure(self) -> WorkerProcess:
        if self.proc is not None and self.proc.proc.poll() is None:
            return self.proc
        self.proc = WorkerProcess("reference", env=self.env)
        reply = self.proc.ask({"role": "reference", "device": self.device, "out_dir": str(self.proc.out_dir),
                               "task": self.spec.__dict__, "init_seed": self.init_seed,
                               "warm_compile": self.warm_compile,
                               "numerics": self.numerics.model_dump(mode="json")}, REFERENCE_TIMEOUT_S)
        if not reply.get("ok"):
            msg = reply.get("error_message", "unknown error")
            self.proc.kill()
            self.proc = None
            raise RuntimeError(f"the reference of {self.spec.name} failed to load: {msg}")
        self.device_name = reply.get("device_name", "")
        return self.proc

    def ask(self, payload: dict[str, Any], timeout: float = REFERENCE_TIMEOUT_S) -> dict[str, Any]:
        reply = self.ensure().ask(payload, timeout)
        if not reply.get("ok"):
            raise RuntimeError(f"the reference of {self.spec.name} failed: {reply.get('error_message')}")
        return reply

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc.cleanup()
            self.proc = None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroup cpusets), not the host's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries for its workers."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [g.strip() for g in listed.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


class Sandbox:
    """Evaluates candidates for one device kind. Thread-safe: builds run in parallel on the CPU
    cores (up to ``build_slots``); each GPU (or the CPU) is a slot that one candidate holds
    exclusively for its trials and timing, so timings are not disturbed. Workers see only their
    slot's GPU; each slot has its own reference workers."""

    def __init__(self, device: str, config: Optional[EvalConfig] = None, build_slots: Optional[int] = None,
                 init_seed: Optional[int] = None, gpus: Optional[list[str]] = None,
                 arch: Optional[str] = None):
        self.device = device
        # Resolved here, where the GPUs are visible, and handed to every worker (build workers
        # run with the GPU hidden); one list for all slots, so every build is a cache hit for all.
        self.arch = (arch or cuda_arch_list()) if device == "cuda" else None
        if device == "cuda" and not self.arch:
            raise ValueError("no CUDA GPU is visible and neither KERNELLOOP_CUDA_ARCH nor TORCH_CUDA_ARCH_LIST is "
                             "set: name the architecture to build CUDA candidates for (e.g. --arch 9.0a)")
        self.config = config or EvalConfig()
        cores = usable_cores()
        self.build_jobs = max(2, min(8, cores // max(1, build_slots or 1)))
        self._build_sem = threading.Semaphore(build_slots or max(1, cores // 4))
        self.slots: list[Optional[str]] = (gpus or visible_gpus() or [None]) if device == "cuda" else [None]
        self._slot_locks = [threading.Lock() for _ in self.slots]
        self._slot_load = [0 for _ in self.slots]
        self._slot_pick = threading.Lock()
        self._refs: dict[tuple[str, int], ReferenceWorker] = {}
        self._refs_lock = threading.Lock()
        self._aborted = threading.Event()
        # KernelBench's convention: one seed before both constructors; secret inputs seeds per trial.
        self.init_seed = init_seed if init_seed is not None else secrets.randbits(31)
        self.device_name = _device_name(device)
        self.torch_version = torch.__version__

    # ---------------------------------------------------------------- helpers
    def _slot_env(self, slot: int) -> dict[str, str]:
        gpu = self.slots[slot]
        return {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}

    def _build_env(self) -> dict[str, str]:
        env = {"KERNELLOOP_BUILD_JOBS": str(self.build_jobs)}
        if self.arch:
            env["KERNELLOOP_CUDA_ARCH"] = self.arch
        return env

    def reference(self, spec: TaskSpec, slot: int = 0) -> ReferenceWorker:
        with self._refs_lock:
            ref = self._refs.get((spec.key, slot))
            if ref is None:
                ref = self._refs[(spec.key, slot)] = ReferenceWorker(
                    spec, self.device, self.init_seed, warm_compile=self.config.time_compile,
                    env=self._slot_env(slot), numerics=self.config.numerics)
            return ref

    def _pick_slot(self, spec: Optional[TaskSpec] = None) -> int:
        """The least-loaded slot; among equals, one where the task's reference already runs
        (each slot starts its own reference worker, torch.compile included)."""
        with self._slot_pick:
            key = spec.key if spec is not None else None
            slot = min(range(len(self.slots)),
                       key=lambda i: (self._slot_load[i], (key, i) not in self._refs))
            self._slot_load[slot] += 1
            return slot

    def _release_slot(self, slot: int) -> None:
        with self._slot_pick:
            self._slot_load[slot] -= 1

    def release(self, spec: TaskSpec) -> None:
        """Stop the task's reference workers (on every slot): a finished task's workers would
        otherwise keep their GPU memory and host memory for the rest of a long run."""
        with self._refs_lock:
            refs = [self._refs.pop(k) for k in [k for k in self._refs if k[0] == spec.key]]
        for ref in refs:
            with ref.lock:
                ref.close()

    def abort(self) -> None:
        """Kill every worker now (an interrupted run): evaluations in flight end at once with
        an error status, which the caller must not store as a verdict, and no evaluation starts
        another worker afterwards (one waiting for a build slot would otherwise build for a minute)."""
        self._aborted.set()
        kill_all_workers()

    def _check_aborted(self) -> None:
        if self._aborted.is_set():
            raise WorkerDied("the sandbox was stopped (the run was interrupted)", None)

    def close(self) -> None:
        if self._aborted.is_set():
            kill_all_workers()          # whatever started in the moment before the abort
        with self._refs_lock:
            for ref in self._refs.values():
                ref.close()
            self._refs.clear()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self, spec: TaskSpec, source: str, result: EvalResult) -> bool:
        cfg = self.config
        t0 = time.monotonic()
        worker = WorkerProcess("build", hide_gpu=True, env=self._build_env())
        try:
            reply = worker.ask({"role": "build", "device": self.device, "out_dir": str(worker.out_dir),
                                "task": spec.__dict__, "source": source, "init_seed": 0}, cfg.build_timeout_s)
        except WorkerTimeout:
            result.status = Status.timeout
            result.error_type = "BuildTimeout"
            result.error_message = f"building the candidate took longer than {cfg.build_timeout_s:.0f} s"
            result.build = BuildInfo(ok=False, seconds=time.monotonic() - t0, log=worker.output("stdout")[-4000:])
            return False
        except WorkerDied as exc:
            result.status = Status.load_error
            result.error_type = "WorkerDied"
            result.error_message = f"{exc} while importing the candidate to build it"
            result.stderr = worker.output("stderr")
            return False
        finally:
            worker.kill()
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
            info.first_error, info.first_error_line = first_compiler_error(
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
        result.flags.extend(anticheat.scan(source))
        return result

    def evaluate(self, spec: TaskSpec, source: str) -> EvalResult:
        t0 = time.monotonic()
        result = self._new_result(spec, source)
        try:
            with _phase(result, "build_wait"):
                self._build_sem.acquire()
            try:
                self._check_aborted()
                built = self._build(spec, source, result)
            finally:
                self._build_sem.release()
            result.phases["build"] = result.build.seconds if result.build else 0.0
            if built:
                self._run(spec, source, result)
        except WorkerDied as exc:
            if not self._aborted.is_set():
                raise
            result.status, result.error_type, result.error_message = Status.runtime_error, "Interrupted", str(exc)
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
        try:
            self._run_on(slot, spec, source, result)
        finally:
            self._release_slot(slot)

    def _run_on(self, slot: int, spec: TaskSpec, source: str, result: EvalResult) -> None:
        cfg = self.config
        ref = self.reference(spec, slot)
        with _phase(result, "reference"), ref.lock:
            self._check_aborted()
            ref.ensure()
        result.device_name = ref.device_name or result.device_name
        self._check_aborted()
        cand = WorkerProcess("candidate", memory_limit_mb=cfg.memory_limit_mb if self.device == "cpu" else None,
                             env={**self._build_env(), **self._slot_env(slot)})
        try:
            with _phase(result, "load"):
                loaded = self._load_candidate(spec, source, result, cand)
            if loaded:
                with _phase(result, "device_wait"):
                    self._slot_locks[slot].acquire()
                stages = _Stages(result)
                try:
                    self._run_candidate(result, ref, cand, stages)
                finally:
                    stages.enter(None)
                    self._slot_locks[slot].release()
        except WorkerTimeout as exc:
            result.status = Status.timeout
            result.error_type = "Timeout"
            result.error_message = str(exc)
        except WorkerDied as exc:
            result.status = Status.runtime_error
            result.error_type = "WorkerDied"
            result.error_message = str(exc)
        finally:
            cand.kill()
            result.stdout = cand.output("stdout")
            result.stderr = cand.output("stderr")
            cand.cleanup()

    def _load_candidate(self, spec: TaskSpec, source: str, result: EvalResult, cand: WorkerProcess) -> bool:
        cfg = self.config
        fraction = None
        if self.device == "cuda" and cfg.memory_limit_mb:
            total = torch.cuda.get_device_properties(0).total_memory
            fraction = min(1.0, (cfg.memory_limit_mb << 20) / total)
        reply = cand.ask({"role": "candidate", "device": self.device, "out_dir": str(cand.out_dir),
                          "task": spec.__dict__, "source": source, "init_seed": self.init_seed,
                          "memory_fraction": fraction, "profile": cfg.profile,
                          "numerics": cfg.numerics.model_dump(mode="json")},
                         cfg.build_timeout_s + cfg.run_timeout_s)
        if not reply.get("ok"):
            stage = reply.get("stage")
            result.status = Status.compile_error if stage == "build" else Status.load_error
            result.error_type = reply.get("error_type")
            result.error_message = reply.get("error_message")
            result.traceback = reply.get("traceback")
            return False
        if reply.get("threads_started"):
            result.add_flag(FlagKind.suspicious, f"started {reply['threads_started']} thread(s) while constructing ModelNew")
        return True

    def _run_candidate(self, result: EvalResult, ref: ReferenceWorker, cand: WorkerProcess,
                       stages: _Stages) -> None:
        cfg = self.config
        # ---- trials
        stages.enter("trials")
        calls: list[int] = []
        output_bytes = 0
        for index in range(cfg.trials):
            seed = secrets.randbits(31)
            candidate_first = index == 0
            ask = {"op": "trial", "seed": seed, "index": index, "output_bytes": output_bytes}
            ref_ask = {**ask, "fp64": True} if index == 0 and cfg.numerics.fp64_check else ask
            if index == 1:
                # The candidate's inputs are refilled in place with the values of `refill_seed`
                # before the checked run (see the worker); the reference computes those values.
                refill = secrets.randbits(31)
                ask = {**ask, "refill_seed": refill}
                ref_ask = {**ref_ask, "seed": refill}
            if candidate_first:
                c = cand.ask(ask, cfg.run_timeout_s)
                r = ref.ask(ref_ask)
            else:
                r = ref.ask(ref_ask)
                c = cand.ask(ask, cfg.run_timeout_s)
            output_bytes = r.get("output_bytes", 0)
            trial = Trial(index=index, candidate_first=candidate_first, passed=False)
            result.trials.append(trial)
            if not c.get("ok"):
                trial.reason = f"{c.get('error_type')}: {c.get('error_message')}"
                result.status = Status.runtime_error
                result.error_type = c.get("error_type")
                result.error_message = c.get("error_message")
                result.traceback = c.get("traceback")
                return
            if c.get("threads_started"):
                result.add_flag(FlagKind.suspicious, f"{c['threads_started']} thread(s) still running after forward returned")
            if c.get("custom_calls") is not None:
                calls.append(int(c["custom_calls"]))
            if c.get("non_plain"):
                trial.reason = f"the output is not a plain torch.Tensor ({', '.join(c['non_plain'])})"
                result.status = Status.incorrect
                return
            if c.get("inputs_mutated"):
                trial.reason = f"the candidate changed its input(s) {c['inputs_mutated']}"
                result.add_flag(FlagKind.inputs_mutated, trial.reason)
                result.status = Status.incorrect
                return
            passed, reason, checks = self._compare(ref, index, c["path"])
            trial.outputs = checks
            trial.passed = passed
            trial.reason = reason
            if c.get("aliases_input") and passed:
                result.add_flag(FlagKind.suspicious, "returns a tensor that shares memory with an input")
            if not passed:
                result.status = Status.incorrect
                return
            if r.get("fp64_note"):
                result.stderr += f"\n[kernelloop] float64 check skipped: {r['fp64_note']}"
            for check in checks:
                why = fp64_verdict(check, cfg.numerics)
                if why:
                    result.add_flag(FlagKind.inaccurate, why)
        result.custom_calls_per_forward = (sum(calls) / len(calls)) if calls else 0.0
        if not calls or min(calls) == 0:
            result.add_flag(FlagKind.no_custom_kernel,
                            "no call into the candidate's own compiled extension during a forward")
        result.status = Status.correct

        # ---- timing (same routine, same policy, device held exclusively)
        stages.enter("timing")
        timing_seed = secrets.randbits(30)
        timed = {"op": "time", "seed": timing_seed, "warmup": cfg.warmup_runs, "runs": cfg.timed_runs,
                 "flush_l2": cfg.flush_l2}
        w0 = time.monotonic()
        eager = ref.ask(timed)
        ref_wall = time.monotonic() - w0
        result.eager_time = Timing(**eager["timing"])
        if cfg.time_compile:
            try:
                comp = ref.ask({**timed, "compiled": True})
                result.compile_time = Timing(**comp["timing"])
            except RuntimeError as exc:
                result.stderr += f"\n[kernelloop] torch.compile of the reference failed: {exc}"
        # Spot checks: the outputs of the last timed run and of one secret other run are
        # compared with the reference, so a candidate cannot cache its way through timing.
        check_runs = sorted({cfg.timed_runs - 1, secrets.randbelow(cfg.timed_runs)})
        w0 = time.monotonic()
        ct = cand.ask({**timed, "check_runs": check_runs}, cfg.run_timeout_s)
        cand_wall = time.monotonic() - w0
        if not ct.get("ok"):
            result.status = Status.runtime_error
            result.error_type = ct.get("error_type")
            result.error_message = f"while timing: {ct.get('error_message')}"
            result.traceback = ct.get("traceback")
            return
        result.candidate_time = Timing(**ct["timing"])
        stages.enter("spot_checks")
        saved = cand.ask({"op": "timed_outputs"}, cfg.run_timeout_s).get("saved") or {}
        if not self._spot_check(ref, saved, check_runs, timing_seed, result):
            return
        if ct.get("tampered"):
            result.add_flag(FlagKind.suspicious, "changed timing functions: " + ", ".join(ct["tampered"]))
        if ct.get("threads_started"):
            result.add_flag(FlagKind.suspicious, "threads still running after the timed runs")
        self._clock_check(result, ref_wall, cand_wall)
        cand_ms = result.candidate_time.median_ms
        if cand_ms > 0:
            result.speedup_eager = result.eager_time.median_ms / cand_ms
            if result.compile_time:
                result.speedup_compile = result.compile_time.median_ms / cand_ms

        # ---- evidence: profiles and the roofline floor
        stages.enter("profile")
        if cfg.profile:
            prof = cand.ask({"op": "profile", "seed": timing_seed}, cfg.run_timeout_s)
            if prof.get("ok"):
                result.profile = [KernelStat(**row) for row in prof["profile"]]
                if self.device == "cuda" and result.profile and not any(k.own for k in result.profile
                                                                        if not k.name.startswith("kernelloop_ext::")):
                    result.add_flag(FlagKind.no_custom_kernel, "the profiler shows no kernel declared in the candidate's source")
            with ref.lock:
                if ref.profile is None:
                    ref.profile = ref.ask({"op": "profile", "seed": timing_seed})["profile"]
            result.reference_profile = [KernelStat(**row) for row in ref.profile]
        stages.enter("floor")
        self._floor(ref, result)

    def _compare(self, ref: ReferenceWorker, index: int, cand_path: str) -> tuple[bool, Optional[str], list[OutputCheck]]:
        """The candidate's saved outputs against the reference's kept ones, compared by the
        trusted reference worker on its device (``sandbox.compare``'s policy, this config)."""
        reply = ref.ask({"op": "compare", "index": index, "path": cand_path, "config": self.config.model_dump(mode="json")})
        if not reply.get("ok"):
            raise WorkerDied(f"the reference worker could not compare outputs: {reply.get('error_message')}", None)
        return bool(reply["passed"]), reply.get("reason"), [OutputCheck(**c) for c in reply.get("checks", [])]

    def _spot_check(self, ref: ReferenceWorker, saved: dict[str, str], check_runs: list[int],
                    timing_seed: int, result: EvalResult) -> bool:
        for i in check_runs:
            trial = Trial(index=len(result.trials), candidate_first=False, passed=False)
            path = saved.get(str(i))
            if path is None:
                trial.reason = f"the output of timed run {i} was not a plain tensor"
            else:
                ref.ask({"op": "trial", "seed": timing_seed + i, "index": 1000 + i})
                passed, reason, checks = self._compare(ref, 1000 + i, path)
                trial.passed, trial.outputs = passed, checks
                trial.reason = None if passed else f"timed run {i}: {reason}"
            result.trials.append(trial)
            if not trial.passed:
                result.status = Status.incorrect
                result.speedup_eager = result.speedup_compile = None
                return False
        return True

    def _clock_check(self, result: EvalResult, ref_wall: float, cand_wall: float) -> None:
        """The parent's own clock must roughly agree with the times the candidate worker reports."""
        assert result.candidate_time is not None and result.eager_time is not None
        runs = result.candidate_time.runs
        ref_overhead = max(0.0, ref_wall - result.eager_time.mean_ms * runs / 1e3)
        unexplained = cand_wall - result.candidate_time.mean_ms * runs / 1e3 - ref_overhead
        reported = result.candidate_time.mean_ms * runs / 1e3
        if unexplained > CLOCK_SLACK_S and unexplained > CLOCK_FACTOR * max(reported, 1e-3):
            result.add_flag(FlagKind.suspicious,
                            f"the parent's clock saw {cand_wall * 1e3:.1f} ms for {runs} timed runs the worker "
                            f"reported as {reported * 1e3:.1f} ms in total")

    def _floor(self, ref: ReferenceWorker, result: EvalResult) -> None:
        try:
            from evals.probe import get_probe
            from evals.roofline import RooflineCounts, floor_ms
        except ImportError:
            return
        try:
            with ref.lock:
                if ref.counts is None:
                    ref.counts = ref.ask({"op": "roofline"})
            probe = get_probe(self.device, measure=False)
        except Exception:  # noqa: BLE001 - evidence is optional; the verdict stands without it
            return
        if probe is None or result.candidate_time is None:
            return
        counts = RooflineCounts(**ref.counts["counts"])
        result.floor_flops, result.floor_bytes = float(counts.flops), float(counts.min_bytes)
        # The floor shown is the run's convention's (fp32 FLOPs at the TF32 rate only for the op
        # classes its math mode runs in TF32). The `impossible` flag uses a lower bound: every
        # fp32 GEMM and convolution FLOP at the TF32 rate (7x the fp32 rate on Hopper). cuDNN's
        # FFT and Winograd algorithms do a fraction of a direct convolution's FLOPs
        # (level2/conv_hardswish_mean's strict eager run beat its direct-FLOP fp32 floor by 1.3x on
        # an H200), and split-TF32 GEMMs on tensor cores are about as accurate as fp32 SGEMM (the
        # float64 check measures that) and faster: one TF32 pass over the direct FLOPs is a bound
        # no legitimate algorithm crosses.
        floor = floor_ms(counts, probe, self.config.numerics.tf32_classes(self.device))
        hard = floor_ms(counts, probe, {"conv", "matmul"})
        if not floor:
            return
        result.floor_ms = floor
        result.floor_fraction = floor / result.candidate_time.median_ms
        if hard and result.candidate_time.median_ms < 0.9 * hard:
            result.add_flag(FlagKind.impossible,
                            f"median {result.candidate_time.median_ms:.4f} ms is below the roofline floor {hard:.4f} ms "
                            f"(every fp32 GEMM and convolution FLOP at the TF32 rate)")


def evaluate(spec: TaskSpec, source: str, device: str = "cpu", config: Optional[EvalConfig] = None,
             arch: Optional[str] = None) -> EvalResult:
    """Evaluate one candidate with a sandbox of its own (see ``Sandbox`` to evaluate many)."""
    with Sandbox(device, config, arch=arch) as sandbox:
        return sandbox.evaluate(spec, source)
