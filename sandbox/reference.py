"""The trusted side of an evaluation: the reference worker of a task on one slot."""
from __future__ import annotations

import secrets
import threading
from typing import Any, Callable, ContextManager, Optional

from sandbox.failures import InfraFailure, resource_exhausted
from sandbox.numerics import Numerics
from sandbox.process import WorkerProcess
from sandbox.tasks import TaskSpec

REFERENCE_TIMEOUT_S = 900.0


class ReferenceFailed(InfraFailure, RuntimeError):
    """The trusted reference failed (not the candidate's doing: ``sandbox.failures``)."""

    def __init__(self, cause: str):
        super().__init__(cause, "ReferenceFailed")


class TaskFailed(RuntimeError):
    """The task itself cannot run: its reference raised while loading for a reason other than
    running out of memory or disk (bad task file, unsupported op). Neither the candidate's fault
    nor a passing harness failure: no retry, the task stops with this cause."""


def _reply_cause(reply: dict[str, Any]) -> str:
    where = f" while {reply['harness_step']}" if reply.get("harness_step") else ""
    return f"{reply.get('error_type') or 'error'}{where}: {reply.get('error_message', 'unknown error')}"


class ReferenceWorker:
    """The trusted side of an evaluation: one persistent worker per task (and sizes)."""

    def __init__(self, spec: TaskSpec, device: str, init_seed: int, warm_compile: bool = False,
                 env: Optional[dict[str, str]] = None, numerics: Optional[Numerics] = None):
        self.spec, self.device, self.init_seed = spec, device, init_seed
        self.numerics = numerics or Numerics()
        self.warm_compile = warm_compile
        self.env = env or {}
        self.lock = threading.Lock()
        # one request at a time on the worker's socket (a precompute may come from another thread)
        self._io = threading.RLock()
        self.proc: Optional[WorkerProcess] = None      # the worker with its task loaded
        self._spawned: Optional[WorkerProcess] = None  # started and imported, its task not yet loaded (spawn)
        self.profile: Optional[list[dict]] = None
        self.counts: Optional[dict] = None
        self.device_name = ""
        self.broken = False             # set after a harness failure: the next evaluation starts afresh

    def ensure(self, device_turns: Optional[Callable[[], ContextManager[Any]]] = None) -> WorkerProcess:
        """The running worker (started where there is none, or afresh after a harness failure).
        ``device_turns``: the slot's gate, which a starting worker asks for in turns (held while
        the reference runs on the device, not while torch.compile generates code:
        ``sandbox.warm_compile``); without it the caller holds the gate around the start."""
        if self.broken:
            self.broken = False
            self.discard()
        return self._started(device_turns)

    def needs_start(self) -> bool:
        """Whether ``ensure`` would start a worker (and so run the reference on the device)."""
        return self.broken or not self._alive()

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None

    def _started(self, device_turns: Optional[Callable[[], ContextManager[Any]]] = None) -> WorkerProcess:
        if self._alive():
            return self.proc
        with self._io:
            return self._start(device_turns)

    def spawn(self) -> None:
        """The worker's process started and its imports (Python, torch: 3-5 s of a 15-19 s start on a
        loaded GPU host) waited for, with no task loaded and nothing on the device, so that the
        caller takes the slot's gate for the load alone, in turns (``Sandbox._start_reference``); ``ensure`` loads
        the task into this process. Best effort: a process that fails here is replaced there."""
        with self._io:
            if self._alive() or self.broken or (self._spawned is not None and self._spawned.proc.poll() is None):
                return
            proc = self._spawned = WorkerProcess("reference", env=self.env)
            try:
                proc.recv(REFERENCE_TIMEOUT_S, until_event="imported")
            except Exception:  # noqa: BLE001 - WorkerDied, WorkerTimeout: ensure starts afresh and says why
                self._spawned = None
                proc.kill()
                proc.cleanup()

    def _start(self, device_turns: Optional[Callable[[], ContextManager[Any]]] = None) -> WorkerProcess:
        if self._alive():
            return self.proc
        proc, self._spawned = self._spawned, None
        if proc is None or proc.proc.poll() is not None:
            if proc is not None:
                proc.kill()
                proc.cleanup()
            proc = WorkerProcess("reference", env=self.env)
        self.proc = proc
        reply = self.proc.ask({"role": "reference", "device": self.device, "out_dir": str(self.proc.out_dir),
                               "task": self.spec.__dict__, "init_seed": self.init_seed,
                               "warm_compile": self.warm_compile,
                               "numerics": self.numerics.model_dump(mode="json")}, REFERENCE_TIMEOUT_S,
                              device_turns=device_turns)
        if not reply.get("ok"):
            self.proc.kill()
            self.proc = None
            cause = f"the reference of {self.spec.name} failed to load: {_reply_cause(reply)}"
            if resource_exhausted(reply.get("error_type"), reply.get("error_message"), reply.get("errno")) is None:
                raise TaskFailed(cause)
            raise ReferenceFailed(cause)
        self.device_name = reply.get("device_name", "")
        return self.proc

    def ask(self, payload: dict[str, Any], timeout: float = REFERENCE_TIMEOUT_S) -> dict[str, Any]:
        with self._io:
            reply = self._started().ask(payload, timeout)
        if not reply.get("ok"):
            raise ReferenceFailed(f"the reference of {self.spec.name} failed: {_reply_cause(reply)}")
        return reply

    def discard(self) -> None:
        """Kill the worker after a failure: the next ``ensure`` starts a fresh one."""
        if self.proc is not None:
            self.proc.stopped = "reference restarted after a harness failure in an evaluation of its task"
            self.proc.kill()
            self.proc.cleanup()
            self.proc = None
        self.profile = self.counts = None

    def ask_if_running(self, payload: dict[str, Any], timeout: float = REFERENCE_TIMEOUT_S) -> dict[str, Any]:
        """``ask``, but never (re)starts the worker: background work for a reference that was
        stopped (a released task) or died is not worth a new one."""
        with self._io:
            proc = self.proc
            if proc is None or proc.proc.poll() is not None:
                return {"ok": False, "error_message": "the reference worker is not running"}
            return proc.ask(payload, timeout)

    def close(self, why: str = "its task ended, or its memory was needed by another task's run") -> None:
        spawned, self._spawned = self._spawned, None
        if spawned is not None:
            spawned.kill()
            spawned.cleanup()
        if self.proc is not None:
            self.proc.close(why=f"reference closed: {why}")
            self.proc.cleanup()
            self.proc = None


class Precomputed:
    """The reference's outputs of one candidate's trial 0, computed ahead (while the candidate
    loads) for a seed the parent drew for that candidate alone: secret until the trial, when
    the candidate gets it like any trial's seed.

    Computed ahead, they take device memory beside another candidate's trials on the slot, and
    stay kept in the reference until trial 0: ``hold`` (``MemoryGate.hold_ahead``) admits that
    memory or says it does not fit (then nothing is computed ahead and trial 0 runs as any
    trial), and ``release`` gives it back once the outputs are used or discarded. Without this,
    KernelBench's level-1 tasks at published sizes ran out of GPU memory on an H100 with
    references of other tasks computing ahead beside a candidate's trials."""

    def __init__(self, ref: ReferenceWorker, fp64: bool, gate: Any = None,
                 hold: Optional[Callable[[], Optional[int]]] = None, release: Callable[[int], None] = lambda t: None):
        self.ref, self.fp64 = ref, fp64
        self.seed = secrets.randbits(31)
        self.token = secrets.token_hex(8)
        self.kept = False
        self.used = False
        self.note: Optional[str] = None
        self._release, self._held = release, None
        self._released = threading.Lock()
        self._done = threading.Event()
        self._gate, self._abandon = gate, threading.Event()
        if hold is not None:
            self._held = hold()
            if self._held is None:
                self.note = "not computed ahead: its memory does not fit beside the runs admitted on the device"
                self._done.set()
                return
        self._thread = threading.Thread(target=self._run, daemon=True, name="precompute")
        self._thread.start()

    def _give_back(self) -> None:
        with self._released:
            held, self._held = self._held, None
        if held is not None:
            self._release(held)

    def _run(self) -> None:
        try:
            if self._gate is not None:
                with self._gate.background(abandon=self._abandon, kind="precompute") as held:
                    reply = self._ask() if held.entered else {"ok": True, "skipped": "its trial came first"}
            else:
                reply = self._ask()
            self.kept = bool(reply.get("ok")) and not reply.get("skipped")
            self.note = reply.get("skipped") or (None if reply.get("ok") else reply.get("error_message"))
        except Exception as exc:  # noqa: BLE001 - the trial then runs as without a precompute
            self.note = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if not self.kept:
                self._give_back()
            self._done.set()

    def _ask(self) -> dict[str, Any]:
        return self.ref.ask_if_running({"op": "precompute", "seed": self.seed, "token": self.token, "fp64": self.fp64,
                             "output_bytes": 0})

    def wait(self, timeout: float = REFERENCE_TIMEOUT_S) -> bool:
        """Whether the outputs are kept (after the computation ends, however it ends). One still
        waiting at the device gate (behind a timing) is abandoned, not waited for, and its trial
        runs as any trial: the caller holds the slot, and a timing waiting at the gate may be
        waiting for that slot (``DeviceGate``)."""
        if self._gate is not None:
            self._abandon.set()
            self._gate.wake()
        self._done.wait(timeout)
        return self._done.is_set() and self.kept

    def request(self, ask: dict[str, Any]) -> dict[str, Any]:
        """Trial 0's reference request: the kept outputs (or, if none are, computed as always)."""
        self.used = True
        return {**ask, "seed": self.seed, "precomputed": self.token}

    def discard(self) -> None:
        """Free the kept outputs of a candidate that never reached trial 0 (now, or once
        computed), and the memory held for them; after trial 0 used them, only the memory."""
        if self.used:
            self._give_back()
            return
        if self._done.is_set():
            self._send_discard()
        else:
            threading.Thread(target=self._send_discard, daemon=True, name="precompute-discard").start()

    def _send_discard(self) -> None:
        try:
            if not self.wait() or self.used:
                return
            try:
                self.ref.ask_if_running({"op": "discard", "token": self.token}, 60.0)
            except Exception:  # noqa: BLE001
                pass
        finally:
            self._give_back()
