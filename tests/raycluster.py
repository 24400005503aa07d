"""A real Ray cluster on loopback for tests (not a test module): a head and worker nodes, each
its own ``ray start`` process tree, inside a network namespace of the test's own with only
``lo`` in it, so every address Ray picks is 127.0.0.1 and no traffic leaves the namespace.

Needs root (``unshare --net``), util-linux's ``unshare``/``nsenter`` and Ray's CLI; ``missing()``
says which is absent. Every process is started and stopped by pid: a node is stopped by
killing the raylet (and the processes of the session) it started, never by name.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent

_LO_UP = (
    "import fcntl, signal, socket, struct\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "flags = struct.unpack('16sh', fcntl.ioctl(s, 0x8913, struct.pack('16sh', b'lo', 0)))[1]\n"
    "fcntl.ioctl(s, 0x8914, struct.pack('16sh', b'lo', flags | 1))\n"
    "print('up', flush=True)\n"
    "signal.pause()\n")


def missing() -> Optional[str]:
    """Why a cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "needs root for a network namespace of its own (unshare --net)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux)"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "needs Ray (pip install ray; scripts/setup.sh installs it)"
    if not _ray_cli():
        return "needs Ray's command line (ray)"
    return None


def _ray_cli() -> Optional[str]:
    near = Path(sys.executable).with_name("ray")
    return str(near) if near.exists() else shutil.which("ray")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class LoopbackCluster:
    """``with LoopbackCluster() as c:`` a head (no resources: the driver's) at ``c.address``;
    ``c.add_worker(name, cpus)`` starts a worker node, ``c.kill_worker(name)`` kills its raylet
    with SIGKILL (the node is lost, as when a machine dies), ``c.run(...)`` runs a command in
    the namespace."""

    def __init__(self, head_cpus: int = 0):
        self.dir = Path(tempfile.mkdtemp(prefix="klray-"))      # short: Ray's socket paths have a limit
        # Token authentication, with a token of the cluster's own: Ray 2.60's `ray start --head` turns token
        # mode on by itself whenever ~/.ray/auth_token exists (any local ray.init() writes one), while a
        # worker's `ray start --address` does not, so without this the workers' start depended on that file.
        self.token_path = self.dir / "auth_token"
        self.token_path.write_text(secrets.token_hex(16))
        self.head_cpus = head_cpus
        self.netns_holder: Optional[subprocess.Popen] = None
        self.address = ""
        self.workers: dict[str, dict] = {}

    # ---------------------------------------------------------------- namespace
    def _ns(self) -> list[str]:
        return ["nsenter", f"--net=/proc/{self.netns_holder.pid}/ns/net", "--"]

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
            env.pop(name, None)
        env.update({"PYTHONPATH": f"{REPO}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO),
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)})
        env.update(extra)
        return env

    def popen(self, args: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self._ns() + args, env=env, **kw)

    def run(self, args: list[str], env: Optional[dict[str, str]] = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self._ns() + args, env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout)

    # ---------------------------------------------------------------- nodes
    def __enter__(self) -> "LoopbackCluster":
        self.netns_holder = subprocess.Popen(["unshare", "--net", sys.executable, "-c", _LO_UP],
                                             stdout=subprocess.PIPE, text=True)
        assert self.netns_holder.stdout.readline().strip() == "up", "loopback did not come up in the namespace"
        port = 6379 + os.getpid() % 1000            # any port: the namespace is the test's own
        self._start_node("head", ["--head", f"--port={port}", f"--num-cpus={self.head_cpus}", "--num-gpus=0",
                                  "--include-dashboard=false"], self.env())
        self.address = f"127.0.0.1:{port}"
        return self

    def _start_node(self, name: str, args: list[str], env: dict[str, str]) -> None:
        marker = f"klnode_{name}_{os.getpid()}"
        resources = json.dumps({marker: 1})
        proc = self.run([_ray_cli(), "start", *args, "--node-ip-address=127.0.0.1", f"--resources={resources}",
                         "--object-store-memory=80000000", "--disable-usage-stats",
                         f"--temp-dir={self.dir / 'ray'}"], env=env, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start ({name}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        self.workers[name] = {"marker": marker}

    def raylet_pid(self, name: str) -> Optional[int]:
        marker = self.workers[name]["marker"]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    comm = (entry / "comm").read_text().strip()
                except OSError:
                    continue
                if comm == "raylet" and marker in _cmdline(int(entry.name)):
                    return int(entry.name)
        return None

    def add_worker(self, name: str, cpus: int, **env: str) -> None:
        self._start_node(name, [f"--address={self.address}", f"--num-cpus={cpus}", "--num-gpus=0"], self.env(**env))

    def kill_worker(self, name: str) -> None:
        """SIGKILL the node's raylet and the worker processes it started (the node is gone)."""
        pid = self.raylet_pid(name)
        if pid is None:
            return
        family = [pid, *self._descendants(pid)]
        for p in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)

    def _descendants(self, pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            kids = _children(todo.pop())
            out.extend(kids)
            todo.extend(kids)
        return out

    def session_pids(self) -> list[int]:
        """Every process whose command line names this cluster's temp folder (its daemons)."""
        mark = str(self.dir)
        return [int(e.name) for e in Path("/proc").iterdir()
                if e.name.isdigit() and mark in _cmdline(int(e.name))]

    def __exit__(self, *exc) -> None:
        for name in list(self.workers):
            self.kill_worker(name)
        deadline = time.monotonic() + 10
        pids = self.session_pids()
        while pids and time.monotonic() < deadline:
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.3)
            pids = self.session_pids()
        if self.netns_holder is not None:
            self.netns_holder.kill()
            self.netns_holder.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
