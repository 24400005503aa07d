"""Whose failure is it: the one place that tells a candidate's failure from the harness's.

A candidate that crashes, hangs, exits, exhausts memory in its own code or cheats costs
exactly its own attempt (``runtime_error``, ``timeout``, ...). A failure of the harness —
the trusted reference worker died or failed, a worker died before the candidate's code ran,
the harness's own buffers (inputs, their copies, saved outputs) found no memory or no room on
the outputs' file system — is not a verdict: ``Sandbox.evaluate`` retries it a bounded number
of times with fresh workers, then stores ``infra_error`` with its cause, which metrics,
the model's feedback and the critic leave out and ``optimize --resume`` evaluates again.

Trust: the reference worker never runs candidate code, so its failures are the harness's.
The candidate worker says when it is about to run candidate code (the ``candidate_code``
event, sent on the socket before the candidate's module executes: once sent, nothing the
candidate does can take it back); a death before that event is the harness's, one after it
is the candidate's, whatever the exit code (``os._exit(0)`` included). A harness step that
fails inside the candidate's process after its code ran is the harness's only when it ran out
of memory or disk space while the process held no more than the harness's own buffers need
(``RESOURCE_SLACK`` over them); anything else is the candidate's, as before. The candidate's own
code running out of device memory is the harness's when the candidate could not have had the
memory it was admitted for (``candidate_oom``): other processes held more than theirs.
"""
from __future__ import annotations

import errno
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

MAX_INFRA_RETRIES = 2                 # an evaluation runs at most 1 + this many times
RESOURCE_SLACK = 1 << 30              # what a candidate process may hold beyond the harness's buffers
STDERR_LINES = 8

_OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "memoryerror",
              "outofmemoryerror", "failed to allocate", "std::bad_alloc")
_DISK_WORDS = ("no space left on device", "disk quota exceeded", "file too large")


class WorkerDied(Exception):
    """A worker process ended, or could not be used, before it answered."""

    def __init__(self, message: str, returncode: Optional[int], role: Optional[str] = None):
        super().__init__(message)
        self.returncode = returncode
        self.role = role                # whose worker: sandbox.failures tells infra from candidate by it


class WorkerTimeout(Exception):
    """A worker did not answer in time."""

    def __init__(self, message: str, role: Optional[str] = None):
        super().__init__(message)
        self.role = role


class InfraFailure(Exception):
    """A failure of the harness, not of the candidate; ``cause`` says what happened."""

    def __init__(self, cause: str, error_type: str = "InfraError"):
        super().__init__(cause)
        self.cause, self.error_type = cause, error_type


@dataclass
class Verdict:
    """How a failure is recorded: ``infra`` (retried, then ``infra_error``) or the candidate's."""

    infra: bool
    error_type: str
    message: str


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "did not exit (still running)"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def resource_exhausted(error_type: Optional[str], message: Optional[str], err_no: Optional[int] = None) -> Optional[str]:
    """'memory' or 'disk' when an error says the process ran out of either, else None."""
    if err_no in (errno.ENOMEM,):
        return "memory"
    if err_no in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "disk"
    text = f"{error_type or ''}: {message or ''}".lower()
    if any(w in text for w in _OOM_WORDS):
        return "memory"
    if any(w in text for w in _DISK_WORDS):
        return "disk"
    return None


def oom_kills() -> Optional[int]:
    """The OOM killer's count for this process's memory cgroup (v2 or v1), where readable."""
    candidates = [Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control")]
    try:
        rel = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::") or ":memory:" in line), "/").strip()
        if rel not in ("", "/"):
            candidates[:0] = [Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.events",
                              Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / "memory.oom_control"]
    except (OSError, StopIteration):
        pass
    for path in candidates:
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def stderr_tail(text: str, lines: int = STDERR_LINES) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept)[-1500:]


def exit_cause(worker: Any, code: Optional[int]) -> str:
    """Why a worker went away, in words: exit code or signal, out-of-memory evidence, and the
    last lines of its stderr (``worker`` is a ``sandbox.process.WorkerProcess``)."""
    parts = [f"the {worker.role} worker {describe_exit(code)}"]
    if getattr(worker, "stopped", None):
        parts[0] += f": the sandbox ended it ({worker.stopped})"
    tail = stderr_tail(worker.output("stderr"))
    before, now = getattr(worker, "oom_kills_at_start", None), oom_kills()
    if code == -signal.SIGKILL and before is not None and now is not None and now > before:
        parts.append(f"the kernel's OOM killer ran ({now - before} kill(s) in this memory cgroup since the worker started)")
    elif resource_exhausted(None, tail) == "memory":
        parts.append("out of memory (its stderr says so)")
    cause = "; ".join(parts)
    return f"{cause}; last stderr lines:\n{tail}" if tail else f"{cause}; its stderr is empty"


def _process_held(reply: dict[str, Any]) -> tuple[int, int]:
    return int(reply.get("memory_held") or 0), int(reply.get("harness_bytes") or 0)


def candidate_reply(reply: dict[str, Any]) -> Optional[Verdict]:
    """A failed reply of the candidate worker: None where the failure is the candidate's (the
    caller records it as before), a Verdict with ``infra`` where the harness's own step ran out
    of memory or disk space in a process that held no more than the harness's buffers need."""
    if not reply.get("harness_error"):
        return None
    kind = resource_exhausted(reply.get("error_type"), reply.get("error_message"), reply.get("errno"))
    if kind is None:
        return None
    held, need = _process_held(reply)
    if kind == "memory" and held > need + RESOURCE_SLACK:
        return None                 # the candidate's process holds the memory: its own doing
    where = reply.get("harness_step") or "a harness step"
    return Verdict(True, "InfraError",
                   f"the harness ran out of {kind} while {where} in the candidate's worker "
                   f"({reply.get('error_type')}: {str(reply.get('error_message'))[:300]}; the process held "
                   f"{held / 2**30:.2f} GiB, the harness's buffers need {need / 2**30:.2f} GiB)")


def candidate_oom(reply: dict[str, Any], share: int) -> Optional[Verdict]:
    """A candidate's own code that ran out of device memory where it could not have had its
    admitted ``share`` (``MemoryGate.candidate_share``): what it held plus what the device had
    free was less, so other processes held more than they were admitted for. The harness's
    failure, retried; None where the candidate had its share (its own excess) or the figures
    are missing."""
    if share <= 0 or reply.get("harness_error") or "device_free" not in reply:
        return None
    if resource_exhausted(reply.get("error_type"), reply.get("error_message")) != "memory":
        return None
    held, free = int(reply.get("memory_held") or 0), int(reply["device_free"])
    if held + free + RESOURCE_SLACK >= share:
        return None
    return Verdict(True, "InfraError",
                   f"the candidate ran out of device memory holding {held / 2**30:.2f} GiB with "
                   f"{free / 2**30:.2f} GiB free, less than the {share / 2**30:.2f} GiB it was admitted for: "
                   f"other processes held more than theirs ({reply.get('error_type')}: "
                   f"{str(reply.get('error_message'))[:200]})")


def classify(exc: BaseException, candidate_worker: Any = None) -> Verdict:
    """An exception that ended an evaluation's run phase: infra or the candidate's."""
    if isinstance(exc, InfraFailure):
        return Verdict(True, exc.error_type, exc.cause)
    if isinstance(exc, WorkerDied):
        role = getattr(exc, "role", None)
        if role in ("candidate", "build") and candidate_worker is not None \
                and "candidate_code" not in candidate_worker.events:
            return Verdict(True, "WorkerDied", f"{exc}, before the candidate's code ran")
        if role == "reference":
            return Verdict(True, "ReferenceDied", str(exc))
        return Verdict(False, "WorkerDied", str(exc))
    if isinstance(exc, WorkerTimeout):
        return Verdict(getattr(exc, "role", None) == "reference", "Timeout", str(exc))
    raise TypeError(f"not a failure of an evaluation: {exc!r}")
