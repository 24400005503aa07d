"""A sandbox worker process as seen from the parent: start, ask, kill.

Each worker gets a fresh temporary working directory, its stdout and stderr in files
(capped when read back), a private socket for requests and replies, its own process
group (so a kill takes its compilers and ninja with it), and optional memory limits.

Every worker runs under a keeper (``sandbox.keeper``): a process the worker cannot leave behind,
through which every process the worker starts, detached or not, is found and killed. ``sweep``
kills a candidate's strays while its worker is idle; ``kill`` kills the whole tree. What either
killed besides the worker is returned by ``sweep`` and kept in ``strays`` by ``kill`` (the
evaluation flags both).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

from sandbox.failures import WorkerDied, WorkerTimeout, exit_cause, oom_kills  # noqa: F401 - raised here, imported from here

OUTPUT_CAP = 10_000
_REPO_ROOT = Path(__file__).resolve().parent.parent


# Outputs cross from a candidate worker to the reference worker as files: on a memory-backed
# file system where one has room (a gigabyte-sized output is written and read in a fraction of
# the time a disk takes), else next to the worker's working directory.
OUTPUTS_ENV = "KERNELLOOP_OUTPUTS_DIR"
_SHM = Path("/dev/shm")
_SHM_MIN_FREE = 16 << 30


def outputs_root() -> Optional[str]:
    """Where workers' output folders go: $KERNELLOOP_OUTPUTS_DIR, else /dev/shm if it is writable
    and has 16 GiB free, else None (the system's temporary folder)."""
    chosen = os.environ.get(OUTPUTS_ENV)
    if chosen:
        return chosen
    try:
        import shutil

        if _SHM.is_dir() and os.access(_SHM, os.W_OK) and shutil.disk_usage(_SHM).free >= _SHM_MIN_FREE:
            return str(_SHM)
    except OSError:
        pass
    return None


_LIVE: "weakref.WeakSet[WorkerProcess]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
# Pids of workers (and keepers) this process started, the newest last, remembered past their end:
# NVML lists a worker for a moment after it left this process's tree, while the driver tears its
# CUDA context down (``sandbox.quiet``), whether the sandbox ended it or it ended by itself (a
# reference closed, a candidate that crashed).
_STARTED: "collections.deque[int]" = collections.deque(maxlen=1024)


def _remember(*pids: Optional[int]) -> None:
    with _LIVE_LOCK:
        _STARTED.extend(p for p in pids if p and p not in _STARTED)


def worker_pids() -> frozenset[int]:
    """The pids of the workers (and keepers) this process started, alive or ended (the last 1024)."""
    with _LIVE_LOCK:
        return frozenset(_STARTED)


def kill_all_workers() -> int:
    """SIGKILL every worker this process started that still runs (an interrupted run must not
    wait minutes for evaluations in flight); their pending ``ask`` raises ``WorkerDied``."""
    with _LIVE_LOCK:
        workers = list(_LIVE)
    killed = 0
    for w in workers:
        if w.proc.poll() is None:
            w.stopped = w.stopped or "the run was interrupted"
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                w.proc.kill()
            killed += 1
    return killed


class WorkerProcess:
    def __init__(self, role: str, hide_gpu: bool = False, memory_limit_mb: Optional[int] = None,
                 env: Optional[dict[str, str]] = None, nice: int = 0):
        """``nice``: added to the worker's niceness (and so its compilers'), before it runs."""
        self.role = role
        self.device_share = 0       # device bytes its run admitted it for (sandbox.failures.candidate_oom)
        self.stopped: Optional[str] = None      # why the sandbox itself ended it (close, kill): its exit's cause
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kl-{role}-"))
        self.out_dir = Path(tempfile.mkdtemp(prefix=f"kl-{role}-out-", dir=outputs_root()))
        parent_sock, child_sock = socket.socketpair()
        self._stdout = open(self.workdir / "stdout.txt", "wb")
        self._stderr = open(self.workdir / "stderr.txt", "wb")
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT)] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        child_env["PYTHONUNBUFFERED"] = "1"
        if "TORCHINDUCTOR_CACHE_DIR" not in child_env:
            from kernelloop.paths import cache_dir

            child_env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
        if hide_gpu:
            child_env["CUDA_VISIBLE_DEVICES"] = ""
        if role in ("build", "candidate", "reference"):
            # inductor compiles in-process: a pool of compile workers would be processes left
            # running by a candidate that uses torch.compile, which the keeper kills as strays;
            # and a reference's warm-up compile started one compile worker per core (each importing
            # torch and Triton): at a run's start ten references made 160 such processes on 16
            # cores, beside the builds and warm-ups. The compiled code is the same either way.
            child_env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        child_env.update(env or {})
        preexec = None
        if memory_limit_mb or nice:
            limit = int(memory_limit_mb or 0) << 20

            def preexec() -> None:  # runs in the child before exec
                import resource

                if limit:
                    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                if nice:
                    os.nice(nice)
        keeper_sock, keeper_child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.keeper", str(keeper_child.fileno()), "--",
             sys.executable, "-m", "sandbox.worker", str(child_sock.fileno())],
            cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=self._stdout, stderr=self._stderr,
            pass_fds=(child_sock.fileno(), keeper_child.fileno()), env=child_env, start_new_session=True,
            preexec_fn=preexec)
        _remember(self.proc.pid)
        child_sock.close()
        keeper_child.close()
        self.conn = Connection(os.dup(parent_sock.fileno()))
        parent_sock.close()
        self.keeper = Connection(os.dup(keeper_sock.fileno()))
        keeper_sock.close()
        self._keeper_lock = threading.Lock()
        self._kill_lock = threading.Lock()        # kill() from two threads closes each descriptor once
        self.worker_pid: Optional[int] = None     # the worker under the keeper (``proc`` is the keeper)
        self.containment: Optional[str] = None    # cgroup | subreaper | none, once the keeper said
        self.cgroup_path: Optional[str] = None    # the worker's cgroup, where it has one
        self.strays: list[str] = []               # processes killed besides the worker, described
        self.keeper_lost = False                  # the keeper went away without accounting for the tree
        self.busy = False                         # a request is in flight (a kill now is mid-request)
        self._hello()
        self.started = time.monotonic()
        self.events: list[str] = []     # what the worker said it is doing (sandbox.failures)
        self.oom_kills_at_start = oom_kills()
        with _LIVE_LOCK:
            _LIVE.add(self)

    # ---- the keeper
    def _hello(self, timeout: float = 60.0) -> None:
        """The keeper's first message: the worker's pid and how it is contained. A keeper that
        fails to start says nothing; the worker's death is then read as before."""
        with self._keeper_lock:
            try:
                if not self.keeper.poll(timeout):
                    return
                msg = json.loads(self.keeper.recv_bytes().decode())
            except (EOFError, OSError, ValueError):
                return
            if isinstance(msg, dict) and msg.get("event") == "hello":
                self.worker_pid, self.containment = msg.get("pid"), msg.get("mode")
                self.cgroup_path = msg.get("cgroup")
                _remember(self.worker_pid)

    def _keeper_message(self, timeout: float) -> Optional[dict[str, Any]]:
        """The keeper's next message; None where it said nothing in time or is gone."""
        try:
            if not self.keeper.poll(timeout):
                return None
            msg = json.loads(self.keeper.recv_bytes().decode())
        except (EOFError, OSError, ValueError):
            return None
        if not isinstance(msg, dict):
            return None
        if msg.get("event") == "hello":
            self.worker_pid, self.containment = msg.get("pid"), msg.get("mode")
            self.cgroup_path = msg.get("cgroup")
            _remember(self.worker_pid)
            return self._keeper_message(timeout)
        return msg

    def _keeper_ask(self, payload: dict[str, Any], timeout: float) -> Optional[dict[str, Any]]:
        """Ask the keeper; its reply, or None where it is gone (then killed by its group)."""
        if self.keeper.closed:
            return None
        with self._keeper_lock:
            try:
                self.keeper.send_bytes(json.dumps(payload).encode())
            except OSError:
                return self._keeper_gone()
            while True:
                msg = self._keeper_message(timeout)
                if msg is None:
                    return self._keeper_gone()
                if msg.get("event") == "exit":          # the worker died meanwhile: its strays
                    self.strays.extend(str(k) for k in msg.get("killed") or [])
                    return {"killed": []}
                return msg

    def _keeper_gone(self) -> None:
        """The keeper neither answered nor said the worker exited: it was killed or hangs, and the
        worker's detached processes may have escaped (the caller kills the keeper's group)."""
        self.keeper_lost = True
        return None

    def sweep(self, timeout: float = 30.0) -> list[str]:
        """Kill every process of this worker's tree but the (idle) worker: the strays it killed."""
        reply = self._keeper_ask({"op": "sweep"}, timeout)
        return [str(k) for k in (reply or {}).get("killed") or []]

    def end(self, idle: bool, timeout: float = 10.0) -> None:
        """Kill the worker and its whole tree (the keeper counts the strays), then the keeper's group."""
        if self.proc.poll() is None:
            reply = self._keeper_ask({"op": "end", "idle": idle}, timeout)
            if reply is not None:
                self.strays.extend(str(k) for k in reply.get("killed") or [])
        else:
            self._read_exit()
        if self._wait_exit(2.0) is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self._wait_exit(10.0)
        if self.keeper_lost and self.cgroup_path:
            # the keeper could not clean up after itself: its cgroup still holds whatever escaped
            from sandbox.containment import Cgroup

            group = Cgroup(Path(self.cgroup_path))
            group.kill()
            group.remove()

    def _read_exit(self) -> None:
        """The keeper's account of a worker that exited by itself (what it killed after it)."""
        with self._keeper_lock:
            while not self.keeper.closed:
                msg = self._keeper_message(0.5)
                if msg is None:
                    self.keeper_lost = True     # gone without its account: killed
                    break
                if msg.get("event") == "exit":
                    self.strays.extend(str(k) for k in msg.get("killed") or [])
                    break

    # ---- requests
    def send(self, payload: dict[str, Any]) -> None:
        self.busy = True
        try:
            self.conn.send_bytes(json.dumps(payload).encode())
        except OSError as exc:
            code = self._wait_exit(1.0)
            raise WorkerDied(f"{exit_cause(self, code)} (sending to it failed: {exc})", code, self.role) from None

    def recv(self, timeout: float, until_event: Optional[str] = None) -> dict[str, Any]:
        """The worker's next answer; notes (``{"event": ...}``) on the way are kept in ``events``.
        ``until_event``: return that note when it comes (a worker's ``imported``), with no request
        in flight."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout(f"the {self.role} worker did not answer within {timeout:.0f} s", self.role)
            try:
                ready = self.conn.poll(min(remaining, 0.5))
            except (EOFError, OSError):
                ready = True
            if ready:
                try:
                    raw = self.conn.recv_bytes()
                except (EOFError, OSError):
                    code = self._wait_exit(5.0)
                    raise WorkerDied(f"{exit_cause(self, code)} (before answering)", code, self.role) from None
                try:
                    reply = json.loads(raw.decode())
                except (UnicodeDecodeError, json.JSONDecodeError):
                    raise WorkerDied(f"the {self.role} worker sent a reply that is not JSON", self.proc.poll(),
                                     self.role) from None
                if not isinstance(reply, dict):
                    raise WorkerDied(f"the {self.role} worker sent a malformed reply", self.proc.poll(), self.role)
                if set(reply) == {"event"}:
                    self.events.append(str(reply["event"]))     # a note, not the answer: wait on
                    if until_event is not None and reply["event"] == until_event:
                        return reply
                    continue
                self.busy = False
                return reply
            if self.proc.poll() is not None and not self.conn.poll(0):
                code = self.proc.returncode
                raise WorkerDied(f"{exit_cause(self, code)} (before answering)", code, self.role)

    def ask(self, payload: dict[str, Any], timeout: float,
            device_turns: Optional[Callable[[], ContextManager[Any]]] = None) -> dict[str, Any]:
        """The reply to ``payload``. ``device_turns`` (a gate's context, ``DeviceGate.background``):
        the worker may ask for the device within this request (``sandbox.worker_util.DeviceTurns``);
        each turn is held until the worker says it is done or replies (``timeout`` applies to
        each message)."""
        self.send({**payload, "device_turns": True} if device_turns is not None else payload)
        with contextlib.ExitStack() as turn:
            while True:
                reply = self.recv(timeout)
                wants = reply.get("interim")
                if wants is None:
                    return reply
                if device_turns is None:
                    raise WorkerDied(f"the {self.role} worker asked for a device turn it was not offered",
                                     self.proc.poll(), self.role)
                if wants == "device":
                    turn.enter_context(device_turns())
                    self.send({"go": True})
                elif wants == "device_done":
                    turn.close()

    def _wait_exit(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def output(self, which: str) -> str:
        path = self.workdir / f"{which}.txt"
        try:
            data = path.read_bytes()
        except OSError:
            return ""
        text = data.decode(errors="replace")
        if len(text) > OUTPUT_CAP:
            text = f"[... {len(text) - OUTPUT_CAP} characters cut ...]\n" + text[-OUTPUT_CAP:]
        return text

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (itself and what it started: a build's compiler)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """Kill the worker and every process it started (``strays`` says which besides itself).
        Safe to call from two threads at once (a warm pool's close and its warm-up thread): a
        descriptor closed twice fails the second close, or closes whatever reused its number."""
        with self._kill_lock:
            if not self.keeper.closed:
                self.end(idle=not self.busy)
                self.keeper.close()
            if not self.conn.closed:
                self.conn.close()
            self._stdout.close()
            self._stderr.close()

    def close(self, grace: float = 5.0, why: str = "closed") -> None:
        self.stopped = self.stopped or why
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
            except WorkerDied:
                pass
            self._wait_exit(grace)
        self.kill()

    def cleanup(self) -> None:
        import shutil

        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.rmtree(self.out_dir, ignore_errors=True)
