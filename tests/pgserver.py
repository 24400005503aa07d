"""A real PostgreSQL server for tests (not a test module): ``initdb`` into a temporary folder,
``pg_ctl start`` on a free loopback port, one fresh database per test (``new_url``), stopped
at the end. Uses the server binaries of Debian's ``postgresql`` package (scripts/setup.sh
installs it), or whatever ``pg_config --bindir``/``PATH`` offers.

PostgreSQL refuses to run as root: as root, the server runs as the ``postgres`` user (the
package creates it) with its folder handed to that user.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Optional


def bindir() -> Optional[Path]:
    """The folder holding initdb, pg_ctl and postgres, or None."""
    candidates = []
    if shutil.which("pg_config"):
        try:
            candidates.append(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                                             timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    if shutil.which("initdb"):
        candidates.append(str(Path(shutil.which("initdb")).resolve().parent))
    for c in candidates:
        if c and all((Path(c) / tool).exists() for tool in ("initdb", "pg_ctl", "postgres")):
            return Path(c)
    return None


def missing() -> Optional[str]:
    """Why a server cannot be started here, or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "needs psycopg (pip install 'psycopg[binary]'; scripts/setup.sh installs it)"
    if bindir() is None:
        return "needs the PostgreSQL server binaries (apt-get install postgresql; scripts/setup.sh installs it)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "runs as root and finds no postgres user to run the server as"
    return None


class PostgresServer:
    def __init__(self) -> None:
        self.bin = bindir()
        self.dir = Path(tempfile.mkdtemp(prefix="klpg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self.as_user: Optional[str] = "postgres" if os.geteuid() == 0 else None
        self.user = self.as_user or pwd.getpwuid(os.geteuid()).pw_name

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = list(args)
        if self.as_user:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(self.dir))
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return proc

    def start(self) -> "PostgresServer":
        if self.as_user:
            pw = pwd.getpwnam(self.as_user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", self.user, "-E", "UTF8",
                  "--no-sync")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-t", "60",
                  "-o", f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off -c max_connections=60", "start")
        return self

    def new_url(self) -> str:
        """A fresh, empty database on the server, as a SQLAlchemy URL."""
        import psycopg

        name = f"kl_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self._dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{name}"

    def _dsn(self, db: str) -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={db}"

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        except (RuntimeError, subprocess.SubprocessError):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
