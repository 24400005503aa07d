"""Finding and killing every process a candidate started: the process table, cgroup v2, sweeps.

A candidate's worker runs under a *keeper* (``sandbox.keeper``), a small trusted process that
never runs candidate code. Two ways make the worker's whole process tree findable:

* ``subreaper``: the keeper is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so a process the
  candidate detaches (``setsid``, a double fork) is re-parented to the keeper, not to init: every
  process the candidate starts stays a descendant of the keeper, whatever it calls itself.
* ``cgroup``: on cgroup v2 where this process's cgroup can be written, the worker runs in a cgroup
  of its own; ``cgroup.kill`` kills everything in it at once. The keeper is a subreaper too, so a
  process that moves itself out of the cgroup is still its descendant.

``KERNELLOOP_CONTAINMENT=auto|cgroup|subreaper`` picks (auto: cgroup where writable, else subreaper).
A sweep stops every process found (a stopped process cannot fork), looks again until no new one
appears, then kills them all: a fork loop cannot outrun it. This module imports nothing of the
sandbox: the keeper, the workers' parent and the tests use it alike.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path
from typing import Iterable, Optional

MODES = ("auto", "cgroup", "subreaper")
ENV = "KERNELLOOP_CONTAINMENT"
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
SWEEP_ROUNDS = 50                  # rescans while stopping a tree (each finds the children forked meanwhile)
KILL_WAIT_S = 5.0


def requested_mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def _prctl(option: int, arg: int) -> bool:
    """``prctl(option, arg)`` on this process; False where that fails."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_subreaper() -> bool:
    """Make this process a child subreaper (Linux >= 3.4); False where that fails."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> bool:
    """SIGKILL for this process when its parent dies (``PR_SET_PDEATHSIG``; kept across exec, not
    inherited by its own children); False where that fails."""
    return _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# ---------------------------------------------------------------- the process table
def read_stat(pid: int) -> Optional[tuple[int, str, float, int]]:
    """(parent pid, state, CPU seconds used, session id) of a process, or None where it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the name sits in parentheses and may hold any character: split after the last ')'
    rest = raw[raw.rfind(")") + 2:].split()
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        return int(rest[1]), rest[0], (int(rest[11]) + int(rest[12])) / ticks, int(rest[3])
    except (IndexError, ValueError):
        return None


def process_table() -> dict[int, int]:
    """pid -> parent pid of every process this pid namespace shows (zombies left out)."""
    table: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = read_stat(int(entry))
            if st is not None and st[1] not in ("Z", "X"):
                table[int(entry)] = st[0]
    return table


def descendants(root: int, table: Optional[dict[int, int]] = None) -> set[int]:
    """Every live process below ``root`` (not ``root`` itself)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child != root:
                found.add(child)
                todo.append(child)
    return found


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds used so far by ``root`` and every live process below it."""
    total = 0.0
    for pid in {root} | descendants(root):
        st = read_stat(pid)
        if st is not None:
            total += st[2]
    return total


def describe(pid: int) -> str:
    """A process in a few words (its name and command line, which a candidate may have forged)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} {comm!r}" + (f" [{cmd[:80]}]" if cmd else "")


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pid: int) -> bool:
    st = read_stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def reap() -> list[tuple[int, int]]:
    """Collect every exited child of this process: (pid, wait status) of each."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))


class Killed:
    """A process a sweep killed: its pid, its session, and how it looked before the kill."""

    def __init__(self, pid: int, session: Optional[int], text: str):
        self.pid, self.session, self.text = pid, session, text


def kill_tree(root: int, spare: Iterable[int] = (), extra: Iterable[int] = ()) -> list[Killed]:
    """Stop, then kill, every process below ``root`` (and the ``extra`` pids, e.g. a cgroup's),
    sparing the pids in ``spare`` (their descendants are *not* spared). Returns what was killed,
    described before the kill. Called from ``root`` itself (the keeper), the killed processes'
    zombies are reaped here."""
    spare = set(spare)
    stopped: dict[int, Killed] = {}
    for _ in range(SWEEP_ROUNDS):
        table = process_table()
        found = (descendants(root, table) | {p for p in extra if p in table}) - spare - {root, os.getpid()}
        new = found - set(stopped)
        if not new:
            break
        for pid in new:
            st = read_stat(pid)
            stopped[pid] = Killed(pid, st[3] if st else None, describe(pid))
        _signal(new, signal.SIGSTOP)
    _signal(stopped, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        reap()
        if not any(_alive(pid) for pid in stopped):
            break
        time.sleep(0.01)
    return list(stopped.values())


# ---------------------------------------------------------------- cgroup v2
def _v2_mount() -> Optional[Path]:
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return Path(left.split()[4])
    except (OSError, IndexError):
        pass
    return None


def own_cgroup() -> Optional[Path]:
    """This process's cgroup v2 directory, where the v2 hierarchy is mounted and writable."""
    mount = _v2_mount()
    if mount is None:
        return None
    try:
        rel = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    path = mount / rel.strip().lstrip("/")
    if not (path / "cgroup.procs").exists() or not os.access(path, os.W_OK):
        return None
    return path


class Cgroup:
    """One worker's cgroup v2: made by the keeper, joined by the worker before it runs, killed and
    removed at the end. ``create`` returns None where the host does not allow it."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, name: str) -> Optional["Cgroup"]:
        parent = own_cgroup()
        if parent is None:
            return None
        path = parent / name
        try:
            path.mkdir()
        except OSError:
            return None
        if not (path / "cgroup.kill").exists():     # Linux < 5.14: no one-shot kill
            cls(path).remove()
            return None
        return cls(path)

    def join(self, pid: int = 0) -> None:
        """Move ``pid`` (0: the calling process) into this cgroup; raises OSError where refused."""
        (self.path / "cgroup.procs").write_text(str(pid or os.getpid()))

    def pids(self) -> set[int]:
        try:
            return {int(p) for p in (self.path / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            return set()

    def kill(self) -> None:
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:
            pass

    def remove(self) -> bool:
        """Remove the (empty) cgroup; waits briefly for killed processes to leave it."""
        deadline = time.monotonic() + KILL_WAIT_S
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                reap()
                time.sleep(0.01)
