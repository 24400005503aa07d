"""Admission of workers against memory budgets: per GPU, host memory, and the outputs' file system.

A sandbox's workers are admitted from their task's measured footprint (``sandbox.footprint``):

* a **reference worker** holds its *resident* bytes (its models, the CUDA context) for as long
  as it lives; it is closed by ``Sandbox.release`` when its task ends, or earlier when another
  task's run needs the room and it is idle (least recently used first);
* a **candidate run** holds its candidate worker's resident bytes, the host memory and files
  of outputs in transit, and the trial peaks of its reference and its candidate above their
  resident bytes. A pool counts every holding's bytes: ``usage = sum(bytes)`` (``Needs``: pool
  -> bytes). (It once counted only the largest trial peak, for runs
  whose peaks were thought to take turns under the slot's device lock. They do not: a candidate
  worker keeps its peak reserved in its caching allocator until it exits, and loads, trials and
  precomputes of several runs overlap with a timing. On an H100 two level-1 candidates of 6 GiB
  tasks held 32 GiB each at once, and the references beside them ran out of memory.)

A run waits until its needs fit (closing idle references of other tasks first); one whose
needs exceed a budget with nothing else admitted raises ``TaskTooLarge``, naming the bytes
needed and available: its task is ``too_large``, and no candidate of it gets a verdict.

On ``cuda`` a task's footprint is first measured **beside** running work (``MemoryGate.footprint``,
``sandbox.footprint.Beside``): the ledger admits the measurement for ``BESIDE_SHARE`` of the GPU's
budget, the measuring process's caching allocator is capped at that (so the runs admitted beside
it keep their room), and its load and measurement hold the slot's gate as background work (no
timing runs beside them); up to ``BESIDE_AT_ONCE`` such measurements per GPU. The measuring
process reads its own allocator, so what runs beside it does not change its figures; a
measurement that ran out of memory under the cap, or whose allocator gave cached blocks back to
stay under it (a peak that may read low), is repeated alone. (Every measurement used to wait for
the device **alone**: on one H200 a level-2 run's new tasks then waited 15 s each, median, while
the runs drained for one measurement after another; session ac.)

Measured **alone** (``Admission.alone``; the CPU target, ``KERNELLOOP_FOOTPRINT_BESIDE=0``, or
after a measurement beside): no run admitted there, none admitted until the measurement ends,
idle references left resident (they do not change the measuring process's figures either). Only
a measurement that ran out of memory beside idle references is repeated with the whole device
(closing them): before, every measurement took the whole device, so each new task of a run
closed every other task's idle reference and they all started again.

Budgets (sizes as ``70GiB``, ``80GB``, a byte count, or a fraction such as ``0.9``):
``KERNELLOOP_GPU_MEMORY`` (per GPU, default 0.92 of its total memory),
``KERNELLOOP_HOST_MEMORY`` (default 0.8 of the host's available memory at start),
``KERNELLOOP_SHM_MEMORY`` (default 0.9 of the free space where outputs are written),
``KERNELLOOP_CUDA_CONTEXT`` (a worker's CUDA context, default 768MiB, outside the allocator's figures).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional

from sandbox.footprint import Beside, Footprint, FootprintBook, env_bytes, human_bytes

GPU_ENV, HOST_ENV, SHM_ENV, CONTEXT_ENV = ("KERNELLOOP_GPU_MEMORY", "KERNELLOOP_HOST_MEMORY",
                                           "KERNELLOOP_SHM_MEMORY", "KERNELLOOP_CUDA_CONTEXT")
BESIDE_ENV = "KERNELLOOP_FOOTPRINT_BESIDE"      # 0: every footprint measured with its device alone
BESIDE_SHARE = 0.25     # of a GPU's budget: what one footprint measured beside running work is capped at
BESIDE_AT_ONCE = 2      # such measurements at once per GPU
GPU_DEFAULT_FRACTION = 0.92
HOST_DEFAULT_FRACTION = 0.8
SHM_DEFAULT_FRACTION = 0.9
CUDA_CONTEXT_BYTES = 768 << 20
WORKER_HOST_BYTES_CUDA = 2 << 30     # a worker's torch and CUDA libraries in host memory
WAIT_POLL_S = 1.0

Needs = dict[str, int]   # pool -> bytes held while admitted


class TaskTooLarge(Exception):
    """A task whose needs exceed a budget even with nothing else admitted."""

    def __init__(self, task: str, pool: str, needed: int, available: int, detail: str = ""):
        self.task, self.pool, self.needed, self.available, self.detail = task, pool, needed, available, detail
        super().__init__(self.reason)

    @property
    def reason(self) -> str:
        why = f" ({self.detail})" if self.detail else ""
        return (f"too_large: needs {human_bytes(self.needed)} ({self.needed} B) of {self.pool} memory, "
                f"{human_bytes(self.available)} ({self.available} B) available{why}")


# --------------------------------------------------------------------------- budgets

def _meminfo_bytes(field_name: str) -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def gpu_pool(slot: int) -> str:
    return f"gpu{slot}"


def default_budgets(device: str, slots: int) -> dict[str, int]:
    """Pool name -> bytes: ``gpu<i>`` per slot on cuda, ``host``, ``shm``; the environment's knobs first."""
    from sandbox.process import outputs_root

    host_total = _meminfo_bytes("MemAvailable") or _meminfo_bytes("MemTotal") or (16 << 30)
    budgets = {"host": env_bytes(HOST_ENV, int(HOST_DEFAULT_FRACTION * host_total), host_total)}
    try:
        shm_free = shutil.disk_usage(outputs_root() or tempfile.gettempdir()).free
    except OSError:
        shm_free = 16 << 30
    budgets["shm"] = env_bytes(SHM_ENV, int(SHM_DEFAULT_FRACTION * shm_free), shm_free)
    if device == "cuda":
        import torch

        for i in range(slots):
            try:
                total = torch.cuda.get_device_properties(i if i < torch.cuda.device_count() else 0).total_memory
            except (RuntimeError, AssertionError):
                total = 80 << 30
            budgets[gpu_pool(i)] = env_bytes(GPU_ENV, int(GPU_DEFAULT_FRACTION * total), total)
    return budgets


# --------------------------------------------------------------------------- the ledger

def _bytes(pool: str, needs: list[Needs]) -> int:
    """What ``needs`` take of ``pool`` (see the module's notes)."""
    return sum(n.get(pool, 0) for n in needs)


@dataclass
class _Reference:
    needs: Needs
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)


class Admission:
    """Thread-safe ledger of what is admitted in each pool; runs wait on a condition."""

    def __init__(self, budgets: dict[str, int]):
        self.budgets = dict(budgets)
        self._cond = threading.Condition()
        self._refs: dict[Any, _Reference] = {}
        self._runs: dict[int, tuple[Any, Needs]] = {}
        self._tokens = itertools.count(1)
        self._alone: dict[str, int] = {}     # pool -> measurements waiting for, or holding, it alone

    def _asked(self, run: Needs, ref_key: Any, ref: Optional[Needs]) -> list[Needs]:
        """What admitting ``run`` adds: the run, and its reference unless that is admitted already."""
        return [run] + ([ref] if ref_key is not None and ref_key not in self._refs and ref else [])

    def _blocked(self, extra: list[Needs]) -> bool:
        """Whether ``extra`` asks for a pool that a measurement waits for or holds alone: it waits
        too (else a stream of runs would keep the measurement, and its task, waiting for ever)."""
        return any(self._alone.get(p) and any(n.get(p, 0) for n in extra) for p in self.budgets)

    def usage(self, pool: str, extra: Optional[list[Needs]] = None, without: frozenset = frozenset()) -> int:
        holdings = [r.needs for k, r in self._refs.items() if k not in without] + [n for _, n in self._runs.values()]
        return _bytes(pool, holdings + (extra or []))

    def _fits(self, extra: list[Needs], without: frozenset = frozenset()) -> bool:
        return all(self.usage(p, extra, without) <= b for p, b in self.budgets.items())

    def too_large(self, task: str, needs: list[Needs], detail: str = "") -> Optional[TaskTooLarge]:
        """The first pool these needs exceed with nothing else admitted, if any."""
        for pool, budget in self.budgets.items():
            need = _bytes(pool, needs)
            if need > budget:
                return TaskTooLarge(task, pool, need, budget, detail)
        return None

    def admit(self, task: str, run: Needs, ref_key: Any = None, ref: Optional[Needs] = None,
              close_reference: Callable[[Any], None] = lambda key: None,
              check_aborted: Callable[[], None] = lambda: None) -> int:
        """Wait until ``run`` (and ``ref``, the reference's resident needs, unless that reference is
        admitted already) fit, closing idle references of other tasks, least recently used first.
        Returns a token for ``leave``. Raises ``TaskTooLarge`` when they cannot fit even alone."""
        alone = self.too_large(task, [run] + ([ref] if ref_key is not None and ref else []))
        if alone is not None:
            raise alone
        victims: list[Any] = []
        with self._cond:
            while True:
                check_aborted()
                extra = self._asked(run, ref_key, ref)
                if self._blocked(extra):
                    self._cond.wait(WAIT_POLL_S)
                    continue
                if self._fits(extra):
                    break
                idle = sorted((r.last_used, k) for k, r in self._refs.items() if r.users == 0 and k != ref_key)
                chosen: list[Any] = []
                for _, key in idle:
                    chosen.append(key)
                    if self._fits(extra, frozenset(chosen)):
                        break
                if chosen and self._fits(extra, frozenset(chosen)):
                    for key in chosen:
                        del self._refs[key]
                    victims = chosen
                    break
                self._cond.wait(WAIT_POLL_S)
            if ref_key is not None:
                entry = self._refs.setdefault(ref_key, _Reference(ref or {}))
                entry.users += 1
                entry.last_used = time.monotonic()
            token = next(self._tokens)
            self._runs[token] = (ref_key, run)
        for key in victims:           # their memory is counted free already: close before the run starts
            close_reference(key)
        return token

    def try_admit(self, task: str, run: Needs, ref_key: Any = None, ref: Optional[Needs] = None) -> Optional[int]:
        """``run`` (and ``ref``, as ``admit`` takes it) admitted now if it fits beside what is
        admitted (never waiting, closing nothing): a token for ``leave``, else None."""
        with self._cond:
            extra = self._asked(run, ref_key, ref)
            if self._blocked(extra) or not self._fits(extra):
                return None
            if ref_key is not None:
                entry = self._refs.setdefault(ref_key, _Reference(ref or {}))
                entry.users += 1
                entry.last_used = time.monotonic()
            token = next(self._tokens)
            self._runs[token] = (ref_key, run)
            return token

    @contextlib.contextmanager
    def alone(self, pool: str, check_aborted: Callable[[], None] = lambda: None) -> Iterator[int]:
        """Held while a task's footprint is measured on ``pool``: waits until no run there is
        admitted, and admits none (nor a reference) until the block ends. Idle references stay
        resident; yields how many there are (a measurement that ran out of memory beside them is
        no proof that its task is too large)."""
        with self._cond:
            self._alone[pool] = self._alone.get(pool, 0) + 1
            try:
                while True:
                    check_aborted()         # an interrupted run measures nothing more
                    if not any(n.get(pool, 0) for _, n in self._runs.values()):
                        break
                    self._cond.wait(WAIT_POLL_S)
            except BaseException:
                self._alone[pool] -= 1
                self._cond.notify_all()
                raise
            beside = sum(1 for r in self._refs.values() if r.needs.get(pool, 0) > 0)
        try:
            yield beside
        finally:
            with self._cond:
                self._alone[pool] -= 1
                self._cond.notify_all()

    def leave(self, token: int) -> None:
        with self._cond:
            ref_key, _ = self._runs.pop(token)
            entry = self._refs.get(ref_key)
            if entry is not None:
                entry.users -= 1
                entry.last_used = time.monotonic()
            self._cond.notify_all()

    def drop_reference(self, ref_key: Any) -> None:
        """A reference worker was closed: its resident bytes are free."""
        with self._cond:
            self._refs.pop(ref_key, None)
            self._cond.notify_all()

    def references(self) -> list[Any]:
        with self._cond:
            return list(self._refs)


# --------------------------------------------------------------------------- a sandbox's gate

class MemoryGate:
    """What a ``Sandbox`` asks: a task's footprint (measured once, alone on its slot), whether it
    fits at all, and admission of its runs and reference workers."""

    def __init__(self, device: str, slots: int, numerics: Any, book: Optional[FootprintBook] = None,
                 budgets: Optional[dict[str, int]] = None,
                 slot_env: Callable[[int], dict[str, str]] = lambda slot: {},
                 device_work: Optional[Callable[[int, str], ContextManager[Any]]] = None):
        """``device_work(slot, kind)``: the slot's gate for background work (``Sandbox``); without
        it every footprint is measured alone."""
        self.device, self.numerics = device, numerics
        self.book = book or FootprintBook()
        self.admission = Admission(budgets if budgets is not None else default_budgets(device, slots))
        self.slot_env = slot_env
        self.device_work = device_work
        self.context = env_bytes(CONTEXT_ENV, CUDA_CONTEXT_BYTES) if device == "cuda" else 0
        self._measuring: dict[str, threading.Lock] = {}
        self._beside: dict[str, threading.BoundedSemaphore] = {}

    def _device_pool(self, slot: int) -> str:
        return gpu_pool(slot) if self.device == "cuda" else "host"

    # ---- footprints into needs ---------------------------------------------------------
    def reference_needs(self, fp: Footprint, slot: int) -> Needs:
        needs: Needs = {self._device_pool(slot): self.context + fp.reference_resident_bytes}
        if self.device == "cuda":
            needs["host"] = WORKER_HOST_BYTES_CUDA
        return needs

    def run_needs(self, fp: Footprint, slot: int) -> Needs:
        """A run: its candidate worker at its peak, and its reference's trial peak above what the
        reference holds between trials (that is admitted with the reference itself)."""
        ours = fp.reference_trial_bytes + max(fp.candidate_peak_bytes, fp.candidate_resident_bytes)
        if self.device == "cuda":
            return {gpu_pool(slot): self.context + ours,
                    "host": WORKER_HOST_BYTES_CUDA + fp.host_transit_bytes, "shm": fp.shm_bytes}
        # on cpu a candidate worker's process costs about what the reference's did before its model
        base = max(0, fp.reference_resident_bytes - fp.params_bytes - fp.fp64_bytes)
        return {"host": base + ours, "shm": fp.shm_bytes}

    # ---- what the sandbox asks -----------------------------------------------------------
    def footprint(self, spec: Any, slot: int = 0,
                  check_aborted: Callable[[], None] = lambda: None,
                  close_reference: Callable[[Any], None] = lambda key: None) -> Footprint:
        """The task's footprint, measured (once) with the slot to itself when not known yet."""
        pool = self._device_pool(slot)

        def measure() -> Footprint:
            fp = self._measured_beside(spec, slot, check_aborted, close_reference)
            if fp is not None:
                return fp
            with self._measuring.setdefault(pool, threading.Lock()):    # one measurement per device at a time
                with self.admission.alone(pool, check_aborted) as beside:
                    fp = self.book.measure(spec, self.device, self.numerics, env=self.slot_env(slot))
                # A run interrupted while measuring kills the measuring worker too (SIGKILL, which
                # reads as the OOM killer's): that death is the interruption's, never the task's
                # size, and nothing of it is kept (before this, an interrupted run stored the task
                # as too_large and --resume skipped it).
                check_aborted()
                if fp.oom is None or not beside:
                    return fp
                # out of memory beside idle references: measured again with the device to itself
                whole = {pool: self.admission.budgets[pool]}
                token = self.admission.admit(spec.name, whole, close_reference=close_reference,
                                             check_aborted=check_aborted)
                try:
                    fp = self.book.measure(spec, self.device, self.numerics, env=self.slot_env(slot))
                finally:
                    self.admission.leave(token)
                check_aborted()
                return fp

        return self.book.get(spec, self.device, self.numerics, measure)

    def _measured_beside(self, spec: Any, slot: int, check_aborted: Callable[[], None],
                         close_reference: Callable[[Any], None]) -> Optional[Footprint]:
        """The footprint measured beside running work (see the module's notes), or None where it
        must be measured alone: off cuda, without a gate, switched off, or where the measurement
        ran out of memory under its cap or reached it."""
        if self.device != "cuda" or self.device_work is None or os.environ.get(BESIDE_ENV, "1") == "0":
            return None
        pool = gpu_pool(slot)
        cap = int(BESIDE_SHARE * self.admission.budgets[pool]) - self.context
        if cap <= 0:
            return None
        with self._beside.setdefault(pool, threading.BoundedSemaphore(BESIDE_AT_ONCE)):
            token = self.admission.admit(f"{spec.name} (measuring its footprint)",
                                         {pool: self.context + cap, "host": WORKER_HOST_BYTES_CUDA},
                                         close_reference=close_reference, check_aborted=check_aborted)
            try:
                fp = self.book.measure(spec, self.device, self.numerics, env=self.slot_env(slot),
                                       beside=Beside(cap, lambda: self.device_work(slot, "footprint")))
            finally:
                self.admission.leave(token)
        check_aborted()
        return fp if fp.oom is None and not fp.cap_reached else None

    def plan(self, spec: Any, fp: Footprint, slot: int = 0) -> tuple[Footprint, bool]:
        """(the footprint the task's runs are admitted with, whether its float64 check runs).
        A task that fits only without the float64 copy and run (level1/19_ReLU's 6 GiB of
        inputs on an 80 GB GPU) runs without them, judged by the tolerance alone, as KernelBench
        judges it; one that fits either way keeps the check. On the GPU, one that does not fit
        even then keeps its candidate's copy of the inputs for the mutation check in host memory
        (``Footprint.with_inputs_copy_on_host``: the same check, one input set less on the
        device): by the footprints measured on an 80 GB H100, that takes level1/38_L1Norm_ and
        39_L2Norm_ from 74.07 GiB to 66.07, 45_Average_Pooling_2D from 82.59 to 66.59 and
        76_conv_standard_1D_dilated_strided__ from 78.84 to 70.84, against 72.84 available."""
        fp64 = bool(getattr(self.numerics, "fp64_check", False))
        if fp64 and self._too_large_as(spec, fp, slot) is None:
            return fp, True
        # fits without them, or not at all: then its too_large names the least it would need
        # (on an H100, level1/25_Swish said 111 GiB, its need with the float64 copy; without it, 87)
        lean = fp.without_fp64() if fp64 else fp
        if self.device == "cuda" and self._too_large_as(spec, lean, slot) is not None:
            return lean.with_inputs_copy_on_host(), False
        return lean, False

    def candidate_share(self, spec: Any, slot: int = 0) -> int:
        """Device bytes a run admits its candidate worker for (its context and estimated peak);
        0 off cuda or where the footprint is not known."""
        fp = self.book.known(spec, self.device, self.numerics)
        if self.device != "cuda" or fp is None:
            return 0
        return self.context + self.plan(spec, fp, slot)[0].candidate_peak_bytes

    def fp64_runs(self, spec: Any, slot: int = 0) -> bool:
        """Whether the task's float64 check runs (its footprint is measured first if not known)."""
        return self.plan(spec, self.footprint(spec, slot), slot)[1]

    def too_large(self, spec: Any, fp: Footprint, slot: int = 0) -> Optional[TaskTooLarge]:
        """Why the task cannot run even alone (without the float64 check where that is what does
        not fit), or None."""
        return self._too_large_as(spec, self.plan(spec, fp, slot)[0], slot)

    def _too_large_as(self, spec: Any, fp: Footprint, slot: int = 0) -> Optional[TaskTooLarge]:
        needs = [self.reference_needs(fp, slot), self.run_needs(fp, slot)]
        found = self.admission.too_large(spec.name, needs)
        if fp.oom is None:
            return found
        pool = self._device_pool(slot)
        need = found.needed if found is not None else self.admission.budgets[pool] + 1
        return TaskTooLarge(spec.name, found.pool if found else pool, need,
                            found.available if found else self.admission.budgets[pool],
                            f"at least: the measurement ran out of memory: {fp.oom}"[:600])

    def admit(self, spec: Any, slot: int, close_reference: Callable[[Any], None],
              check_aborted: Callable[[], None] = lambda: None) -> int:
        """Wait until a run of ``spec`` on ``slot`` (and its reference there) fits; a token for ``leave``."""
        fp = self.footprint(spec, slot, check_aborted, close_reference)
        big = self.too_large(spec, fp, slot)
        if big is not None:
            raise big
        fp = self.plan(spec, fp, slot)[0]
        return self.admission.admit(spec.name, self.run_needs(fp, slot), (spec.key, slot),
                                    self.reference_needs(fp, slot), close_reference, check_aborted)

    def try_admit_reference(self, spec: Any, slot: int) -> Optional[int]:
        """Room to start the task's reference on ``slot`` ahead of its first run (``Sandbox.prepare``),
        now, beside what is admitted and closing nothing: a token for ``leave`` once it has
        started (the reference then stays admitted, idle, as after a run), else None. While it
        starts it also holds its trial's transient bytes (the warm-up compile's workspace)."""
        fp = self.book.known(spec, self.device, self.numerics)
        if fp is None or self.too_large(spec, fp, slot) is not None:
            return None
        fp = self.plan(spec, fp, slot)[0]
        starting = {self._device_pool(slot): fp.reference_trial_bytes}
        return self.admission.try_admit(spec.name, starting, (spec.key, slot), self.reference_needs(fp, slot))

    def hold_ahead(self, spec: Any, slot: int) -> Optional[int]:
        """Room for the reference to compute a trial's outputs ahead and keep them until the
        trial (``sandbox.reference.Precomputed``), beside whatever runs meanwhile: its transient
        bytes, held until ``leave``. None where they do not fit now (or the task's
        footprint is unknown)."""
        fp = self.book.known(spec, self.device, self.numerics)
        if fp is None:
            return None
        fp = self.plan(spec, fp, slot)[0]
        return self.admission.try_admit(f"{spec.name} (computed ahead)",
                                        {self._device_pool(slot): fp.reference_trial_bytes})

    def leave(self, token: int) -> None:
        self.admission.leave(token)

    def forget_reference(self, key: Any) -> None:
        self.admission.drop_reference(key)
