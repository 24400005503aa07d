"""The trusted side of an evaluation: the reference worker of a task on one slot."""
from __future__ import annotations

import threading
from typing import Any, Optional

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
        self.proc: Optional[WorkerProcess] = None
        self.profile: Optional[list[dict]] = None
        self.counts: Optional[dict] = None
        self.device_name = ""
        self.broken = False             # set after a harness failure: the next evaluation starts afresh

    def ensure(self) -> WorkerProcess:
        """The running worker (started where there is none, or afresh after a harness failure)."""
        if self.broken:
            self.broken = False
            self.discard()
        return self._started()

    def _started(self) -> WorkerProcess:
        if self.proc is not None and self.proc.proc.poll() is None:
            return self.proc
        self.proc = WorkerProcess("reference", env=self.env)
        reply = self.proc.ask({"role": "reference", "device": self.device, "out_dir": str(self.proc.out_dir),
                               "task": self.spec.__dict__, "init_seed": self.init_seed,
                               "warm_compile": self.warm_compile,
                               "numerics": self.numerics.model_dump(mode="json")}, REFERENCE_TIMEOUT_S)
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
        reply = self._started().ask(payload, timeout)
        if not reply.get("ok"):
            raise ReferenceFailed(f"the reference of {self.spec.name} failed: {_reply_cause(reply)}")
        return reply

    def discard(self) -> None:
        """Kill the worker after a failure: the next ``ensure`` starts a fresh one."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.cleanup()
            self.proc = None
        self.profile = self.counts = None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc.cleanup()
            self.proc = None
