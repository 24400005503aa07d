"""On the CPU target the builds running while a timing is held are stopped and continued after
(``sandbox.pool.BuildPause``, the CPU slot's ``DeviceGate(quiet=...)``): on a 2-core host a compiler
beside the timed runs moved one task's eager medians by 2x between evaluations. Real processes,
each in a session of its own as a build worker is, with a child as a build's compiler is."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox.failures import WorkerTimeout
from sandbox.pool import BuildPause, DeviceGate

# a worker that starts a "compiler" child and spins; both in the worker's own process group
SPIN = ("import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "while True: pass\n")


class Worker:
    """What BuildPause needs of a build worker: its process group signalled."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True)

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def group(self) -> list[int]:
        """The processes of its group (procps' pgrep)."""
        out = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def states(self) -> set[str]:
        found = set()
        for pid in self.group():
            try:
                found.add(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        return found

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _until(what, predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail(f"not {what} within {timeout} s")


@pytest.fixture
def workers():
    made: list[Worker] = []

    def make() -> Worker:
        w = Worker()
        made.append(w)
        _until("started with its child", lambda: len(w.group()) == 2)
        return w
    yield make
    for w in made:
        w.close()


def test_running_builds_are_stopped_while_a_cpu_timing_is_held_and_continue_after(workers):
    pause = BuildPause()
    gate = DeviceGate(quiet=pause.paused)
    a = workers()
    pause.add(a)
    assert "T" not in a.states()
    with gate.timing():
        _until("stopped, its child too", lambda: a.states() == {"T"})
        b = workers()               # a build starting while the timing is held is stopped as it starts
        pause.add(b)
        _until("the new one stopped", lambda: b.states() == {"T"})
        c = workers()
        pause.add(c)
        pause.discard(c)            # a build that ends during the timing is never left stopped
        _until("the ended one running", lambda: "T" not in c.states())
    _until("both running again", lambda: "T" not in a.states() and "T" not in b.states())
    pause.discard(a)
    pause.discard(b)
    with gate.timing():             # a build no longer running is not touched
        time.sleep(0.2)
        assert "T" not in a.states()


def test_background_work_still_waits_for_the_timing_and_the_pause_ends_with_it(workers):
    pause = BuildPause()
    gate = DeviceGate(quiet=pause.paused)
    a = workers()
    pause.add(a)
    entered = threading.Event()

    def background() -> None:
        with gate.background():
            entered.set()

    with gate.timing():
        t = threading.Thread(target=background)
        t.start()
        time.sleep(0.3)
        assert not entered.is_set()     # the harness's own work waits for the timing, as on a GPU
        assert a.states() == {"T"}
    t.join(10)
    assert entered.is_set()
    _until("running again", lambda: "T" not in a.states())


class SlowBuild:
    """A build worker whose answer comes ``after`` seconds after its request (no process)."""

    role = "build"

    def __init__(self, after: float) -> None:
        self.after, self.sent = after, None

    def signal_group(self, sig: int) -> None:
        pass

    def send(self, payload) -> None:
        self.sent = time.monotonic()

    def recv(self, timeout: float):
        left = self.sent + self.after - time.monotonic()
        if left > timeout:
            time.sleep(timeout)
            raise WorkerTimeout("no answer yet", self.role)
        time.sleep(max(left, 0.0))
        return {"ok": True}


def test_a_builds_timeout_does_not_count_the_time_it_was_stopped():
    """Stopped for a timing, a build is not timed out for it: the harness's time, not the candidate's."""
    pause = BuildPause()
    with pytest.raises(WorkerTimeout):          # 1.2 s of work against a 0.6 s timeout: timed out
        pause.ask(SlowBuild(1.2), {}, 0.6)
    worker = SlowBuild(1.2)
    pause.add(worker)

    held = threading.Event()

    def hold() -> None:
        with pause.paused():
            held.set()
            time.sleep(0.9)
    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)                        # stopped 0.9 s of its 1.2: within 0.6 s besides that
    assert pause.ask(worker, {}, 0.6) == {"ok": True}
    holder.join()
    assert pause.stopped_s(worker) >= 0.85
