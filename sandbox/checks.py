"""The checks of a loaded candidate, with its device held: trials against the trusted
reference, timing of reference and candidate by the same code, a check of every timed run
(``sandbox.runcheck``) and full spot checks of two, proof of a quiet device (``sandbox.quiet``),
the parent's clock cross-check, and the evidence (profiles, roofline floor)."""
from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any, Callable, ContextManager, Optional

from sandbox import failures
from sandbox.backends import backend_for
from sandbox.blocks import block_burst, block_plan
from sandbox.clock_check import Spent, clock_check
from sandbox.compare import fp64_verdict
from sandbox.phases import Stages
from sandbox.process import WorkerProcess, worker_pids
from sandbox.quiet import GpuWatch, IdleWatch, TimingHistory, timing_window
from sandbox.reference import Precomputed, ReferenceWorker
from sandbox.result import EvalConfig, EvalResult, FlagKind, KernelStat, OutputCheck, Status, Timing, Trial
from sandbox.steady import SteadyWindows

# cpu's interleaved blocks: warm-up runs before every block after the first (the first has the config's)
BLOCK_WARMUP = 1


def block_timing(blocks: list[Timing]) -> Timing:
    """One side's blocks as one ``Timing``: median, IQR, mean and extremes over all their runs, in
    run order (``samples_ms``), ``blocks`` their count; ``page_faults`` the median of the blocks'
    medians; ``host_load`` the last block's."""
    import statistics

    from sandbox.timing import summarize

    t = summarize([x for blk in blocks for x in blk.samples_ms], blocks[0].clock)
    faults = [blk.page_faults for blk in blocks if blk.page_faults is not None]
    return t.model_copy(update={"blocks": len(blocks), "host_load": blocks[-1].host_load,
                                "page_faults": float(statistics.median(faults)) if len(faults) == len(blocks) else None})


class CandidateChecks(SteadyWindows):
    """Runs the cascade's trials, timing and evidence stages for one sandbox's config and device."""

    def __init__(self, config: EvalConfig, device: str, gpu: Optional[str] = None,
                 history: Optional[TimingHistory] = None, inputs_copy_on_host: bool = False,
                 blocks: int = 1, quiet: Callable[[], ContextManager[Any]] = contextlib.nullcontext):
        """``gpu``: the slot's GPU (a CUDA_VISIBLE_DEVICES entry, watched through NVML);
        ``quiet``: held around a second timing of the reference (``_one_window``, ``_steady``) or of the
        candidate (``_candidate_window``; ``sandbox.steady``): on cuda
        the sandbox's builds stopped (``sandbox.pool.BuildPause``), whose compilers beside the
        timed runs' host thread are what made windows unsteady;
        ``history``: the sandbox's running medians of reference timings (``sandbox.quiet``);
        ``inputs_copy_on_host``: the candidate keeps its trials' input copies (the mutation
        check's) in host memory (``MemoryGate.plan``); ``blocks`` (``cpu`` only, else 1): the
        timed runs in that many interleaved blocks per side (``_time_in_blocks``)."""
        self.config, self.device, self.gpu, self.history = config, device, gpu, history
        self.quiet = quiet
        self.inputs_copy_on_host = inputs_copy_on_host
        self.blocks = max(1, min(int(blocks), config.timed_runs)) if device == "cpu" else 1

    def run(self, result: EvalResult, ref: ReferenceWorker, cand: WorkerProcess, stages: Stages,
            first: Optional[Precomputed] = None, gate: Any = None, slot: Any = None) -> None:
        """Trials (stop at the first failure), then timing, spot checks and evidence; the
        verdict and figures go into ``result``. ``first``: trial 0's reference outputs computed
        ahead for this candidate's secret seed; ``gate``: held for timing (``sandbox.pool``);
        ``slot``: the slot's lock (held by the caller), let go while the gate waits."""
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
            if index == 0 and first is not None and first.fp64 == bool(cfg.numerics.fp64_check):
                # the seed drawn for this candidate when its reference outputs were computed ahead
                first.wait()
                ref_ask = first.request(ref_ask)
                ask = {**ask, "seed": ref_ask["seed"]}
            if index == 1:
                # The candidate's inputs are refilled in place with the values of `refill_seed`
                # before the checked run (see the worker); the reference computes those values.
                refill = secrets.randbits(31)
                ask = {**ask, "refill_seed": refill}
                ref_ask = {**ref_ask, "seed": refill}
            if self.inputs_copy_on_host:
                ask = {**ask, "inputs_copy": "host"}
            if candidate_first:
                c = cand.ask(ask, cfg.run_timeout_s)
                r = ref.ask(ref_ask)
            else:
                r = ref.ask(ref_ask)
                c = cand.ask(ask, cfg.run_timeout_s)
            output_bytes = r.get("output_bytes", 0)
            if not c.get("ok"):
                _raise_if_infra(c, cand)    # the harness's failure: no trial of the candidate's to record
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
            passed, reason, checks = self._compare(ref, index, c.get("outputs") or {}, cand, result)
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
            result.add_flag(FlagKind.no_custom_kernel, backend_for(cfg.backend, self.device).no_call_reason)
        result.status = Status.correct

        # ---- timing (same routine, same policy, device held exclusively): the candidate first,
        # sampling every timed output (sandbox.runcheck), then the reference on the same inputs,
        # checking those samples, while the candidate's worker is idle and its strays are gone
        stages.enter("gate_wait")
        timing_seed = secrets.randbits(30)
        timed = {"op": "time", "seed": timing_seed, "warmup": cfg.warmup_runs, "runs": cfg.timed_runs,
                 "flush_l2": cfg.flush_l2}
        # Spot checks: the outputs of the last timed run and of one secret other run are
        # compared in full with the reference's.
        check_runs = sorted({cfg.timed_runs - 1, secrets.randbelow(cfg.timed_runs)})
        if self.blocks > 1:
            # cpu: the timed runs in short blocks, the candidate's and the reference's interleaved
            # and alternating which goes first (``_time_in_blocks``); cuda keeps the sequence below
            got = self._time_in_blocks(result, ref, cand, stages, gate, slot, timed, check_runs)
            if got is None:
                return
            ct, outs, eager, busy, ref_spent, cand_spent = got
        else:
            with timing_window(gate, self.gpu, self.device, slot) as gpu:
                stages.enter("timing")
                result.add_strays(cand.sweep(), "before its timed runs")
                self._foreign(gpu, result, "before the timed runs", None)
                cand_spent, ref_spent = self._spent(cand.worker_pid), self._spent(ref.proc.worker_pid if ref.proc is not None else None)
                ask = {**timed, "check_runs": check_runs, "sample": True}
                with cand_spent.during():
                    ct = cand.ask(ask, cfg.run_timeout_s)
                if ct.get("ok"):
                    ct, cand_spent = self._candidate_window(cand, ask, ct, cand_spent, result)
                if not ct.get("ok"):
                    _timing_failed(result, ct, cand)
                    return
                result.candidate_time = Timing(**ct["timing"])
                outs = cand.ask({"op": "timed_outputs"}, cfg.run_timeout_s)
                if not outs.get("ok"):
                    _raise_if_infra(outs, cand)
                result.add_strays(cand.sweep(), "during its timed runs")
                self._foreign(gpu, result, "while the candidate was timed", cand.worker_pid)
                idle = IdleWatch(cand.worker_pid)
                with ref_spent.during():
                    eager = ref.ask({**timed, "samples_path": outs.get("samples_path"), "config": cfg.model_dump(mode="json")}
                                    if outs.get("samples_path") else timed)
                result.eager_time = Timing(**eager["timing"])
                self._steady(ref, timed, result, retimed=self._one_window(ref, timed, result, compiled=False))
                if cfg.time_compile:
                    try:
                        # its output checked too, by the float64 rule where this evaluation runs the float64 check
                        comp = ref.ask({**timed, "compiled": True, "check_compiled": True,
                                        "fp64": bool(cfg.numerics.fp64_check)})
                        result.compile_time = Timing(**comp["timing"])
                        _compile_check(result, comp)
                        self._steady(ref, timed, result, compiled=True,
                                     retimed=self._one_window(ref, timed, result, compiled=True))
                    except RuntimeError as exc:
                        result.stderr += f"\n[kernelloop] torch.compile of the reference failed: {exc}"
                busy = idle.busy()
                busy_gpu = self._foreign(gpu, result, "while the reference was timed",
                                         ref.proc.worker_pid if ref.proc is not None else None)
                if cand.worker_pid in busy_gpu:
                    busy = (busy + "; " if busy else "") + "its worker used the GPU while the reference was timed"
        if busy:
            result.add_flag(FlagKind.suspicious, busy)
            # what was seen: its CPU time (``IdleWatch``), or its SM use by NVML's samples
            result.add_flag(FlagKind.contended, "the candidate's worker was not idle while the reference was timed")
        if not self._timed_runs(result, eager.get("samples"), outs.get("samples_path")):
            return
        stages.enter("spot_checks")
        saved = outs.get("saved") or {}
        if not self._spot_check(ref, cand, saved, check_runs, timing_seed, result):
            return
        if ct.get("tampered"):
            result.add_flag(FlagKind.suspicious, "changed timing functions: " + ", ".join(ct["tampered"]))
        if ct.get("threads_started"):
            result.add_flag(FlagKind.suspicious, "threads still running after the timed runs")
        clock_check(result, ref_spent, cand_spent, self.device)
        cand_ms = result.candidate_time.median_ms
        if cand_ms > 0:
            result.speedup_eager = result.eager_time.median_ms / cand_ms
            if result.compile_time:
                result.speedup_compile = result.compile_time.median_ms / cand_ms

        # ---- evidence: profiles and the roofline floor; the candidate's profile with the device held
        # as for the timing: beside background work (another candidate loading or warming up, a
        # footprint measured beside) 12 of session ad's 388 profiles summed to 1.3-2x their timed
        # forward, and the builtin's search reads its groups' times from it. (The reference's, taken
        # once per task, is not: a thread holding its lock must not wait at the gate, where a
        # candidate holding the slot the timing gives up may be waiting for that lock.)
        if cfg.profile:
            stages.enter("gate_wait")
            with timing_window(gate, self.gpu, self.device, slot):
                stages.enter("profile")
                prof = cand.ask({"op": "profile", "seed": timing_seed}, cfg.run_timeout_s)
            if prof.get("ok"):
                result.profile = [KernelStat(**row) for row in prof["profile"]]
                self._ahead_of_clock(result, prof.get("ahead") or {})
                own = [k.name for k in result.profile if k.own and not k.name.startswith("kernelloop_ext::")]
                if self.device == "cuda" and result.profile and not own:
                    result.add_flag(FlagKind.no_custom_kernel, "the profiler shows no kernel declared in the candidate's source")
                elif self.device == "cuda" and own:
                    self._graph_replay(result, own)
            with ref.lock:
                if ref.profile is None:
                    ref.profile = ref.ask({"op": "profile", "seed": timing_seed})["profile"]
            result.reference_profile = [KernelStat(**row) for row in ref.profile]
        stages.enter("floor")
        self._floor(ref, result)

    def _spent(self, pid: Optional[int]) -> Spent:
        """The parent's clock over a worker's timed asks, and on ``cpu`` the worker's CPU time too
        (``sandbox.clock_check``; on ``cuda`` it says nothing of the device's work, and reading it
        walks the process table)."""
        return Spent(pid if self.device == "cpu" else None)

    def _time_in_blocks(self, result: EvalResult, ref: ReferenceWorker, cand: WorkerProcess, stages: Stages,
                        gate: Any, slot: Any, timed: dict[str, Any], check_runs: list[int]) -> Optional[tuple]:
        """The ``cpu`` timing: the timed runs split into ``self.blocks`` short blocks per side,
        the candidate's and the reference's interleaved, the order alternating block by block
        (ABBA: candidate, eager[, compile]; then [compile,] eager, candidate; ...), so the host's
        drift between blocks (on 2 shared cores the same model's blocks moved 0.30-0.62 ms within
        seconds) falls on both sides alike. Each side's figure is the median over all its runs
        (``block_timing``). Block ``b`` times the runs ``off..off+n-1`` of the evaluation: inputs from
        the seeds ``timing_seed + i`` as in one block, so the spot checks and the run check keep
        their run numbers; its warm-up inputs come from seeds no timed run uses.

        Every check of the one-block sequence is kept per block: the candidate samples every timed
        output, its kept spot-check outputs and samples are handed over after each of its blocks,
        its strays swept then; where the candidate's block came first the reference checks its
        samples while timing its own block (as before), where the reference's came first it runs
        those runs' inputs again, untimed, after the candidate's block (``check_samples``); the
        candidate's worker is watched while every reference block is timed (eager and compiled).

        Returns ``(ct, outs, eager, busy, ref_spent, cand_spent)`` as the one-block sequence leaves
        them, or None where the candidate failed (the result says how)."""
        cfg = self.config
        seed, warm = int(timed["seed"]), cfg.warmup_runs
        plan = block_plan(cfg.timed_runs, self.blocks)
        conf = cfg.model_dump(mode="json")
        times: dict[str, list[Timing]] = {"candidate": [], "eager": [], "compile": []}
        saved: dict[str, Any] = {}
        checked, failed, tampered, threads, busy_parts = 0, [], [], 0, []
        cand_spent, ref_spent = self._spent(cand.worker_pid), self._spent(ref.proc.worker_pid if ref.proc is not None else None)
        time_compile = cfg.time_compile

        def verdict(samples: Optional[dict], off: int, path: Optional[str]) -> None:
            nonlocal checked
            if samples is None:
                failed.append([off, "its timed outputs were not sampled" if path is None else "its samples were not checked"])
                return
            checked += int(samples.get("checked") or 0)
            failed.extend([off + int(i), why] for i, why in samples.get("failed") or [])

        with timing_window(gate, self.gpu, self.device, slot):
            stages.enter("timing")
            result.add_strays(cand.sweep(), "before its timed runs")
            for b, (off, n) in enumerate(plan):
                ask = {**timed, "seed": seed + off, "runs": n, "warmup": warm if b == 0 else min(warm, BLOCK_WARMUP),
                       "warmup_seed": seed + cfg.timed_runs + b * warm}
                order = ["candidate", "eager"] + (["compile"] if time_compile else [])
                if b % 2:
                    order.reverse()
                samples_path: Optional[str] = None
                for side in order:
                    if side == "candidate":
                        mine = [i - off for i in check_runs if off <= i < off + n]
                        with cand_spent.during():
                            c = cand.ask({**ask, "check_runs": mine, "sample": True}, cfg.run_timeout_s)
                        if not c.get("ok"):
                            _timing_failed(result, c, cand)
                            return None
                        times["candidate"].append(Timing(**c["timing"]))
                        tampered += [t for t in c.get("tampered") or [] if t not in tampered]
                        threads += int(c.get("threads_started") or 0)
                        outs = cand.ask({"op": "timed_outputs", "first": off}, cfg.run_timeout_s)
                        if not outs.get("ok"):
                            _raise_if_infra(outs, cand)
                        saved.update(outs.get("saved") or {})       # by the evaluation's run numbers
                        result.add_strays(cand.sweep(), "during its timed runs")
                        samples_path = outs.get("samples_path")
                        if times["eager"] and len(times["eager"]) == b + 1:
                            # the reference's block came first: its runs again, untimed, check the samples
                            verdict(ref.ask({"op": "check_samples", "seed": seed + off, "runs": n,
                                             "samples_path": samples_path, "config": conf})["samples"]
                                    if samples_path else None, off, samples_path)
                        continue
                    idle = IdleWatch(cand.worker_pid)
                    if side == "eager":
                        check = samples_path is not None or len(times["candidate"]) == b + 1
                        with ref_spent.during():
                            e = ref.ask({**ask, "samples_path": samples_path, "config": conf} if samples_path else ask)
                        times["eager"].append(Timing(**e["timing"]))
                        if check:       # the candidate's block came first: checked while timed
                            verdict(e.get("samples") if samples_path else None, off, samples_path)
                    else:
                        try:
                            comp = ref.ask({**ask, "compiled": True, "check_compiled": b == 0,
                                            "fp64": bool(cfg.numerics.fp64_check)})
                            times["compile"].append(Timing(**comp["timing"]))
                            _compile_check(result, comp)
                        except RuntimeError as exc:
                            result.stderr += f"\n[kernelloop] torch.compile of the reference failed: {exc}"
                            time_compile, times["compile"] = False, []
                    why = idle.busy()
                    if why:
                        busy_parts.append(f"block {b + 1} of {len(plan)} ({side}): {why}")
        burst = block_burst(times["candidate"], times["eager"])
        if burst:
            result.add_flag(FlagKind.contended, burst)
        result.candidate_time = block_timing(times["candidate"])
        result.eager_time = block_timing(times["eager"])
        if time_compile and len(times["compile"]) == len(plan):
            result.compile_time = block_timing(times["compile"])
        ct = {"tampered": tampered, "threads_started": threads}
        outs = {"saved": saved, "samples_path": "blocks"}
        eager = {"samples": {"checked": checked, "failed": sorted(failed)}}
        return ct, outs, eager, "; ".join(busy_parts) or None, ref_spent, cand_spent

    def _ahead_of_clock(self, result: EvalResult, ahead: dict[str, Any]) -> None:
        """The profile ran the clock's preamble before each forward (sandbox.profiling): work of the
        forward that started before the preamble ended ran before the clock's start event."""
        if self.device != "cuda":
            return
        if ahead.get("tampered"):
            result.add_flag(FlagKind.suspicious, "changed timing functions before its profile: " + ", ".join(ahead["tampered"]))
        if not ahead.get("runs_checked"):
            result.stderr += "\n[kernelloop] the profile did not show the clock's preamble: work ahead of the clock was not checked"
            return
        if ahead.get("work"):
            w = ahead["work"][0]
            result.add_flag(FlagKind.suspicious,
                            f"its forward's work started before the clock's start event (a side stream that does not wait "
                            f"for the caller's stream): {w['name'][:80]} on stream {w['stream']}, {w['early_us']:.0f} us early"
                            + (f", and {len(ahead['work']) - 1} more" if len(ahead["work"]) > 1 else ""))

    def _graph_replay(self, result: EvalResult, own: list[str]) -> None:
        """A forward with no call into the candidate's extension whose profile shows kernels its
        source declares ran them from a CUDA graph it captured (its functions were called while it
        captured): its own kernels did run, so the no-call flag goes, and the result says why. A graph
        of someone else's work (a captured reference) shows none of them and keeps the flag."""
        reason = backend_for(self.config.backend, self.device).no_call_reason
        if not any(f.kind == FlagKind.no_custom_kernel and f.reason == reason for f in result.flags):
            return
        result.flags = [f for f in result.flags if not (f.kind == FlagKind.no_custom_kernel and f.reason == reason)]
        result.stderr += (f"\n[kernelloop] no call into its extension during a forward, but the profiler shows its own "
                          f"kernels ran (a CUDA graph replaying them): {', '.join(own[:3])}")

    def _timed_runs(self, result: EvalResult, samples: Optional[dict], path: Optional[str]) -> bool:
        """The verdict of the samples of every timed run (sandbox.runcheck): False where one failed."""
        if samples is None:
            failed = [[0, "its timed outputs were not sampled" if path is None else "its samples were not checked"]]
        else:
            result.timed_runs_checked = int(samples.get("checked") or 0)
            failed = samples.get("failed") or []
        if not failed:
            return True
        i, why = failed[0]
        more = f" ({len(failed)} of {self.config.timed_runs} timed runs failed)" if len(failed) > 1 else ""
        result.trials.append(Trial(index=len(result.trials), candidate_first=False, passed=False,
                                   reason=f"timed run {i}: {why}{more}"))
        result.status = Status.incorrect
        result.error_message = f"timed run {i} returned a wrong output: {why}{more}"
        result.speedup_eager = result.speedup_compile = None
        return False

    @staticmethod
    def _foreign(gpu: Optional[GpuWatch], result: EvalResult, when: str, timed: Optional[int]) -> set[int]:
        """Other processes on the slot's GPU (NVML) than the worker being ``timed`` make the timing
        ``contended``; the pids found."""
        if gpu is None:
            return set()
        if gpu.note:
            if gpu.note not in result.stderr:
                result.stderr += f"\n[kernelloop] {gpu.note}"
            return set()
        found = gpu.foreign(os.getpid(), [timed], worker_pids())
        if gpu.unread and gpu.unread not in result.stderr:
            result.stderr += f"\n[kernelloop] {gpu.unread}"
        if found:
            result.add_flag(FlagKind.contended, f"the GPU was not quiet {when}: " + "; ".join(t for _, t in found[:4]))
        return {pid for pid, _ in found}

    def _compare(self, ref: ReferenceWorker, index: int, outputs: dict[str, Any], cand: WorkerProcess,
                 result: EvalResult) -> tuple[bool, Optional[str], list[OutputCheck]]:
        """The candidate's outputs (``sandbox.handoff``'s descriptor) against the reference's kept
        ones, compared by the trusted reference worker on its device (``sandbox.compare``'s
        policy, this config). Shared outputs the reference could not map are sent again as a file."""
        ask = {"op": "compare", "index": index, "config": self.config.model_dump(mode="json")}
        reply = ref.ask({**ask, "outputs": outputs})
        if reply.get("ok") and reply.get("unmapped"):
            note = f"\n[kernelloop] outputs sent as a file: {reply['unmapped']}"
            if note not in result.stderr:
                result.stderr += note
            again = cand.ask({"op": "resend", "name": outputs.get("name")}, self.config.run_timeout_s)
            if not again.get("ok"):
                _raise_if_infra(again, cand)
                return False, f"the candidate's outputs could not be sent again: {again.get('error_message')}", []
            reply = ref.ask({**ask, "outputs": again["outputs"]})
        if not reply.get("ok") or reply.get("unmapped"):
            raise failures.InfraFailure(f"the reference worker could not compare outputs: {reply.get('error_message')}")
        return bool(reply["passed"]), reply.get("reason"), [OutputCheck(**c) for c in reply.get("checks", [])]

    def _spot_check(self, ref: ReferenceWorker, cand: WorkerProcess, saved: dict[str, dict[str, Any]], check_runs: list[int],
                    timing_seed: int, result: EvalResult) -> bool:
        for i in check_runs:
            trial = Trial(index=len(result.trials), candidate_first=False, passed=False)
            outputs = saved.get(str(i))
            if outputs is None:
                trial.reason = f"the output of timed run {i} was not a plain tensor"
            else:
                ref.ask({"op": "trial", "seed": timing_seed + i, "index": 1000 + i})
                passed, reason, checks = self._compare(ref, 1000 + i, outputs, cand, result)
                trial.passed, trial.outputs = passed, checks
                trial.reason = None if passed else f"timed run {i}: {reason}"
            result.trials.append(trial)
            if not trial.passed:
                result.status = Status.incorrect
                result.speedup_eager = result.speedup_compile = None
                return False
        return True

    def _floor(self, ref: ReferenceWorker, result: EvalResult) -> None:
        try:
            from hardware.counts import RooflineCounts
            from hardware.floors import floor_breakdown
            from hardware.probe import get_probe
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
        # One floor (hardware.floors): the fastest arithmetic the run's numerics allow a candidate
        # (one TF32 pass for the op classes the math mode runs in TF32, 3xTF32 for other fp32
        # FLOPs, bytes at the probed bandwidth, ceilings raised by their measurement slack). No
        # legitimate kernel crosses it, so its fraction is at most 100% and crossing it is `impossible`.
        fb = floor_breakdown(counts, probe, self.config.numerics.tf32_classes(self.device))
        floor = fb["floor_ms"]
        if not floor:
            return
        result.floor_ms = floor
        result.floor_basis = fb["arithmetic"]
        result.floor_fraction = floor / result.candidate_time.median_ms
        if result.candidate_time.median_ms < floor:
            result.add_flag(FlagKind.impossible,
                            f"median {result.candidate_time.median_ms:.4f} ms is below the roofline floor {floor:.4f} ms "
                            f"({fb['arithmetic']})")


def _raise_if_infra(reply: dict, cand: Any = None) -> None:
    """A failed reply of the candidate worker that is the harness's doing ends the run as infra:
    a harness step's (``failures.candidate_reply``), or the candidate's own code out of device
    memory it was admitted for but could not have (``failures.candidate_oom``)."""
    verdict = (failures.candidate_reply(reply)
               or failures.candidate_oom(reply, getattr(cand, "device_share", 0)))
    if verdict is not None and verdict.infra:
        raise failures.InfraFailure(verdict.message, verdict.error_type)


def _compile_check(result: EvalResult, reply: dict[str, Any]) -> None:
    """torch.compile's output checked by the reference's worker (``check_compiled``), onto the result."""
    check = reply.get("compile_check") or {}
    if "within" in check:
        result.compile_within_tolerance = bool(check["within"])
        result.compile_max_abs_error = check.get("max_abs")
        result.compile_fp64_note = check.get("fp64_note")
    elif check.get("error"):
        result.stderr += f"\n[kernelloop] torch.compile's output could not be checked: {check['error']}"


def _timing_failed(result: EvalResult, reply: dict, cand: Any) -> None:
    """The candidate's timed runs failed: the harness's failure raises (``_raise_if_infra``), the
    candidate's own is a ``runtime_error`` result that says so."""
    _raise_if_infra(reply, cand)
    result.status = Status.runtime_error
    result.error_type = reply.get("error_type")
    result.error_message = f"while timing: {reply.get('error_message')}"
    result.traceback = reply.get("traceback")
