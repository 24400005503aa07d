"""The keeper: a small trusted process between the sandbox and one worker, that contains the
worker's whole process tree (``sandbox.containment``).

Run as ``python -m sandbox.keeper CTRL_FD -- WORKER_ARGV...`` (``sandbox.process`` starts it in
a new session). It makes itself a child subreaper, puts the worker in a cgroup of its own where
the host allows (``KERNELLOOP_CONTAINMENT``), starts the worker and waits. It never runs candidate
code and imports neither torch nor the harness. On its control socket (JSON messages) it says
``{"event": "hello", "pid", "mode", "cgroup"}`` once, then serves:

* ``{"op": "sweep"}``: kill every process below the worker's keeper but the worker itself (the
  worker is idle: any other process is the candidate's stray); reply ``{"killed": [...]}``.
* ``{"op": "end", "idle": bool}``: kill the strays, then the worker and anything left, reply
  ``{"killed": [...]}`` and exit 0. Where the worker was not idle (killed mid-request, e.g. a build
  on its timeout), only processes outside the worker's session count as strays: its compilers are
  killed without counting against the candidate.

When the worker exits by itself the keeper kills whatever it left (counting those outside the
worker's session), sends ``{"event": "exit", "killed": [...]}`` and exits with the worker's
status (a signal death re-raised on itself), so the parent reads the worker's exit as before.
When the parent goes away (the socket closes), everything below the keeper is killed.
"""
from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import secrets
from multiprocessing.connection import Connection
from typing import Any, Optional

from sandbox.containment import Cgroup, Killed, die_with_parent, kill_tree, reap, requested_mode, set_subreaper

NOT_CONTAINED_EXIT = 71            # KERNELLOOP_CONTAINMENT=cgroup where no cgroup can be made


def _send(conn: Connection, payload: dict[str, Any]) -> None:
    try:
        conn.send_bytes(json.dumps(payload).encode())
    except OSError:
        pass                        # the parent is gone: nothing to tell


def _listed(killed: list[Killed]) -> list[str]:
    return [k.text for k in killed]


class Keeper:
    def __init__(self, conn: Connection, argv: list[str]):
        self.conn, self.argv = conn, argv
        self.mode = requested_mode()
        self.subreaper = set_subreaper()
        self.cgroup: Optional[Cgroup] = None
        if self.mode in ("auto", "cgroup"):
            self.cgroup = Cgroup.create(f"kernelloop-{os.getpid()}-{secrets.token_hex(4)}")
        self.worker = 0
        self.session = os.getsid(0)
        self.status: Optional[int] = None
        self.keep_fds: set[int] = set()

    def contained_by(self) -> str:
        if self.cgroup is not None and self.worker in self.cgroup.pids():
            return "cgroup"
        return "subreaper" if self.subreaper else "none"

    def start(self) -> None:
        ready_r, ready_w = os.pipe()
        keeper = os.getpid()
        pid = os.fork()
        if pid == 0:                                    # the worker-to-be
            try:
                # The worker dies with its keeper, however the keeper ends: a keeper killed in the
                # middle of its sweep (seen when Ray ended a killed driver's build task) left the
                # build worker alive, holding the build cache's lock, and a resumed run waited on it.
                die_with_parent()
                if os.getppid() != keeper:
                    os._exit(127)
                os.close(ready_r)
                os.close(self.conn.fileno())            # the keeper's channel is not the worker's
                joined = b"0"
                if self.cgroup is not None:
                    try:
                        self.cgroup.join()
                        joined = b"1"
                    except OSError:
                        pass
                os.write(ready_w, joined)
                os.close(ready_w)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.execv(self.argv[0], self.argv)
            finally:
                os._exit(127)
        os.close(ready_w)
        joined = os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        self.worker = pid
        self._close_inherited(keep={self.conn.fileno(), *self.keep_fds})
        if not joined and self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None

    @staticmethod
    def _close_inherited(keep: set[int]) -> None:
        """Close what the keeper inherited for the worker (its socket): the worker's death is then
        seen at once on that socket, not only when the keeper exits."""
        try:
            fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
        except OSError:
            return
        for fd in fds:
            if fd > 2 and fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def sweep(self, count_all: bool, spare_worker: bool) -> list[Killed]:
        """Kill the worker's strays (and the worker unless spared); what counts as a stray."""
        extra = self.cgroup.pids() if self.cgroup is not None else ()
        killed = kill_tree(os.getpid(), spare={self.worker} if spare_worker else (), extra=extra)
        if self.cgroup is not None and not spare_worker:
            self.cgroup.kill()
        for pid, status in reap():
            if pid == self.worker:
                self.status = status
        strays = [k for k in killed if k.pid != self.worker]
        if not count_all:
            strays = [k for k in strays if k.session != self.session]
        return strays

    def finish(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill()
            self.cgroup.remove()

    def serve(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        self.keep_fds = {wake_r, wake_w}
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.start()
        mode = self.contained_by()
        _send(self.conn, {"event": "hello", "pid": self.worker, "mode": mode,
                          "cgroup": str(self.cgroup.path) if mode == "cgroup" else None})
        ctrl = self.conn.fileno()
        while True:
            for pid, status in reap():
                if pid == self.worker:
                    self.status = status
            if self.status is not None:
                strays = self.sweep(count_all=False, spare_worker=False)
                self.finish()
                _send(self.conn, {"event": "exit", "killed": _listed(strays)})
                return self.status
            ready, _, _ = select.select([ctrl, wake_r], [], [], 1.0)
            if wake_r in ready:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            if ctrl not in ready:
                continue
            try:
                req = json.loads(self.conn.recv_bytes().decode())
            except (EOFError, OSError, ValueError):
                self.sweep(count_all=True, spare_worker=False)      # the parent is gone
                self.finish()
                return 0
            op = req.get("op")
            if op == "sweep":
                _send(self.conn, {"killed": _listed(self.sweep(count_all=True, spare_worker=True))})
            elif op == "end":
                idle = bool(req.get("idle"))
                strays = self.sweep(count_all=idle, spare_worker=True) if self.status is None else []
                self.sweep(count_all=True, spare_worker=False)
                self.finish()
                _send(self.conn, {"killed": _listed(strays)})
                return 0
            else:
                _send(self.conn, {"error": f"unknown op {op!r}"})


def _exit_like(status: int) -> None:
    """Leave the way the worker left: its exit code, or its signal re-raised on the keeper."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main() -> None:
    ctrl_fd = int(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    conn = Connection(ctrl_fd)
    keeper = Keeper(conn, argv)
    if keeper.mode == "cgroup" and keeper.cgroup is None:
        _send(conn, {"event": "hello", "pid": 0, "mode": "none",
                     "error": "KERNELLOOP_CONTAINMENT=cgroup, but no cgroup v2 can be made here"})
        os._exit(NOT_CONTAINED_EXIT)
    status = keeper.serve()
    _exit_like(status)


if __name__ == "__main__":
    main()
