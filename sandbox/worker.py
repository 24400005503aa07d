"""The sandbox worker: one process per role, driven over a private socket.

Run as ``python -m sandbox.worker FD``. The parent (``sandbox.evaluate``) starts it with
a fresh temporary working directory, stdout/stderr sent to files, and one end of a
socket pair as FD: the only channel results travel on. Messages are JSON (no pickle);
a candidate's output tensors reach the trusted reference worker's ``compare`` request through
``sandbox.handoff`` (CUDA IPC on the device, checked before a byte is read; else a file read
with ``weights_only=True``), so nothing a candidate returns can run code outside the
candidate's own process.

Roles:
* ``build``: execute the candidate module with the hooked ``load_inline`` (GPU hidden),
  report the builds. Compilation happens here, in parallel with other candidates' runs.
* ``candidate``: load the (cached) build, construct ``ModelNew``, then serve ``trial``,
  ``time`` and ``profile`` requests.
* ``reference``: the trusted side: the task's ``Model`` (and its ``torch.compile``),
  serving the same requests. It never runs candidate code.
* ``warm``: a candidate worker started before its candidate is known (``sandbox.pool``): it
  pays Python's and torch's imports, the CUDA context and the profiler's first session, says so,
  then waits for its one ``candidate`` message. Nothing of any candidate has been in it before.
  With ``serves: build`` it is a build worker started ahead (the GPU hidden, device ``cpu``): it
  pays Python's, torch's and the build hook's imports, then waits for its one ``build`` message.

Harness modules and the functions timing relies on are bound before candidate code runs.
"""
from __future__ import annotations

import os
import secrets
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from hardware import clock
from sandbox import handoff, runcheck, timing  # noqa: F401 - runcheck binds its entropy source before candidate code
from sandbox.harness import flatten_outputs, is_plain_tensor, make_inputs, make_model
from sandbox.numerics import Numerics
from sandbox.tasks import TaskSpec, exec_source, load_task
from sandbox.warm_compile import ReferenceTurns, warm_compiled
from sandbox.worker_util import (_PREWARMED, DeviceTurns, _copies, _equal_nan, _exc_payload, _memory_held, _recv,
                                 _save_to, _send, cap_allocator, compiled_check, double_copy, run_fp64,
                                 save_outputs, warm_up)

# Reference outputs precomputed for trials to come (each a full set of outputs on the device).
MAX_PRECOMPUTED = 3
PRECOMPUTE_BUDGET = int(os.environ.get("KERNELLOOP_PRECOMPUTE_BYTES", 4 << 30))

_time_runs = timing.time_runs
_tampered = clock.tampered_functions


class Worker:
    def __init__(self, conn: Connection, init: dict[str, Any]):
        self.conn = conn
        self.role = init["role"]
        self.device = init["device"]
        self.out_dir = Path(init["out_dir"])
        self.spec = TaskSpec(**init["task"])
        self.source = init.get("source")
        self.backend = init.get("backend")      # sandbox.backends; None: the device's load_inline backend
        self.init_seed = int(init["init_seed"])
        self.builder = None
        self.model = None
        self.compiled = None
        self.kernel_names: list[str] = []
        self.warm_compile = bool(init.get("warm_compile"))
        self.device_turns = bool(init.get("device_turns"))     # WorkerProcess.ask's: the gate asked for in turns
        self.profile_wanted = bool(init.get("profile"))
        self.numerics = Numerics.model_validate(init.get("numerics") or {})
        self.step = "starting"          # the harness step running now, named in a harness error
        self.harness_bytes = 0          # what the harness's own buffers of this request take
        self.precomputed: dict[str, tuple[dict[str, Any], tuple]] = {}
        self.last_output_bytes = 0
        self.handoff = str(init.get("handoff") or "file")      # sandbox.handoff: how outputs reach compare
        self.exported = handoff.Exported()
        self.memory_cap = cap_allocator(init, self.device)
        self.compile_checked: dict[str, Any] = {}       # worker_util.compiled_check's memo

    # ---- candidate code -------------------------------------------------------
    def _exec_candidate(self) -> dict[str, Any]:
        from sandbox.backends import backend_for

        # the backend's build hook (sandbox.backends): load_inline replaced, or Triton's launches counted
        self.builder = backend_for(self.backend, self.device).hook(max_jobs=int(os.environ.get("KERNELLOOP_BUILD_JOBS", "4")))
        self.builder.install(self.source)
        # From here on the candidate's code runs: a death after this note is the candidate's
        # (sandbox.failures); it is on the socket before the first line of the candidate runs.
        _send(self.conn, {"event": "candidate_code"})
        try:
            namespace = exec_source(self.source, "candidate.py", module_name="kernelloop_candidate")
        except SystemExit as exc:
            return {"stage": "import", **_exc_payload(exc), "error_message": f"candidate called sys.exit({exc.code})"}
        except BaseException as exc:  # noqa: BLE001
            self.builder.import_failed(exc)
            failed = [r for r in self.builder.records if not r.ok]
            return {"stage": "build" if failed else "import", **_exc_payload(exc)}
        finally:
            self._builds = [r.__dict__ for r in self.builder.records]
        self.namespace = namespace
        return {}

    def build(self) -> dict[str, Any]:
        result = self._exec_candidate()
        return {"builds": self._builds, **result}

    def load_candidate(self) -> dict[str, Any]:
        result = self._exec_candidate()
        reply: dict[str, Any] = {"builds": self._builds}
        if result:
            return {**reply, **result}
        cls = self.namespace.get("ModelNew")
        if cls is None or not isinstance(cls, type):
            return {**reply, "stage": "import", "error_type": "NameError",
                    "error_message": "the candidate module defines no class ModelNew", "traceback": ""}
        reply.update(self._construct(cls))
        if reply.get("ok"):
            # what compiles on first use (Triton) compiles now, before the device is held
            failed = self.builder.warm_up(self.model, self._make_args(secrets.randbits(31)))
            if failed is not None:
                return {"builds": [r.__dict__ for r in self.builder.records], "stage": "build", **_exc_payload(failed)}
        self.kernel_names = self.builder.kernel_names()
        if reply.get("ok") and self.profile_wanted and not _PREWARMED.get(self.device):
            from sandbox.profiling import warm_up

            warm_up(self.device)        # while the parent does not hold the device
        return reply

    def load_reference(self) -> dict[str, Any]:
        self.task = load_task(self.spec, validate=False)
        # on cuda the parent's device gate is asked for in turns (sandbox.warm_compile): held while
        # the model is built and while it runs, not while torch.compile generates its code
        turns = ReferenceTurns(DeviceTurns(self.conn, self.device_turns), self.device)
        with turns.turn("the reference's model"):
            reply = self._construct(self.task.Model)
        if self.device == "cuda":
            reply["device_name"] = torch.cuda.get_device_name(0)
        if reply.get("ok") and self.warm_compile:
            try:
                self.compiled = warm_compiled(
                    self.model, lambda: make_inputs(self.task, 12345, self.device, self.numerics), self.device, turns)
            except Exception as exc:  # noqa: BLE001 - timed again (and reported) when asked for
                reply["compile_error"] = f"{type(exc).__name__}: {exc}"[:2000]
                self.compiled = None
        return reply

    def _construct(self, cls: type) -> dict[str, Any]:
        if not hasattr(self, "task"):
            self.task = load_task(self.spec, validate=False)
        threads_before = threading.active_count()
        try:
            self.model = make_model(cls, self.task, self.init_seed, self.device, self.numerics)
        except SystemExit as exc:
            return {"stage": "construct", **_exc_payload(exc), "error_message": f"sys.exit({exc.code}) in __init__"}
        except BaseException as exc:  # noqa: BLE001
            return {"stage": "construct", **_exc_payload(exc)}
        if self.device == "cuda":
            clock.device_sync("cuda")
        return {"ok": True, "threads_started": threading.active_count() - threads_before}

    # ---- requests ---------------------------------------------------------------
    def _poison(self, sizes: list[int]) -> None:
        """Fill memory the candidate might read uninitialised with NaN: one block per size the
        run is about to allocate (the inputs' copies, its outputs), freed into the caching
        allocator, which hands those blocks out again for allocations of those sizes. The poison
        thus holds no memory beyond what the run takes anyway. (It was poured in 256 MiB chunks:
        on cuda those could not serve a 6 GiB copy or output and stayed reserved beside them, 24
        GiB at level1/19_ReLU's sizes, which ran the same run's reference out of memory.)"""
        if self.role != "candidate":
            return
        if self.device == "cuda":
            torch.cuda.empty_cache()
        held = []
        for nbytes in sorted((n for n in sizes if n > 0), reverse=True):
            try:        # as much as fits: the poison is a harness buffer, never what runs out of memory
                held.append(torch.full(((nbytes + 3) // 4,), float("nan"), device=self.device))
            except (torch.OutOfMemoryError, MemoryError, RuntimeError):
                continue
        del held

    def precompute(self, req: dict[str, Any]) -> dict[str, Any]:
        """The reference's outputs (float64 ones too if asked) for a trial the parent will ask for
        later, computed now, while the candidate loads: kept under ``token`` for a ``trial`` request
        that names it. Whatever trial is kept for a ``compare`` in flight stays kept."""
        token = str(req["token"])
        if self.role != "reference":
            return {"ok": False, "error_message": "only the reference precomputes"}
        if len(self.precomputed) >= MAX_PRECOMPUTED:
            return {"ok": True, "skipped": f"{len(self.precomputed)} precomputed trials already kept"}
        # fp32 outputs plus float64 ones: three times the bytes of the last trial's outputs
        kept_bytes = sum(entry[0].get("kept_bytes", 0) for entry in self.precomputed.values())
        if kept_bytes + 3 * self.last_output_bytes > PRECOMPUTE_BUDGET:
            return {"ok": True, "skipped": f"{kept_bytes >> 20} MiB of precomputed outputs already kept"}
        saved, self.kept_reference = getattr(self, "kept_reference", None), None
        try:
            reply = self.trial({**req, "op": "trial", "index": -1})
            kept = self.kept_reference
        finally:
            self.kept_reference = saved
        if reply.get("ok") and kept is not None:
            reply["kept_bytes"] = sum(x.numel() * x.element_size() for x in [*kept[1], *(kept[2] or [])]
                                      if isinstance(x, torch.Tensor))
            self.precomputed[token] = (reply, kept)
        return reply

    def discard(self, req: dict[str, Any]) -> dict[str, Any]:
        self.precomputed.pop(str(req.get("token")), None)
        return {"ok": True}

    def trial(self, req: dict[str, Any]) -> dict[str, Any]:
        seed, index = int(req["seed"]), int(req["index"])
        if self.role == "reference" and req.get("precomputed") is not None:
            entry = self.precomputed.pop(str(req["precomputed"]), None)
            if entry is not None and entry[1][3] == seed:
                reply, kept = entry
                self.kept_reference = (index, kept[1], kept[2], kept[3])
                return reply
            # not kept (skipped or discarded): computed now, as without a precompute
        self.step = "making the inputs"
        inputs = make_inputs(self.task, seed, self.device, self.numerics)
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        in_bytes = sum(x.numel() * x.element_size() for x in tensors)
        out_bytes = int(req.get("output_bytes", 0))
        self.harness_bytes = 2 * in_bytes + 2 * out_bytes
        self.step = "poisoning free memory"
        self._poison([x.numel() * x.element_size() for x in tensors] + [out_bytes, out_bytes])
        self.step = "copying the inputs"
        # the mutation check's copy; in host memory where the task fits the device only so (MemoryGate.plan)
        copy_to = "cpu" if req.get("inputs_copy") == "host" else None
        originals = _copies(tensors, copy_to)
        ptrs = {x.data_ptr() for x in tensors if x.numel()}
        inputs64 = None
        if self.role == "reference" and req.get("fp64"):
            # the float64 check: the same inputs in float64, taken before the forward runs
            inputs64 = self._inputs64(inputs)
        if self.builder is not None:
            self.builder.counter.reset()
        threads_before = threading.active_count()
        self.step = "running the forward"
        try:
            refill = req.get("refill_seed")
            if refill is not None:
                # Same tensor objects, new values: run once, then overwrite the inputs in place
                # and run again; the second output is the one checked. A candidate that caches
                # by id, data_ptr or shape returns the first output and fails.
                with torch.no_grad():
                    self.model(*inputs)
                clock.device_sync(self.device)
                # the first copies go before the fresh values come (at most the inputs twice
                # over, as in any trial: holding both took four times the inputs, 32 GiB
                # for an 8 GiB KernelBench level-1 input, beyond what the run was admitted for)
                originals = None
                fresh = [x for x in make_inputs(self.task, int(refill), self.device, self.numerics)
                         if isinstance(x, torch.Tensor)]
                for old, new in zip(tensors, fresh):
                    old.copy_(new)
                del fresh
                originals = _copies(tensors, copy_to)
                if self.builder is not None:
                    self.builder.counter.reset()
            with torch.no_grad():
                out = self.model(*inputs)
            clock.device_sync(self.device)
        except SystemExit as exc:
            return {"ok": False, **_exc_payload(exc), "error_message": f"sys.exit({exc.code}) in forward"}
        except BaseException as exc:  # noqa: BLE001
            return {"ok": False, **_exc_payload(exc)}
        threads_after = threading.active_count()
        self.step = "checking the outputs"
        flat = flatten_outputs(out)
        kinds = [type(x).__module__ + "." + type(x).__qualname__ for x in flat]
        non_plain = [k for x, k in zip(flat, kinds) if not is_plain_tensor(x)]
        reply: dict[str, Any] = {"ok": True, "output_types": kinds, "non_plain": non_plain,
                                 "threads_started": threads_after - threads_before,
                                 "custom_calls": self.builder.counter.calls if self.builder else None}
        if non_plain:
            return reply
        reply["aliases_input"] = any(x.numel() and x.data_ptr() in ptrs for x in flat)
        mutated = [i for i, (a, b) in enumerate(zip(tensors, originals))
                   if a.shape != b.shape or not _equal_nan(a, b)]
        reply["inputs_mutated"] = mutated
        reply["output_bytes"] = sum(x.numel() * x.element_size() for x in flat)
        if self.role == "reference":
            self.last_output_bytes = reply["output_bytes"]
            # Kept on the device for the `compare` request that follows (one trial at a time),
            # with the seed that remakes these inputs should the float64 rule need them.
            flat64, note = (self._run_fp64(inputs64) if inputs64 is not None else (None, None))
            self.kept_reference = (index, [x.detach() for x in flat], flat64, seed)
            if note:
                reply["fp64_note"] = note
            return reply
        self.step = "handing the outputs over"
        self.harness_bytes = 2 * in_bytes + 2 * reply["output_bytes"]
        reply["outputs"] = handoff.send(flat, self.handoff, self.exported, self._save_outputs, f"{self.role}_{index}.pt")
        return reply

    def resend(self, req: dict[str, Any]) -> dict[str, Any]:
        """Outputs shared through IPC that the reference could not map, sent again as a file."""
        name = str(req.get("name"))
        tensors = self.exported.tensors(name)
        if tensors is None:
            return {"ok": False, "error_type": "ProtocolError", "error_message": f"no outputs shared as {name!r}"}
        self.step = "saving the outputs"
        return {"ok": True, "outputs": handoff.send(tensors, "file", self.exported, self._save_outputs, name)}

    def _save_outputs(self, tensors: list[torch.Tensor], name: str) -> Path:
        return save_outputs(tensors, self.out_dir, name)

    def _inputs64(self, inputs: list[Any]) -> list[Any]:
        if getattr(self, "model64", None) is None:
            self.model64 = double_copy(self.model)
        return [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]

    def _run_fp64(self, inputs64: list[Any]) -> tuple[Any, Any]:
        return run_fp64(self.model64, inputs64, self.device)

    def compare(self, req: dict[str, Any]) -> dict[str, Any]:
        """The reference's kept outputs of trial ``index`` against the candidate's (``outputs``, as
        ``sandbox.handoff.send`` described them), on this (trusted) worker's device: no reference
        outputs cross a process boundary and no gigabyte-sized comparison runs on the parent's
        CPU. Outputs shared through IPC that cannot be mapped here answer ``unmapped`` and stay
        owed: the parent has them sent again as a file."""
        from sandbox.compare import compare_outputs, fp64_bounds, fp64_errors, only_value_mismatches
        from sandbox.result import EvalConfig

        index = int(req["index"])
        kept = getattr(self, "kept_reference", None)
        self.kept_reference = None
        if kept is None or kept[0] != index:
            return {"ok": False, "error_type": "ProtocolError",
                    "error_message": f"no reference outputs kept for trial {index}"}
        from sandbox.failures import resource_exhausted

        ref_bytes = sum(x.numel() * x.element_size() for x in kept[1] if isinstance(x, torch.Tensor))
        desc = req.get("outputs") or {}
        self.step, self.harness_bytes = "taking the candidate's outputs", 2 * ref_bytes
        try:
            data = handoff.receive(desc, self.device, 2 * ref_bytes + (16 << 20),
                                   lambda path: torch.load(path, map_location=self.device, weights_only=True))
        except handoff.Unmapped as exc:
            self.kept_reference = kept      # kept for the same outputs sent as a file
            return {"ok": True, "unmapped": str(exc)}
        except handoff.Rejected as exc:
            return {"ok": True, "passed": False, "checks": [], "reason": f"the candidate's outputs were refused: {exc}"}
        except Exception as exc:  # noqa: BLE001
            if resource_exhausted(type(exc).__name__, str(exc), getattr(exc, "errno", None)):
                raise                   # the trusted side found no memory: the harness's failure
            return {"ok": True, "passed": False, "checks": [],
                    "reason": f"the candidate's outputs could not be read as plain tensors ({type(exc).__name__})"}
        config = EvalConfig.model_validate(req["config"])
        passed, reason, checks = compare_outputs(kept[1], data, config)
        flat64 = kept[2]
        if not passed and config.numerics.fp64_check and only_value_mismatches(checks):
            # The float64 rule: elements outside the tolerance pass if no farther from the
            # reference's float64 run than the reference itself is (times elem_factor).
            if flat64 is None:
                flat64, _ = self._run_fp64(self._inputs64(make_inputs(self.task, kept[3], self.device,
                                                                      self.numerics)))
            if flat64 is not None and len(flat64) == len(checks):
                bounds = fp64_bounds(kept[1], flat64, config.numerics)
                if any(bounds):
                    passed, reason, checks = compare_outputs(kept[1], data, config, bounds)
        if passed and flat64 is not None and len(flat64) == len(checks):
            for check, r, o, r64 in zip(checks, kept[1], data, flat64):
                if isinstance(r64, torch.Tensor):
                    errs = fp64_errors(r, o, r64)
                    if errs is not None:
                        check.ref_fp64_rel_rms, check.fp64_rel_rms = errs
        del data, kept, flat64
        return {"ok": True, "passed": passed, "reason": reason, "checks": [c.model_dump(mode="json") for c in checks]}

    def _make_args(self, seed: int):
        return lambda i: make_inputs(self.task, seed + i, self.device, self.numerics)

    def time(self, req: dict[str, Any]) -> dict[str, Any]:
        fn = self.model
        if req.get("compiled"):
            if self.compiled is None:
                self.compiled = torch.compile(self.model)
            fn = self.compiled
        threads_before = threading.active_count()
        check = {int(i) for i in req.get("check_runs", [])}
        self.kept = {}
        self.timing_seed = int(req["seed"])
        # Every timed run checked (sandbox.runcheck): the candidate samples its outputs, the
        # reference checks those samples against its own outputs of the same runs.
        self.sampler = (runcheck.Sampler(self.device, runs=int(req["runs"]))
                        if self.role == "candidate" and req.get("sample") else None)
        checker = None
        if self.role == "reference" and req.get("samples_path"):
            from sandbox.result import EvalConfig

            self.step = "reading the candidate's samples"
            checker = runcheck.SampleCheck(str(req["samples_path"]), self.device, int(req["runs"]),
                                           EvalConfig.model_validate(req["config"]))

        def keep(i: int, out: Any) -> None:
            # Copied on the device now, written out on the next request, so the parent's clock
            # around this request sees the timed runs and not the file writes.
            if i in check:
                flat = flatten_outputs(out)
                if all(is_plain_tensor(x) for x in flat):
                    self.kept[i] = [x.detach().clone() for x in flat]
            if self.sampler is not None:
                self.sampler(i, out)
            if checker is not None:
                checker(i, out)

        make = self._make_args(self.timing_seed)
        if req.get("warmup_seed") is not None:
            # a block of interleaved timing (cpu, sandbox.checks): its warm-up inputs from seeds of
            # their own, never a later block's timed inputs (``time_samples`` warms up on runs + i)
            timed_args, warm_args, runs = make, self._make_args(int(req["warmup_seed"])), int(req["runs"])
            make = lambda i: timed_args(i) if i < runs else warm_args(i - runs)   # noqa: E731
        try:
            t = _time_runs(fn, make, self.device, int(req["warmup"]),
                           int(req["runs"]), bool(req.get("flush_l2", True)),
                           on_output=keep if (check or self.sampler or checker) else None)
        except BaseException as exc:  # noqa: BLE001
            if checker is not None:
                raise                   # the trusted reference failed: the harness's failure
            return {"ok": False, **_exc_payload(exc)}
        finally:
            if self.device == "cuda":
                torch.cuda.empty_cache()
        reply = {"ok": True, "timing": t.model_dump(), "tampered": _tampered(),
                 "threads_started": threading.active_count() - threads_before}
        if req.get("compiled") and req.get("check_compiled"):
            self.step = "checking torch.compile's output"
            fp64 = (lambda xs: self._run_fp64(self._inputs64(xs))) if req.get("fp64") else None
            reply["compile_check"] = compiled_check(self.model, self.compiled, lambda: make(0), self.numerics,
                                                    self.device, fp64, self.compile_checked)
        if checker is not None:
            self.step = "rechecking timed runs"
            reply["samples"] = checker.finish(self)
        return reply

    def check_samples(self, req: dict[str, Any]) -> dict[str, Any]:
        """The reference's check of the candidate's samples of a block of timed runs that the
        reference timed *before* the candidate (cpu's interleaved blocks, ``sandbox.checks``): the
        samples did not exist while its own runs were timed, so the reference runs those inputs
        (the same secret seeds) again, untimed, and checks the samples against these outputs with
        the same rule as during a timed run (``runcheck.SampleCheck``, the float64 recheck included)."""
        from sandbox.result import EvalConfig

        if self.role != "reference":
            return {"ok": False, "error_message": "only the reference checks samples"}
        self.timing_seed, runs = int(req["seed"]), int(req["runs"])
        self.step = "reading the candidate's samples"
        checker = runcheck.SampleCheck(str(req["samples_path"]), self.device, runs,
                                       EvalConfig.model_validate(req["config"]))
        self.step = "rerunning timed runs to check their samples"
        make = self._make_args(self.timing_seed)
        with torch.no_grad():
            for i in range(runs):
                if i not in checker.failed:
                    checker(i, self.model(*make(i)))
        clock.device_sync(self.device)
        self.step = "rechecking timed runs"
        return {"ok": True, "samples": checker.finish(self)}

    def timed_outputs(self, req: dict[str, Any]) -> dict[str, Any]:
        saved: dict[str, dict[str, Any]] = {}
        self.step = "handing over the outputs of timed runs"
        kept = getattr(self, "kept", {})
        self.harness_bytes = 2 * sum(x.numel() * x.element_size() for flat in kept.values() for x in flat)
        # ``first``: the evaluation's number of this request's first timed run (cpu's blocks, sandbox.checks)
        first = int(req.get("first") or 0)
        for i, flat in kept.items():
            saved[str(first + i)] = handoff.send(flat, self.handoff, self.exported, self._save_outputs,
                                                 f"{self.role}_timed_{first + i}.pt")
        self.kept = {}
        reply: dict[str, Any] = {"ok": True, "saved": saved}
        sampler = getattr(self, "sampler", None)
        if sampler is not None:
            self.step = "saving the samples of timed runs"
            path = self.out_dir / f"{self.role}_samples.pt"
            sampler.save(path, _save_to)
            reply["samples_path"] = str(path)
            self.sampler = None
        return reply

    def profile(self, req: dict[str, Any]) -> dict[str, Any]:
        from sandbox.profiling import profile_forward

        try:
            stats, ahead = profile_forward(self.model, self._make_args(int(req["seed"])), self.device,
                                           runs=int(req.get("runs", 3)), own_kernels=self.kernel_names)
        except BaseException as exc:  # noqa: BLE001
            return {"ok": False, **_exc_payload(exc)}
        return {"ok": True, "profile": stats, "ahead": ahead}

    def roofline(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            from sandbox.tasks import count_task
        except ImportError as exc:
            return {"ok": False, **_exc_payload(exc)}
        try:
            counts = count_task(self.spec, self.device, self.numerics)
        except BaseException as exc:  # noqa: BLE001
            return {"ok": False, **_exc_payload(exc)}
        return {"ok": True, "counts": counts.to_dict()}


def serve(conn: Connection) -> None:
    # a note (never an answer): Python and the imports are done, before the first message is read;
    # a reference's parent waits for it before it takes the device (``ReferenceWorker.spawn``)
    _send(conn, {"event": "imported"})
    init = _recv(conn)
    if init.get("role") == "warm":
        serves = "build" if init.get("serves") == "build" else "candidate"   # a build worker: the GPU hidden
        _send(conn, warm_up(init, DeviceTurns(conn, bool(init.get("device_turns")))))
        init = _recv(conn)             # the one candidate this worker will ever serve
        if init.get("role") != serves:
            _send(conn, {"ok": False, "error_message": f"a warm {serves} worker serves one {serves} only"})
            return
    worker = Worker(conn, init)
    if worker.role == "build":
        _send(conn, worker.build())
        return
    # The run's math mode (sandbox.numerics) is set afresh around the load (the reference's
    # warm-up torch.compile included) and every request: a candidate that flipped a TF32 switch
    # gets it flipped back, and cannot tell a trial from a timed run by them.
    with worker.numerics.enforced():
        reply = worker.load_candidate() if worker.role == "candidate" else worker.load_reference()
    _send(conn, reply)
    if not reply.get("ok"):
        return
    handlers = {"trial": worker.trial, "compare": worker.compare, "time": worker.time,
                "precompute": worker.precompute, "discard": worker.discard,
                "timed_outputs": worker.timed_outputs, "resend": worker.resend,
                "check_samples": worker.check_samples,
                "profile": worker.profile,
                "roofline": worker.roofline}
    if worker.role == "reference":
        from sandbox.footprint import measure_in_worker

        handlers["footprint"] = lambda req: measure_in_worker(worker, req)
    while True:
        try:
            req = _recv(conn)
        except (EOFError, OSError):
            return
        op = req.get("op")
        if op == "exit":
            return
        handler = handlers.get(op)
        if handler is None:
            _send(conn, {"ok": False, "error_message": f"unknown op {op!r}"})
            continue
        worker.step, worker.harness_bytes = op, 0
        if op != "resend":
            worker.exported.release()       # the reference has copied them: the parent asks nothing before
        try:
            with worker.numerics.enforced():
                reply = handler(req)
        except BaseException as exc:  # noqa: BLE001 - the harness's own step failed: say so, and how
            # (the candidate's own code is caught inside the handlers; sandbox.failures judges this)
            traceback.print_exc()
            reply = {"ok": False, "harness_error": True, "harness_step": worker.step,
                     "errno": getattr(exc, "errno", None), "memory_held": _memory_held(worker.device),
                     "harness_bytes": worker.harness_bytes, **_exc_payload(exc)}
        if worker.role == "reference" and worker.device == "cuda":
            # Between requests a reference holds only its models: the memory of a trial, a
            # compare or a timing goes back to the GPU (sandbox.admission counts it that way).
            torch.cuda.empty_cache()
        _send(conn, reply)


# The exit status of a worker whose harness code raised: never 0, which the parent would read
# as "left without answering, no cause" (os._exit(0) in a `finally` used to swallow the error).
HARNESS_EXIT = 70


def main() -> None:
    fd = int(sys.argv[1])
    conn = Connection(fd)
    code = 0
    try:
        serve(conn)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = HARNESS_EXIT
    finally:
        try:
            conn.close()
        except OSError:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
