"""What a task needs in memory: measured once per task, device and numerics, then stored.

A reference worker runs the task's reference at the run's sizes and precision in a worker of
its own and reports (``measure_in_worker``, the worker's ``footprint`` request):

* the exact bytes of the model's parameters and buffers, of one call's inputs and outputs
  (``Tensor.nbytes``: exact on any device), and of the float64 copy (model, inputs, outputs);
* the peak of one forward, and the peak of a whole reference trial and the ``compare`` of its
  own outputs read back from a file, i.e. the same code a reference worker runs for a
  candidate: once without the float64 run, once with it (a task that fits only without it runs
  so, and is admitted for the first figure). On ``cuda`` from the caching allocator
  (``torch.cuda.max_memory_reserved``, what the process takes from the GPU); on ``cpu`` from the
  process's resident set (``VmHWM`` after resetting it through ``/proc/self/clear_refs``,
  ``ru_maxrss`` where that is not possible).

A measurement that runs out of memory says so (``oom``): its figures are then lower bounds.
The figures a candidate worker needs are derived (its code is not known in advance): the same
inputs, forward and outputs as the reference, NaN poison of twice the inputs and outputs, and
two kept outputs for the timing's spot checks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

MEASURE_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Beside:
    """A footprint measured beside running work (``MemoryGate.footprint``): the measuring
    process's caching allocator capped at ``cap_bytes`` (``set_per_process_memory_fraction``:
    what the admission ledger holds for it, so the runs admitted beside it keep their room),
    and its work on the device held under ``device_work`` (the slot's gate, so that no timing
    runs beside it). A measurement that runs out of memory under the cap, or whose allocator
    had to give cached blocks back to stay under it, is no measure of the task alone."""

    cap_bytes: int
    device_work: Callable[[], ContextManager[Any]]


@dataclass
class Footprint:
    """Bytes one task needs on one device under one numerics convention."""

    task_key: str
    device: str                         # cuda | cpu
    device_name: str
    numerics: str                       # label, e.g. fp32/default: inputs are cast to its precision
    params_bytes: int = 0               # parameters and buffers at the run's precision
    inputs_bytes: int = 0               # one call's inputs
    outputs_bytes: int = 0              # one call's outputs
    fp64_bytes: int = 0                 # float64 copy of the model, float64 inputs and outputs
    forward_peak_bytes: int = 0         # one forward above the loaded model: inputs, workspace, outputs
    reference_resident_bytes: int = 0   # a reference worker between trials (model and its float64 copy)
    reference_peak_bytes: int = 0       # at its peak: a trial with its float64 run, then a compare
    reference_peak_no_fp64_bytes: Optional[int] = None   # the same without the float64 run (None: not measured)
    measured_by: str = ""               # how the peaks were read
    oom: Optional[str] = None           # the measurement ran out of memory: figures are lower bounds
    note: Optional[str] = None          # e.g. why the float64 run did not happen
    # a plan, not a measurement (MemoryGate.plan): the candidate's copy of its inputs for the
    # mutation check kept in host memory instead of on the device
    inputs_copy_on_host: bool = False
    # measured beside running work (``Beside``): the measuring process's allocator capped at these
    # bytes (0: measured with the device alone); ``cap_reached``: the allocator gave cached blocks
    # back to stay under the cap, so a peak may read low (the task is then measured again alone)
    cap_bytes: int = 0
    cap_reached: bool = False

    # ---- derived: what a candidate worker and the outputs in transit take ----------------
    @property
    def candidate_peak_bytes(self) -> int:
        """A candidate worker at its peak, estimated from the reference's figures: its model,
        the inputs and their clone (the mutation check), the forward, plus two outputs kept
        for the timing's spot checks. The NaN poison before a run is not counted: it fills only
        what is free (``sandbox.worker``). With ``inputs_copy_on_host`` the clone is in host memory."""
        copies = 1 if self.inputs_copy_on_host else 2
        return self.params_bytes + copies * self.inputs_bytes + self.forward_peak_bytes + 2 * self.outputs_bytes

    def with_inputs_copy_on_host(self) -> "Footprint":
        """The figures of runs whose candidate keeps its inputs' copy for the mutation check in host
        memory: the same check, one input set less on the device, one more in host memory."""
        return dataclasses.replace(self, inputs_copy_on_host=True)

    def without_fp64(self) -> "Footprint":
        """The figures of runs without the float64 check: no float64 copy of the model in the
        reference worker, no float64 run in its trials. The trial's peak is the one measured
        without the float64 run; a footprint stored before that was measured subtracts the
        float64 bytes from the peak with it, which leaves the float64 forward's own workspace in
        (on an H100, level1/25_Swish's 67.5 GiB peak less 24 GiB of float64 copies left 43.5)."""
        per = {"fp32": 2, "fp16": 4, "bf16": 4}.get(self.numerics.split("/")[0], 2)
        model64 = min(self.params_bytes * per, self.fp64_bytes)
        oom = None if (self.oom or "").startswith("the float64 run") else self.oom
        peak = (self.reference_peak_no_fp64_bytes if self.reference_peak_no_fp64_bytes is not None
                else max(0, self.reference_peak_bytes - self.fp64_bytes))
        return dataclasses.replace(self, fp64_bytes=0, oom=oom, reference_peak_bytes=peak,
                                   reference_resident_bytes=max(0, self.reference_resident_bytes - model64))

    @property
    def reference_trial_bytes(self) -> int:
        """What a reference trial takes above what the reference worker holds between trials."""
        return max(0, self.reference_peak_bytes - self.reference_resident_bytes)

    @property
    def candidate_resident_bytes(self) -> int:
        return self.params_bytes

    @property
    def host_transit_bytes(self) -> int:
        """Host memory for outputs in transit: the candidate's copy to the CPU and the reference's
        read of the file (on ``cpu`` these are the tensors themselves, counted in the peaks), and
        the inputs' copy where it is kept there."""
        if self.device != "cuda":
            return 0
        return 2 * self.outputs_bytes + (self.inputs_bytes if self.inputs_copy_on_host else 0)

    @property
    def shm_bytes(self) -> int:
        """Files of outputs at once: a trial's, or the two spot-checked timed runs'."""
        return 2 * self.outputs_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Footprint":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------- in the worker

def _tensor_bytes(values: Any) -> int:
    import torch

    from sandbox.harness import flatten_outputs

    return sum(x.nbytes for x in flatten_outputs(values) if isinstance(x, torch.Tensor))


def _fp64_bytes(values: Any) -> int:
    import torch

    from sandbox.harness import flatten_outputs

    return sum(x.numel() * 8 if x.is_floating_point() else x.nbytes
               for x in flatten_outputs(values) if isinstance(x, torch.Tensor))


class _Meter:
    """Current and peak bytes of this process on its device, with a resettable peak."""

    def __init__(self, device: str):
        import torch

        self.cuda = device == "cuda"
        self.torch = torch
        self.how = "cuda caching allocator (max_memory_reserved)" if self.cuda else "process resident set (VmHWM)"
        self._frees = 0         # the allocator's device frees at the last reset (cuda)

    @staticmethod
    def _status_kib(field: str) -> Optional[int]:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1])
        except OSError:
            pass
        return None

    def _device_frees(self) -> int:
        return int(self.torch.cuda.memory_stats().get("num_device_free", 0)) if self.cuda else 0

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()
            self._frees = self._device_frees()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")            # resets VmHWM to the current resident set
        except OSError:
            self.how = "process resident set (ru_maxrss: a high-water mark that cannot be reset)"

    def gave_back(self) -> bool:
        """Whether the caching allocator freed device memory since ``reset`` (it does so only to
        make room: under a cap, a peak that would have been higher without it)."""
        return self.cuda and self._device_frees() > self._frees

    def current(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize()
            return int(self.torch.cuda.memory_reserved())
        return (self._status_kib("VmRSS") or 0) << 10

    def peak(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize()
            return int(self.torch.cuda.max_memory_reserved())
        hwm = self._status_kib("VmHWM")
        if hwm is None:
            import resource

            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return hwm << 10


def _is_oom(exc_or_type: Any) -> bool:
    text = exc_or_type if isinstance(exc_or_type, str) else type(exc_or_type).__name__ + str(exc_or_type)
    return "OutOfMemory" in text or "out of memory" in text.lower() or "can't allocate memory" in text.lower()


def measure_in_worker(worker: Any, req: dict[str, Any]) -> dict[str, Any]:
    """The ``footprint`` request of a reference worker (``sandbox.worker.Worker``): one forward,
    then a reference trial and a compare against its own saved outputs, without the float64 run
    and (where the numerics check against float64) again with it."""
    import torch

    from sandbox.harness import make_inputs
    from hardware.clock import device_sync

    meter = _Meter(worker.device)
    seed = int(req.get("seed", 1234))
    model = worker.model
    params = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers())) \
        if isinstance(model, torch.nn.Module) else 0
    cap = int(getattr(worker, "memory_cap", 0) or 0)
    fig: dict[str, Any] = {"params_bytes": params, "measured_by": meter.how, "cap_bytes": cap}

    def peak() -> int:
        """The peak since the meter's reset; under a cap, whether the allocator had to give back."""
        if cap and meter.gave_back():
            fig["cap_reached"] = True
        return meter.peak()

    meter.reset()
    base = meter.current()
    fig["reference_resident_bytes"] = base
    # Running out of memory anywhere below (the forward, the trial, the compare:
    # level1/45_Average_Pooling_2D's asked 16 GiB more beside 64) is the task's size where the
    # worker has its device alone, so its figures are lower bounds and the task too_large, never
    # `unchecked` (under a cap the parent measures it again alone); any other exception (a full
    # disk, say) is the harness's (sandbox.failures).
    try:
        inputs = make_inputs(worker.task, seed, worker.device, worker.numerics)
        fig["inputs_bytes"] = _tensor_bytes(inputs)
        with torch.no_grad():
            out = model(*inputs)
        device_sync(worker.device)
        fig["outputs_bytes"] = _tensor_bytes(out)
        fig["fp64_bytes"] = (_fp64_bytes(list(model.parameters()) + list(model.buffers()))
                             if isinstance(model, torch.nn.Module) else 0) + _fp64_bytes(inputs) + _fp64_bytes(out)
        fig["forward_peak_bytes"] = max(peak() - base, fig["inputs_bytes"] + fig["outputs_bytes"])
        del inputs, out
        fp64 = bool(worker.numerics.fp64_check)
        meter.reset()
        failed = _trial_and_compare(worker, seed, fig, fp64=False)
        if failed:
            return _failed(fig, meter, base, failed)
        fig["reference_peak_no_fp64_bytes"] = max(peak(), base + fig["forward_peak_bytes"])
        fig["reference_peak_bytes"] = fig["reference_peak_no_fp64_bytes"]
        if fp64:
            # measured afresh: the first trial's cached blocks given back, its peak forgotten
            if worker.device == "cuda":
                torch.cuda.empty_cache()
            meter.reset()
            failed = _trial_and_compare(worker, seed, fig, fp64=True)
            if failed:
                return _failed(fig, meter, base, failed, "the float64 run: ")
            fig["reference_peak_bytes"] = max(peak(), fig["reference_peak_no_fp64_bytes"])
    except BaseException as exc:  # noqa: BLE001
        if not _is_oom(exc):
            raise
        # out of memory after the trial without the float64 run was measured: the float64 run's
        return _failed(fig, meter, base, exc, "the float64 run: " if "reference_peak_no_fp64_bytes" in fig else "")
    if worker.device == "cuda":
        torch.cuda.empty_cache()
        fig["reference_resident_bytes"] = meter.current()   # now with the float64 copy of the model
    else:
        model64 = getattr(worker, "model64", None)
        if isinstance(model64, torch.nn.Module):
            fig["reference_resident_bytes"] = base + _fp64_bytes(list(model64.parameters()) + list(model64.buffers()))
    return {"ok": True, "footprint": fig}


def _trial_and_compare(worker: Any, seed: int, fig: dict[str, Any], fp64: bool) -> Optional[str]:
    """One reference trial (with the float64 run or not), then the candidate's side of the
    exchange played with the reference's own outputs: saved, read back, compared. None, or why
    it failed."""
    from sandbox.result import EvalConfig

    reply = worker.trial({"seed": seed, "index": 0, "fp64": fp64})
    if not reply.get("ok"):
        return f"{reply.get('error_type')}: {reply.get('error_message')}"
    if reply.get("fp64_note"):
        fig["note"] = reply["fp64_note"]
        if _is_oom(reply["fp64_note"]):
            fig["oom"] = f"the float64 run: {reply['fp64_note']}"
    worker.step = "saving the outputs"
    path = worker._save_outputs([x.to("cpu").contiguous() for x in worker.kept_reference[1]], "footprint_0.pt")
    cmp = worker.compare({"index": 0, "path": str(path),
                          "config": EvalConfig(numerics=worker.numerics).model_dump(mode="json")})
    return None if cmp.get("ok") else f"{cmp.get('error_type')}: {cmp.get('error_message')}"


def _failed(fig: dict[str, Any], meter: _Meter, base: int, exc: Any, phase: str = "") -> dict[str, Any]:
    """Out of memory: the figures so far, and at least the peak reached plus what was asked for
    (``phase``: where, when that is not the task's whole trial)."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    if not _is_oom(exc):
        return {"ok": False, "error_type": "FootprintError", "error_message": text[:2000]}
    asked = 0
    m = re.search(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB|B)", text)
    if m:
        asked = int(float(m.group(1)) * {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}[m.group(2)])
    reached = meter.peak() + asked
    fig["reference_peak_bytes"] = max(fig.get("reference_peak_bytes", 0), reached)
    if not phase:       # (the float64 run's peak says nothing of a forward at the run's precision)
        fig["forward_peak_bytes"] = max(fig.get("forward_peak_bytes", 0), reached - base)
    fig["oom"] = (phase + text.splitlines()[0])[:500]
    return {"ok": True, "footprint": fig}


# --------------------------------------------------------------------------- in the parent

def _died_of_memory(exc: BaseException) -> bool:
    """A worker death with out-of-memory evidence: killed by SIGKILL (the kernel's OOM killer
    sends it), or its cause or last stderr lines name memory."""
    from sandbox.failures import resource_exhausted

    text = str(exc)
    return "SIGKILL" in text or "signal 9" in text or resource_exhausted(None, text) == "memory"


def measure_footprint(spec: Any, device: str, numerics: Any, env: Optional[dict[str, str]] = None,
                      timeout: float = MEASURE_TIMEOUT_S, beside: Optional[Beside] = None) -> Footprint:
    """Run the task's reference in a worker of its own and read its figures. ``beside``: measured
    beside running work (its imports off the slot's gate, its load and measurement under it, its
    allocator capped). Raises ``TaskFailed`` when the task's reference fails for its own reasons,
    ``InfraFailure`` when the harness ran out of memory or disk, or the worker died without
    out-of-memory evidence."""
    from sandbox.failures import InfraFailure
    from hardware.probe import cpu_model
    from sandbox.process import WorkerDied, WorkerProcess

    worker = WorkerProcess("reference", env=env)
    try:
        if beside is not None:
            worker.recv(timeout, until_event="imported")
        with beside.device_work() if beside is not None else contextlib.nullcontext():
            try:
                return _measured(worker, spec, device, numerics, timeout, beside.cap_bytes if beside else 0)
            finally:
                if beside is not None:      # its exit too: no process of it is left beside a timing
                    worker.close()
    except WorkerDied as exc:
        if not _died_of_memory(exc):
            raise InfraFailure(f"the worker measuring {spec.name}'s memory died: {exc}", "ReferenceDied") from None
        # On cpu the kernel's OOM killer ends the process: that is the task not fitting.
        return Footprint(task_key=spec.key, device=device, device_name=cpu_model() if device == "cpu" else "",
                         numerics=numerics.label,
                         oom=f"the measuring worker died ({exc})")
    finally:
        worker.close()
        worker.cleanup()


def _measured(worker: Any, spec: Any, device: str, numerics: Any, timeout: float, cap: int) -> Footprint:
    """``measure_footprint``'s two requests: the task loaded (its allocator capped at ``cap``
    bytes where not 0), then measured."""
    from sandbox.failures import InfraFailure, resource_exhausted
    from hardware.probe import cpu_model
    from sandbox.reference import TaskFailed

    reply = worker.ask({"role": "reference", "device": device, "out_dir": str(worker.out_dir),
                        "task": spec.__dict__, "init_seed": 0, "warm_compile": False,
                        "numerics": numerics.model_dump(mode="json"),
                        **({"memory_cap_bytes": cap} if cap else {})}, timeout)
    fp = Footprint(task_key=spec.key, device=device, numerics=numerics.label, cap_bytes=cap,
                   device_name=reply.get("device_name") or (cpu_model() if device == "cpu" else ""))
    if not reply.get("ok"):
        msg = f"{reply.get('error_type')}: {reply.get('error_message')}"
        if not _is_oom(msg):
            raise TaskFailed(f"the reference of {spec.name} failed to load: {msg}")
        fp.oom = f"loading the model: {msg.splitlines()[0][:500]}"
        return fp
    reply = worker.ask({"op": "footprint"}, timeout)
    if not reply.get("ok"):
        error = f"{reply.get('error_type')}: {str(reply.get('error_message'))[:300]}"
        kind = resource_exhausted(reply.get("error_type"), reply.get("error_message"), reply.get("errno"))
        if kind is not None:        # the harness's own step: retried, then infra_error
            raise InfraFailure(f"the harness ran out of {kind} while {reply.get('harness_step') or 'measuring'} "
                               f"in the reference's worker, measuring {spec.name}'s memory ({error})",
                               "MeasuringFailed")
        raise TaskFailed(f"measuring {spec.name}'s memory: the reference failed: {error}")
    for k, v in reply["footprint"].items():
        setattr(fp, k, v)
    return fp


class FootprintBook:
    """Footprints by (task key, device, numerics): kept in memory, read from and written to a
    store through ``load``/``save`` where given, measured at most once per key."""

    def __init__(self, load: Optional[Callable[[Any, str, str], Optional[Footprint]]] = None,
                 save: Optional[Callable[[Any, Footprint], None]] = None,
                 measure: Callable[..., Footprint] = measure_footprint):
        self._load, self._save, self._measure = load, save, measure
        self._known: dict[tuple[str, str, str], Footprint] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[str, str, str], threading.Lock] = {}

    def known(self, spec: Any, device: str, numerics: Any) -> Optional[Footprint]:
        key = (spec.key, device, numerics.label)
        fp = self._known.get(key)
        if fp is None and self._load is not None:
            fp = self._load(spec, device, numerics.label)
            if fp is not None:
                self._known[key] = fp
        return fp

    def get(self, spec: Any, device: str, numerics: Any, measure_with: Callable[[], Footprint]) -> Footprint:
        """The stored footprint, else ``measure_with()``'s (once, whoever asks at the same time)."""
        key = (spec.key, device, numerics.label)
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            fp = self.known(spec, device, numerics)
            if fp is None:
                fp = measure_with()
                self.remember(spec, device, numerics, fp)
            return fp

    def remember(self, spec: Any, device: str, numerics: Any, fp: Footprint) -> None:
        """Keep ``fp`` as the task's footprint, and store it where the book has a store."""
        self._known[(spec.key, device, numerics.label)] = fp
        if self._save is not None:
            self._save(spec, fp)

    def measure(self, spec: Any, device: str, numerics: Any, env: Optional[dict[str, str]] = None,
                beside: Optional[Beside] = None) -> Footprint:
        return self._measure(spec, device, numerics, env=env, **({"beside": beside} if beside is not None else {}))


def env_bytes(name: str, default: Optional[int], total: Optional[int] = None) -> Optional[int]:
    """A size from the environment: ``70GiB``, ``80GB``, ``512MiB``, a byte count, or a fraction
    of ``total`` (``0.9``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    return parse_bytes(raw, total)


def parse_bytes(raw: str, total: Optional[int] = None) -> int:
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", raw, re.IGNORECASE)
    if not m:
        raise ValueError(f"{raw!r} is not a size (70GiB, 80GB, 0.9 of the total)")
    value, unit = float(m.group(1)), (m.group(2) or "").upper()
    if not unit:
        if value <= 1.0:
            if total is None:
                raise ValueError(f"{raw!r}: a fraction needs a total to be a fraction of")
            return int(value * total)
        return int(value)
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(value * base ** power)
