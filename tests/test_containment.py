"""Issue 15: nothing a candidate starts outlives its evaluation; every timed run is checked; a
disturbed timing is flagged.

Unit tests of the process table, the keeper (with real processes, under both containment
modes), the timed-run samples (``sandbox.runcheck``) and the quiet-device checks
(``sandbox.quiet``); the adversarial suite (tests/test_sandbox_adversarial.py) runs the whole
sandbox on the candidates that attack these.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from sandbox import containment
from sandbox.containment import descendants, kill_tree, read_stat
from sandbox.quiet import GpuWatch, IdleWatch, TimingHistory
from sandbox.result import EvalConfig, EvalResult, Flag, FlagKind, Status
from sandbox.runcheck import SAMPLE, SampleCheck, Sampler

ROOT = Path(__file__).resolve().parent.parent
MODES = ["subreaper", pytest.param("cgroup", marks=pytest.mark.skipif(
    containment.own_cgroup() is None, reason="no writable cgroup v2 here"))]


def _alive(pid: int) -> bool:
    st = read_stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def _wait_gone(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


# ---------------------------------------------------------------- the process table
def test_descendants_walks_the_tree_and_leaves_out_the_rest():
    table = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert descendants(10, table) == {11, 12, 13}
    assert descendants(12, table) == set()
    assert descendants(99, table) == set()


def test_read_stat_survives_a_name_with_spaces_and_parentheses():
    # the name sits in parentheses in /proc/PID/stat; a candidate may choose one that fools a naive split
    code = "import ctypes, sys, time; ctypes.CDLL(None).prctl(15, b'a) (Z 1 2', 0, 0, 0); print('ok', flush=True); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ok"
        st = read_stat(p.pid)
        assert st is not None and st[0] == os.getpid() and st[1] in "RSD" and st[3] == os.getsid(0)
        assert "a) (Z 1 2" in containment.describe(p.pid)
    finally:
        p.kill()
        p.wait()


def test_unknown_containment_mode_is_refused(monkeypatch):
    monkeypatch.setenv(containment.ENV, "chroot")
    with pytest.raises(ValueError, match="auto, cgroup, subreaper"):
        containment.requested_mode()


# ---------------------------------------------------------------- the keeper, with real processes
# A worker that starts a detached helper (setsid, double fork, renamed) and tells its pid, then idles.
DETACH = textwrap.dedent("""
    import ctypes, os, sys, time
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, b"kltest-helper", 0, 0, 0)
            os.write(w, str(os.getpid()).encode().ljust(16))
            time.sleep(300)
        os._exit(0)
    helper = int(os.read(r, 16))
    print(helper, flush=True)
    {after}
""")


class Kept:
    """A keeper started as the sandbox starts one, around ``code`` run by Python."""

    def __init__(self, code: str, mode: str):
        ours, theirs = socket.socketpair()
        env = {**os.environ, containment.ENV: mode, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "sandbox.keeper", str(theirs.fileno()), "--",
                                      sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env,
                                     stdout=subprocess.PIPE, start_new_session=True, cwd=ROOT)
        theirs.close()
        self.conn = Connection(os.dup(ours.fileno()))
        ours.close()
        hello = self.recv()
        assert hello["event"] == "hello", hello
        self.worker, self.mode = hello["pid"], hello["mode"]

    def recv(self, timeout: float = 30.0) -> dict:
        assert self.conn.poll(timeout), "the keeper said nothing"
        return json.loads(self.conn.recv_bytes().decode())

    def ask(self, payload: dict) -> dict:
        self.conn.send_bytes(json.dumps(payload).encode())
        return self.recv()

    def line(self) -> str:
        return self.proc.stdout.readline().decode().strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.conn.close()


@pytest.mark.parametrize("mode", MODES)
def test_sweep_kills_a_detached_helper_and_spares_the_idle_worker(mode):
    k = Kept(DETACH.format(after="time.sleep(300)"), mode)
    try:
        assert k.mode == mode
        helper = int(k.line())
        assert _alive(helper) and os.getsid(helper) != os.getsid(k.worker)      # it left the session
        reply = k.ask({"op": "sweep"})
        assert any(str(helper) in line and "kltest-helper" in line for line in reply["killed"]), reply
        assert _wait_gone([helper]) == []
        assert _alive(k.worker)
        assert k.ask({"op": "sweep"})["killed"] == []            # nothing left to find
        assert k.ask({"op": "end", "idle": True}) == {"killed": []}
        assert k.proc.wait(10) == 0
        assert _wait_gone([k.worker]) == []
    finally:
        k.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_worker_that_exits_leaves_nothing_and_its_exit_is_mirrored(mode):
    k = Kept(DETACH.format(after="os._exit(3)"), mode)
    try:
        helper = int(k.line())
        msg = k.recv()
        assert msg["event"] == "exit" and any(str(helper) in line for line in msg["killed"]), msg
        assert k.proc.wait(10) == 3                      # the worker's exit code, through the keeper
        assert _wait_gone([helper]) == []
    finally:
        k.close()


def test_a_worker_killed_by_a_signal_reads_as_killed_by_that_signal():
    k = Kept("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", "subreaper")
    try:
        assert k.recv()["event"] == "exit"
        assert k.proc.wait(10) == -signal.SIGTERM
    finally:
        k.close()


def test_when_the_parent_goes_away_the_whole_tree_dies():
    k = Kept(DETACH.format(after="time.sleep(300)"), "subreaper")
    helper = int(k.line())
    k.conn.close()                                       # the sandbox is gone
    assert k.proc.wait(10) == 0
    assert _wait_gone([helper, k.worker]) == []


def test_a_worker_dies_with_its_keeper_however_the_keeper_ends():
    """A keeper SIGKILLed (in the middle of a sweep, say) cannot sweep: its worker still dies,
    so it holds no lock (the build cache's) for the next run to wait on."""
    k = Kept(DETACH.format(after="time.sleep(300)"), "subreaper")
    helper = int(k.line())
    try:
        os.kill(k.proc.pid, signal.SIGKILL)
        k.proc.wait(10)
        assert _wait_gone([k.worker]) == []
    finally:
        k.close()
        try:
            os.kill(helper, signal.SIGKILL)     # a detached helper outlives a SIGKILLed keeper: not this test's point
        except ProcessLookupError:
            pass


def test_a_fork_loop_is_stopped_and_killed_to_the_last_process():
    code = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            for _ in range(300):                         # keeps forking short-lived sleepers
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                time.sleep(0.002)
            time.sleep(300)
        print("go", flush=True)
        time.sleep(300)
    """)
    k = Kept(code, "subreaper")
    try:
        assert k.line() == "go"
        time.sleep(0.2)
        killed = k.ask({"op": "sweep"})["killed"]
        assert len(killed) >= 2
        assert descendants(k.proc.pid) == {k.worker}     # the sweep left nothing but the worker
    finally:
        k.close()


def test_end_mid_request_counts_only_processes_that_left_the_session():
    # a worker killed mid-request (a timeout) may have honest children (a compiler): killed, not counted
    code = DETACH.format(after="import subprocess; subprocess.Popen(['sleep', '300']); print('child', flush=True); time.sleep(300)")
    k = Kept(code, "subreaper")
    try:
        helper = int(k.line())
        assert k.line() == "child"
        child = next(p for p in descendants(k.worker) if p != helper and os.getsid(p) == os.getsid(k.worker))
        killed = k.ask({"op": "end", "idle": False})["killed"]
        assert len(killed) == 1 and str(helper) in killed[0]
        assert _wait_gone([helper, child, k.worker]) == []
    finally:
        k.close()


def test_kill_tree_spares_only_what_it_is_told_to():
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"])
    try:
        deadline = time.monotonic() + 30
        while not descendants(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = descendants(p.pid)
        killed = kill_tree(os.getpid(), spare={p.pid} | (descendants(os.getpid()) - {p.pid, grandchild}))
        assert [k.pid for k in killed] == [grandchild]
        assert _wait_gone([grandchild]) == [] and p.poll() is None
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------- every timed run checked
CONFIG = EvalConfig()


def _samples(outputs: dict[int, list[torch.Tensor]], path: Path) -> Sampler:
    s = Sampler("cpu")
    for i, outs in outputs.items():
        s(i, outs if len(outs) > 1 else outs[0])
    s.save(path, torch.save)
    return s


def test_samples_of_small_outputs_are_whole_and_of_large_ones_secret():
    s = Sampler("cpu")
    small = s.positions(10, torch.device("cpu"))
    assert small.tolist() == list(range(10))
    a, b = s.positions(1 << 20, torch.device("cpu")), s.positions(1 << 20, torch.device("cpu"))
    assert a.numel() == SAMPLE and int(a.min()) >= 0 and int(a.max()) < 1 << 20
    assert not torch.equal(a, b)                         # fresh entropy per run: not a fixed pattern


@pytest.mark.parametrize("layout", ["channels_last_3d", "permuted", "expanded", "sliced", "contiguous"])
def test_samples_of_a_non_contiguous_output_are_read_in_place_and_match_the_flat_order(layout, tmp_path):
    """The sampler reads a channels-last (permuted, expanded, sliced) output's sampled elements through
    its strides, not from a whole copy made after every timed run (level2/100's channels-last
    candidate: 126 MB a run); the positions are the flat row-major ones the reference checks, so an
    honest candidate returning such a layout passes and a wrong element in it is caught."""
    from sandbox.runcheck import gather

    base = torch.randn(2, 5, 4, 6, 7)
    x = {"channels_last_3d": base.contiguous(memory_format=torch.channels_last_3d),
         "permuted": base.permute(0, 2, 3, 4, 1).contiguous().permute(0, 4, 1, 2, 3),
         "expanded": base[:, :1].expand(2, 5, 4, 6, 7),
         "sliced": torch.randn(4, 10, 4, 6, 14)[1::2, ::2, :, :, ::2],
         "contiguous": base}[layout]
    assert x.shape == base.shape and (layout == "contiguous") is x.is_contiguous()
    pos = torch.randint(0, x.numel(), (300,))
    assert torch.equal(gather(x, pos), x.reshape(-1)[pos])
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        gather(x, pos)
    whole = [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")
             and any(list(shape) == list(x.shape) for shape in e.input_shapes)]
    assert whole == [], whole                      # no copy of the whole output, whatever its layout
    ref = x.contiguous()
    refs = {i: [x] for i in range(3)}
    _samples(refs, tmp_path / "s.pt")
    check = SampleCheck(str(tmp_path / "s.pt"), "cpu", 3, CONFIG)
    for i in range(3):
        check(i, ref)
    assert check.finish(None) == {"checked": 3, "failed": []}
    wrong = x + 1.0                                    # the same layout (TensorIterator keeps it), every element off
    _samples({0: [wrong]}, tmp_path / "w.pt")
    no_fp64 = CONFIG.model_copy(update={"numerics": CONFIG.numerics.model_copy(update={"fp64_check": False})})
    check = SampleCheck(str(tmp_path / "w.pt"), "cpu", 1, no_fp64)
    check(0, ref)
    assert check.finish(None)["failed"]


def test_honest_timed_runs_pass_and_are_counted(tmp_path):
    refs = {i: [torch.randn(64, 80), torch.randn(3)] for i in range(5)}
    _samples(refs, tmp_path / "s.pt")
    check = SampleCheck(str(tmp_path / "s.pt"), "cpu", 5, CONFIG)
    for i in range(5):
        check(i, tuple(refs[i]))
    assert check.finish(worker=None) == {"checked": 5, "failed": []}
    assert not (tmp_path / "s.pt").exists()              # read once, then removed


def test_a_stale_output_on_one_timed_run_fails_that_run(tmp_path):
    refs = {i: [torch.randn(4096)] for i in range(5)}
    cand = dict(refs)
    cand[2] = refs[1]                                    # run 2 returned run 1's output
    _samples(cand, tmp_path / "s.pt")
    check = SampleCheck(str(tmp_path / "s.pt"), "cpu", 5, CONFIG.model_copy(update={"numerics": CONFIG.numerics.model_copy(update={"fp64_check": False})}))
    for i in range(5):
        check(i, refs[i][0])
    verdict = check.finish(worker=None)
    assert verdict["checked"] == 4
    assert [i for i, _ in verdict["failed"]] == [2] and "sampled elements outside" in verdict["failed"][0][1]


def test_missing_malformed_and_resized_samples_fail(tmp_path):
    refs = {i: [torch.randn(2000)] for i in range(3)}
    _samples({0: refs[0], 2: refs[2]}, tmp_path / "s.pt")          # run 1 never sampled
    check = SampleCheck(str(tmp_path / "s.pt"), "cpu", 3, CONFIG)
    for i in range(3):
        check(i, refs[i][0])
    assert dict(check.finish(None)["failed"]) == {1: "no sample of its output was taken"}

    torch.save({"runs": {0: "x"}, "bad": {}}, tmp_path / "m.pt")
    check = SampleCheck(str(tmp_path / "m.pt"), "cpu", 2, CONFIG)
    assert [why for _, why in check.finish(None)["failed"]] == ["its samples are malformed"] * 2

    _samples({0: [torch.randn(4000)]}, tmp_path / "r.pt")           # a bigger output than the reference's
    check = SampleCheck(str(tmp_path / "r.pt"), "cpu", 1, CONFIG)
    check(0, torch.randn(100))
    assert "another size" in check.finish(None)["failed"][0][1]


def test_a_run_whose_output_was_not_a_plain_tensor_fails(tmp_path):
    class Sub(torch.Tensor):
        pass

    s = Sampler("cpu")
    s(0, torch.randn(5).as_subclass(Sub))
    s(1, torch.randn(5))
    s.save(tmp_path / "s.pt", torch.save)
    check = SampleCheck(str(tmp_path / "s.pt"), "cpu", 2, CONFIG)
    assert dict(check.finish(None)["failed"]) == {0: "the output is not a plain torch.Tensor"}


# ---------------------------------------------------------------- a quiet device
def test_running_median_judges_only_with_history_and_beyond_the_spread():
    h, key = TimingHistory(), ("task", "cpu", "fp32/default")
    assert h.departure(key, 100.0, 0.1) is None          # nothing known yet
    for m in (1.00, 1.02, 0.98, 1.01):
        h.add(key, m, 0.02)
    assert h.departure(key, 1.05, 0.01) is None          # within 10% of the running median
    why = h.departure(key, 2.5, 0.01)
    assert why is not None and "running median 1.005 ms" in why
    assert h.departure(key, 2.5, 2.0) is None            # this timing's own runs spread as far
    assert h.departure(("other", "cpu", "fp32/default"), 2.5, 0.01) is None
    noisy = ("noisy", "cpu", "fp32/default")
    for m in (1.0, 1.0, 1.0):
        h.add(noisy, m, 5.0)                             # runs that usually spread by 5 ms
    assert h.departure(noisy, 4.0, 0.01) is None


def test_idle_watch_sees_a_worker_that_burns_cpu_and_not_one_that_sleeps():
    burn = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"
            "print('done', flush=True)\ntime.sleep(60)")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)\n" + burn], stdout=subprocess.PIPE)
    try:
        quiet, loud = IdleWatch(sleeper.pid), IdleWatch(busy.pid)
        assert busy.stdout.readline().strip() == b"done"    # 1 s of CPU used since the watch began
        assert quiet.busy() is None
        assert "of CPU during" in (loud.busy() or "")
    finally:
        for p in (sleeper, busy):
            p.kill()
            p.wait()


def test_gpu_watch_without_nvml_says_so_and_finds_nothing(monkeypatch):
    import sandbox.quiet as quiet

    monkeypatch.setattr(quiet, "_NVML", False)
    w = GpuWatch("0")
    assert w.note and "not watched" in w.note and w.foreign(os.getpid()) == []


def test_contended_and_stray_processes_are_never_clean():
    r = EvalResult(status=Status.correct, task="t", device="cpu")
    assert r.clean
    r.add_strays(["123 'sleep'"], "after its evaluation")
    assert not r.clean and r.stray_processes_killed == 1 and r.stray_processes == ["123 'sleep'"]
    c = EvalResult(status=Status.correct, task="t", device="cpu", flags=[Flag(kind=FlagKind.contended, reason="x")])
    assert not c.clean


# ---------------------------------------------------------------- the sandbox's side (sandbox.process)
SPAWNS_HELPER = textwrap.dedent("""
    import ctypes, os, time
    import torch.nn as nn
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, b"kltest-helper", 0, 0, 0)
            time.sleep(300)
        os._exit(0)
    time.sleep(0.2)

    class ModelNew(nn.Module):
        def __init__(self, in_features, out_features, scale):
            super().__init__()
            self.linear = nn.Linear(in_features, out_features)

        def forward(self, x):
            return self.linear(x)
""")


def _candidate_worker(mode: str, monkeypatch):
    from sandbox.process import WorkerProcess
    from sandbox.tasks import read_spec

    monkeypatch.setenv(containment.ENV, mode)
    spec = read_spec(ROOT / "tests" / "adversarial" / "task_small.py", name="t")
    w = WorkerProcess("candidate")
    reply = w.ask({"role": "candidate", "device": "cpu", "out_dir": str(w.out_dir), "task": spec.__dict__,
                   "source": SPAWNS_HELPER, "init_seed": 0, "profile": False}, 120)
    assert reply.get("ok"), reply
    helpers = [p for p in descendants(w.proc.pid) if p != w.worker_pid] if w.worker_pid else []
    return w, helpers


def _helpers_alive() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().startswith("kltest-helper") and _alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("mode", MODES)
def test_a_candidate_worker_sweep_and_kill_leave_nothing(mode, monkeypatch):
    w, _ = _candidate_worker(mode, monkeypatch)
    try:
        killed = w.sweep()
        assert len(killed) >= 1 and any("kltest-helper" in k for k in killed), killed
        assert w.containment == mode and _helpers_alive() == []
        w.kill()
        assert w.strays == [] and not w.keeper_lost and w.proc.returncode is not None
    finally:
        w.kill()
        w.cleanup()


@pytest.mark.parametrize("mode", MODES)
def test_a_candidate_worker_killed_at_the_end_counts_its_strays(mode, monkeypatch):
    w, _ = _candidate_worker(mode, monkeypatch)
    try:
        assert _helpers_alive() != []
        w.kill()
        assert any("kltest-helper" in k for k in w.strays), w.strays
        assert _wait_gone(_helpers_alive()) == []
    finally:
        w.kill()
        w.cleanup()


@pytest.mark.skipif(containment.own_cgroup() is None, reason="no writable cgroup v2 here")
def test_a_killed_keeper_is_noticed_and_its_cgroup_still_kills_what_escaped(monkeypatch):
    w, _ = _candidate_worker("cgroup", monkeypatch)
    try:
        os.kill(w.proc.pid, signal.SIGKILL)              # what only a candidate could do
        w.proc.wait(10)
        assert _helpers_alive() != []                    # re-parented away from the dead keeper
        w.kill()
        assert w.keeper_lost
        assert _wait_gone(_helpers_alive()) == []
        assert not Path(w.cgroup_path).exists()
    finally:
        w.kill()
        w.cleanup()


class _FakeReference:
    """What SampleCheck's float64 recheck reads of the reference worker: its task, seed, model and
    float64 run (here a fixed output ``out`` and a float64 "truth" ``out64`` close to it)."""

    def __init__(self, out: torch.Tensor, out64: torch.Tensor):
        from sandbox.numerics import Numerics
        from sandbox.tasks import load_task, read_spec

        self.task = load_task(read_spec(ROOT / "tests" / "adversarial" / "task_small.py", name="t"), validate=False)
        self.numerics, self.timing_seed = Numerics(), 0
        self.model = lambda *inputs: out
        self.out64 = out64
        self.rechecks = 0

    def _inputs64(self, inputs):
        return inputs

    def _run_fp64(self, inputs64):
        self.rechecks += 1
        return [self.out64], None


def test_a_sampled_miss_that_the_float64_rule_accepts_passes_and_a_wrong_one_does_not(tmp_path):
    gen = torch.Generator().manual_seed(0)
    out64 = torch.randn(50_000, dtype=torch.float64, generator=gen)
    ref = (out64 + 1e-3).float()                         # the float32 reference is 1e-3 off the truth
    better = out64.float()                               # a kernel closer to float64 than the reference
    wrong = ref + 0.5

    for cand, passes in ((better, True), (wrong, False)):
        _samples({0: [cand]}, tmp_path / "s.pt")
        check = SampleCheck(str(tmp_path / "s.pt"), "cpu", 1, CONFIG)
        check(0, ref)
        assert 0 in check.recheck                        # outside atol = rtol = 1e-4 of the reference
        fake = _FakeReference(ref, out64)
        verdict = check.finish(fake)
        assert fake.rechecks == 1
        if passes:
            assert verdict == {"checked": 1, "failed": []}
        else:
            assert "float64 rule" in verdict["failed"][0][1], verdict


def _fake_nvml(procs, util, stamps=None):
    """pynvml faked: the device's compute processes, its per-process SM samples and (``stamps``)
    the time stamps of its buffered device samples, from which the sample period is read."""
    import types

    def samples(handle, kind, since):
        if stamps is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 1, [types.SimpleNamespace(timeStamp=t, sampleValue=0) for t in stamps]

    class Handle:                            # NVML's handle is a ctypes pointer: no dict key
        __hash__ = None

        def __init__(self, i):
            self.name = f"gpu{i}"

        def __eq__(self, other):
            return getattr(other, "name", other) == self.name

    return types.SimpleNamespace(nvmlDeviceGetHandleByIndex=Handle,
                                 nvmlDeviceGetComputeRunningProcesses=procs,
                                 nvmlDeviceGetProcessUtilization=util,
                                 nvmlDeviceGetSamples=samples, NVML_GPU_UTILIZATION_SAMPLES=1)


def test_gpu_watch_flags_foreign_processes_and_sm_use_but_the_timed_worker(monkeypatch):
    """NVML faked (no GPU here): what the watch makes of the device's process list and SM samples."""
    import types

    import sandbox.quiet as quiet

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])   # below this process
    try:
        calls = []

        def procs(handle):
            return [types.SimpleNamespace(pid=child.pid, usedGpuMemory=1 << 30),   # ours: an idle worker
                    types.SimpleNamespace(pid=999_999, usedGpuMemory=2 << 30)]     # someone else's job

        def util(handle, since):
            calls.append(since)
            late = since + 200_000                  # stamped a whole sample period into the window
            return [types.SimpleNamespace(pid=child.pid, smUtil=40, timeStamp=late),   # the worker being timed
                    types.SimpleNamespace(pid=4242, smUtil=0, timeStamp=late),
                    types.SimpleNamespace(pid=777, smUtil=12, timeStamp=late)]         # another process computing

        monkeypatch.setattr(quiet, "_NVML", _fake_nvml(procs, util, stamps=[0, 100_000, 200_000, 300_000]))
        monkeypatch.setattr(quiet, "_PERIODS", {})
        w = GpuWatch("1")
        assert w.note is None and w.handle == "gpu1"
        found = dict(w.foreign(os.getpid(), [child.pid]))
        assert set(found) == {999_999, 777}
        assert "2048 MiB" in found[999_999] and "12% of the SMs" in found[777]
        assert child.pid in dict(w.foreign(os.getpid(), [777]))   # the candidate computing while the reference is timed
        # one of the run's own workers (alive or ended, sandbox.process.worker_pids) is still judged,
        # and the reason says whose it is and whether it still runs
        ours = dict(w.foreign(os.getpid(), [], [child.pid, 999_998]))
        assert "a worker of this run, running" in ours[child.pid] and "(a worker" not in ours[777]
        windows = [c for c in calls if c]                  # (0: NVML's newest stamp read at each start)
        assert windows[1] >= windows[0] > 0                # each window starts where the last ended
    finally:
        child.kill()
        child.wait()


def test_an_sm_sample_within_one_period_of_the_window_start_is_not_the_windows(monkeypatch):
    """A sample tells the SM use over the sample period before its stamp: one stamped less than a
    period after the window began also covers the work just before it (seen on an H100: the
    reference's trials before the candidate's timed runs flagged honest candidates ``contended``)."""
    import types

    import sandbox.quiet as quiet

    offset = {"us": 0}

    def util(handle, since):
        return [types.SimpleNamespace(pid=777, smUtil=30, timeStamp=since + offset["us"])]

    monkeypatch.setattr(quiet, "_NVML", _fake_nvml(lambda h: [], util, stamps=[0, 166_000, 333_000, 500_000, 666_000]))
    monkeypatch.setattr(quiet, "_PERIODS", {})
    w = GpuWatch("0")
    assert quiet.sample_period_us(quiet._NVML, w.handle, w.ident) == 166_500
    offset["us"] = 100_000                          # straddles the window's start: not judged
    assert w.foreign(os.getpid()) == []
    offset["us"] = 170_000                          # a whole period inside the window: judged
    assert [pid for pid, _ in w.foreign(os.getpid())] == [777]
    # where NVML does not show its period, a second is assumed: longer is the safe side
    monkeypatch.setattr(quiet, "_NVML", _fake_nvml(lambda h: [], util, stamps=None))
    monkeypatch.setattr(quiet, "_PERIODS", {})
    w = GpuWatch("0")
    assert quiet.sample_period_us(quiet._NVML, w.handle, w.ident) == quiet.SAMPLE_PERIOD_US
    offset["us"] = 500_000
    assert w.foreign(os.getpid()) == []
    offset["us"] = quiet.SAMPLE_PERIOD_US + 1
    assert [pid for pid, _ in w.foreign(os.getpid())] == [777]


def _timing(median: float, iqr: float = 0.01) -> dict:
    return {"median_ms": median, "iqr_ms": iqr, "mean_ms": median, "min_ms": median, "max_ms": median,
            "runs": 20, "clock": "cuda_event"}


class _Ref:
    """A reference worker that answers time requests with the medians given, in order."""

    def __init__(self, medians):
        self.medians, self.asked = list(medians), 0

    def ask(self, payload):
        self.asked += 1
        return {"ok": True, "timing": _timing(self.medians.pop(0))}


@pytest.mark.parametrize("again, contended", [(1.2, True), (1.0, False)])
def test_a_reference_time_off_its_running_median_is_timed_again_then_flagged(again, contended):
    """1.2x the running median (within ``UNSTEADY_RATIO`` of the fastest, so no stand-in) twice: flagged."""
    from sandbox.checks import CandidateChecks
    from sandbox.result import Timing

    history = TimingHistory()
    checks = CandidateChecks(EvalConfig(), "cuda", "0", history)
    for m in (1.0, 1.01, 0.99):
        r = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_timing(m)))
        checks._steady(_Ref([m]), {}, r)               # history builds; only the first is timed twice
    r = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_timing(1.2)))
    ref = _Ref([again])
    checks._steady(ref, {}, r)
    assert ref.asked == 1 and r.reference_retimed == 1 and r.eager_time.median_ms == again
    assert r.has_flag("contended") is contended and r.clean is not contended


def test_on_cpu_the_running_median_does_not_judge():
    from sandbox.checks import CandidateChecks
    from sandbox.result import Timing

    checks = CandidateChecks(EvalConfig(), "cpu", None, TimingHistory())
    for m in (1.0, 1.0, 1.0, 50.0):
        r = EvalResult(status=Status.correct, task="t", device="cpu", eager_time=Timing(**_timing(m)))
        ref = _Ref([])
        checks._steady(ref, {}, r)
        assert ref.asked == 0 and not r.has_flag("contended")


# ---------------------------------------------------------------- what the model and the critic are told
def _timed(median: float) -> "Timing":
    from sandbox.result import Timing

    return Timing(median_ms=median, iqr_ms=0.001, mean_ms=median, min_ms=median, max_ms=median, runs=20,
                  clock="cuda_event", samples_ms=[median] * 20)


def test_contended_and_strays_are_doubtful_in_feedback_and_give_no_speed_claim():
    from agent.critic.uncertainty import speed_claim
    from agent.prompts import failure_kind
    from agent.types import AttemptView

    fast = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=_timed(3.0),
                      candidate_time=_timed(1.0), speedup_eager=3.0)
    assert speed_claim(fast).label == "faster"
    assert failure_kind(AttemptView(1, 0, 0, "ok", "src", fast)) == "correct"

    fast.add_flag(FlagKind.contended, "pid 777 used 12% of the SMs")
    claim = speed_claim(fast)
    assert claim.label == "inconclusive" and "not quiet" in claim.sentence and "interval" not in claim.sentence
    assert failure_kind(AttemptView(1, 0, 0, "ok", "src", fast)) == "flagged"

    strays = EvalResult(status=Status.correct, task="t", device="cuda")
    strays.add_strays(["9 'kladv'"], "after its evaluation")
    assert failure_kind(AttemptView(2, 0, 0, "ok", "src", strays)) == "flagged"


def test_the_gpu_is_watched_from_when_the_timing_holds_the_device_not_before(monkeypatch):
    """Background device work the timing waits for (a warm worker warming up) is before the
    window: the watch starts once the gate is held (on an H100 a watch started before the wait
    flagged every honest candidate contended: "not quiet before the timed runs: pid N used 1%")."""
    import threading
    import time as _time

    import sandbox.quiet as quiet
    from sandbox.pool import DeviceGate

    monkeypatch.setattr(quiet, "_NVML", _fake_nvml(lambda h: [], lambda h, since: [], stamps=[0, 1, 2, 3]))
    gate = DeviceGate()
    background = gate.background()
    background.__enter__()                   # a warm-up under way on the slot
    released = {}

    def finish_warm_up():
        _time.sleep(0.3)
        released["us"] = int(_time.time() * 1e6)
        background.__exit__(None, None, None)

    threading.Thread(target=finish_warm_up).start()
    with quiet.timing_window(gate, "0", "cuda") as watch:
        assert watch is not None and watch.since >= released["us"]
    with quiet.timing_window(None, None, "cpu") as watch:
        assert watch is None


def test_a_harness_error_reading_sm_samples_is_said_not_swallowed(monkeypatch):
    """NVML's own errors (not supported, no sample yet) are expected and quiet; any other error
    while reading the SM samples is the harness's and is said (a TypeError there once skipped the
    SM check of every window on an H100, silently). The process list is still judged."""
    import types

    import sandbox.quiet as quiet

    class NVMLError(Exception):
        pass

    def util_unsupported(handle, since):
        raise NVMLError("Not Supported")

    def util_broken(handle, since):
        raise TypeError("unhashable type")

    procs = lambda h: [types.SimpleNamespace(pid=999_999, usedGpuMemory=1 << 30)]   # noqa: E731
    for util, said in ((util_unsupported, False), (util_broken, True)):
        fake = _fake_nvml(procs, util, stamps=[0, 1, 2, 3])
        fake.NVMLError = NVMLError
        monkeypatch.setattr(quiet, "_NVML", fake)
        w = GpuWatch("0")
        assert [pid for pid, _ in w.foreign(os.getpid())] == [999_999]
        assert bool(w.unread) is said
        if said:
            assert "TypeError" in w.unread and "not judged" in w.unread
            from sandbox.checks import CandidateChecks

            r = EvalResult(status=Status.correct, task="t", device="cuda")
            CandidateChecks._foreign(w, r, "while the reference was timed", None)
            assert "SM use was not judged (TypeError" in r.stderr and r.has_flag("contended")


def test_sm_samples_are_judged_on_nvmls_clock_where_it_runs_ahead_of_the_hosts(monkeypatch):
    """Session ag's H100: samples read within milliseconds of a window's start were stamped 245-1,018 ms
    after it by the host's clock (NVML's stamps ahead of it), and the SM use of the evaluation's own
    trials just before the window was judged the window's: 22 of 400 honest evaluations flagged. A
    window's start is also taken on NVML's clock (its newest stamp then), and only samples two periods
    past that are judged."""
    import types

    import sandbox.quiet as quiet

    ahead = 800_000                             # NVML's clock 0.8 s ahead of the host's
    clock = {"stamp": None}

    def util(handle, since):
        if since == 0:                          # what NVML holds now: its newest sample, on its own clock
            return [types.SimpleNamespace(pid=1, smUtil=0, timeStamp=int(time.time() * 1e6) + ahead - 50_000)]
        return [types.SimpleNamespace(pid=777, smUtil=20, timeStamp=clock["stamp"])]

    monkeypatch.setattr(quiet, "_NVML", _fake_nvml(lambda h: [], util, stamps=[0, 200_000, 400_000, 600_000]))
    monkeypatch.setattr(quiet, "_PERIODS", {})
    w = GpuWatch("0")
    assert w.base is not None and w.base - w.since > 600_000
    clock["stamp"] = w.since + ahead + 100_000          # the trials before the window: 900 ms "into" it by the host
    assert w.foreign(os.getpid()) == []
    clock["stamp"] = w.since + ahead + 400_000          # two periods past NVML's start: the window's own
    (found,) = w.foreign(os.getpid())
    assert found[0] == 777 and "ms after NVML's newest sample then" in found[1]
    # where NVML holds no sample, the host's clock alone judges, as before
    monkeypatch.setattr(quiet, "_NVML", _fake_nvml(lambda h: [], lambda h, since: [], stamps=None))
    assert GpuWatch("0").base is None


def test_a_worker_of_the_sandbox_is_not_foreign_while_the_driver_still_lists_it(monkeypatch):
    """NVML lists a worker, with its memory, while the driver tears its CUDA context down, after it
    left the sandbox's process tree (on two H100s: 3 of 78 honest candidates flagged ``contended``,
    "pid N holds 636 MiB on the GPU"; on one H100, 4 of 40 more by workers that ended by themselves
    or by a request to exit). Its listing is not judged; SM use is."""
    import types

    import sandbox.quiet as quiet
    from sandbox.process import WorkerProcess, worker_pids

    worker = WorkerProcess("candidate")
    worker.ask({"role": "warm", "device": "cpu", "profile": False}, 60.0)
    pid = worker.worker_pid
    assert pid and {pid, worker.proc.pid} <= worker_pids()          # known from its start
    worker.send({"role": "reference"})      # not a candidate: the warm worker answers and ends by itself
    worker.recv(60.0)
    worker.proc.wait(60)
    assert not (Path("/proc") / str(pid)).exists() or (Path("/proc") / str(pid) / "stat").read_text().split()[2] == "Z"
    assert pid in worker_pids()                                     # ended without kill(): still known
    worker.kill()
    worker.cleanup()
    sm = {"use": 0}

    def procs(handle):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=636 << 20),           # ended: torn down
                types.SimpleNamespace(pid=999_999, usedGpuMemory=636 << 20)]       # someone else's

    def util(handle, since):
        return [types.SimpleNamespace(pid=pid, smUtil=sm["use"], timeStamp=since + 200_000)]

    monkeypatch.setattr(quiet, "_NVML", _fake_nvml(procs, util, stamps=[0, 100_000, 200_000, 300_000]))
    monkeypatch.setattr(quiet, "_PERIODS", {})
    w = GpuWatch("0")
    assert set(dict(w.foreign(os.getpid()))) == {pid, 999_999}                 # without the ended set
    assert set(dict(w.foreign(os.getpid(), [], worker_pids()))) == {999_999}
    sm["use"] = 30                                  # a kernel of the ended worker still running
    assert pid in dict(w.foreign(os.getpid(), [], worker_pids()))


# level2/75's eager timing in session v (four H200 lanes): the first eleven runs 2x, the rest quiet
_SESSION_V_75 = [7.06912, 6.08467, 6.24253, 6.42413, 6.26077, 6.45907, 6.42394, 10.4923, 6.45366, 6.42042,
                 6.46051, 3.09158, 3.0912, 3.10246, 3.09123, 3.09018, 3.08765, 3.09229, 3.09229, 3.09296]


def _window(samples: list[float]) -> dict:
    import statistics

    q = statistics.quantiles(samples, n=4)
    return {"median_ms": statistics.median(samples), "iqr_ms": q[2] - q[0], "mean_ms": statistics.fmean(samples),
            "min_ms": min(samples), "max_ms": max(samples), "runs": len(samples), "clock": "cuda_event",
            "samples_ms": samples}


def test_a_window_whose_median_is_far_above_its_fastest_run_is_unsteady():
    from sandbox.quiet import unsteady
    from sandbox.result import Timing

    why = unsteady(Timing(**_window(_SESSION_V_75)))
    assert why is not None and "2.00x" in why and "11 of 20" in why
    quiet = [3.09 + 0.01 * (i % 3) for i in range(20)]
    assert unsteady(Timing(**_window(quiet))) is None
    tiny = [0.010, 0.018, 0.016, 0.017, 0.015, 0.016, 0.019, 0.015]      # launch jitter, 0.006 ms over
    assert unsteady(Timing(**_window(tiny))) is None
    assert unsteady(Timing(**_timing(3.0))) is None                       # no runs kept: nothing to judge


class _Windows:
    """A reference worker that answers time requests with the sample lists given, in order."""

    def __init__(self, *windows):
        self.windows, self.asked = list(windows), []

    def ask(self, payload):
        self.asked.append(payload)
        return {"ok": True, "timing": _window(self.windows.pop(0))}


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("second, contended", [(_SESSION_V_75, True), ([3.09] * 20, False)])
def test_an_unsteady_reference_window_is_timed_again_then_flagged(compiled, second, contended):
    """The reference's eager or compiled timing from a window with a slow stretch (session v's
    level2/75) is timed again with the same request; the second window is kept; unsteady again,
    the evaluation is contended and its speedup not clean. On cpu nothing is judged."""
    import statistics

    from sandbox.checks import CandidateChecks
    from sandbox.result import Timing

    checks = CandidateChecks(EvalConfig(), "cuda", "0", TimingHistory())
    attr = "compile_time" if compiled else "eager_time"
    r = EvalResult(status=Status.correct, task="t", device="cuda", **{attr: Timing(**_window(_SESSION_V_75))})
    ref = _Windows(second)
    checks._one_window(ref, {"op": "time", "seed": 1}, r, compiled=compiled)
    assert len(ref.asked) == 1 and bool(ref.asked[0].get("compiled")) is compiled
    assert r.reference_retimed == 1 and getattr(r, attr).median_ms == pytest.approx(statistics.median(second))
    assert r.has_flag("contended") is contended and r.clean is not contended
    steady = EvalResult(status=Status.correct, task="t", device="cuda", **{attr: Timing(**_window([3.09] * 20))})
    checks._one_window(_Windows(), {}, steady, compiled=compiled)
    assert steady.reference_retimed == 0
    on_cpu = CandidateChecks(EvalConfig(), "cpu", None, TimingHistory())
    r = EvalResult(status=Status.correct, task="t", device="cpu", **{attr: Timing(**_window(_SESSION_V_75))})
    on_cpu._one_window(_Windows(), {}, r, compiled=compiled)
    assert r.reference_retimed == 0 and not r.has_flag("contended")


def _quiet_recorder():
    """A ``quiet`` context that records its entry and exit in the list returned with it."""
    import contextlib

    held: list[str] = []

    @contextlib.contextmanager
    def quiet():
        held.append("in")
        yield
        held.append("out")

    return held, quiet


# level2/67's best candidate in session af (one H100), judged clean: ten of twenty runs about 2x
_SESSION_AF_67 = [3.41, 3.42, 3.40, 3.40, 3.40, 3.41, 3.41, 4.07, 3.77, 9.88, 6.90, 6.99, 6.97, 6.94, 6.92, 6.87,
                  6.90, 6.94, 5.67, 3.40]


@pytest.mark.parametrize("second, contended", [(_SESSION_AF_67, True), ([3.40] * 20, False)])
def test_an_unsteady_candidate_window_is_timed_again_with_the_same_ask_then_flagged(second, contended):
    """The candidate's timing is held to the reference's rule: a window with a slow stretch (session
    af's level2/67) is timed again with the same ask (its inputs, sampled runs and spot-check runs:
    the checks after it read the second window), inside ``quiet``, and kept; the parent's clock is
    then read over the second ask alone; unsteady again: contended, never clean. A steady window is
    not asked again, and on cpu nothing is judged."""
    from sandbox.checks import CandidateChecks
    from sandbox.clock_check import Spent

    held, quiet = _quiet_recorder()

    class _Cand(_Windows):
        worker_pid = None

        def ask(self, payload, timeout=None):
            assert held == ["in"], "timed again outside the quiet context"
            return super().ask(payload)

    ask = {"op": "time", "seed": 7, "check_runs": [3, 19], "sample": True}
    checks = CandidateChecks(EvalConfig(), "cuda", "0", TimingHistory(), quiet=quiet)
    r = EvalResult(status=Status.correct, task="t", device="cuda")
    first, spent = {"ok": True, "timing": _window(_SESSION_AF_67)}, Spent(None)
    cand = _Cand(second)
    reply, kept_spent = checks._candidate_window(cand, ask, first, spent, r)
    assert cand.asked == [ask] and held == ["in", "out"] and kept_spent is not spent
    assert reply["timing"]["samples_ms"] == second and "timed again" in r.stderr
    assert r.has_flag("contended") is contended
    steady = {"ok": True, "timing": _window([3.40] * 20)}
    r2 = EvalResult(status=Status.correct, task="t", device="cuda")
    assert checks._candidate_window(_Cand(), ask, steady, spent, r2) == (steady, spent) and not r2.flags
    on_cpu = CandidateChecks(EvalConfig(), "cpu", None, TimingHistory(), quiet=quiet)
    assert on_cpu._candidate_window(_Cand(), ask, first, spent, r2) == (first, spent) and not r2.flags


def test_a_second_reference_window_is_timed_with_the_quiet_context_held():
    """The retime of an unsteady window runs inside ``quiet`` (on cuda the sandbox's builds
    stopped: their compilers beside the host thread that launches the timed runs)."""
    from sandbox.checks import CandidateChecks
    from sandbox.result import Timing

    held, quiet = _quiet_recorder()

    class _Seen(_Windows):
        def ask(self, payload):
            assert held == ["in"], "timed again outside the quiet context"
            return super().ask(payload)

    checks = CandidateChecks(EvalConfig(), "cuda", "0", TimingHistory(), quiet=quiet)
    r = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_window(_SESSION_V_75)))
    checks._one_window(_Seen([3.09] * 20), {}, r, compiled=False)
    assert held == ["in", "out"] and r.reference_retimed == 1 and not r.has_flag("contended")


def test_a_window_far_above_the_tasks_fastest_median_is_named_from_the_second_evaluation_on():
    """A launch-bound reference's whole window can run slow and steady (28_VisionTransformer: 13.3 ms
    seconds after 3.9): from the task's second evaluation on, a median over 1.25x the fastest seen
    is timed again (``CandidateChecks._steady``); below that, or a few microseconds above, it is not."""
    from sandbox.quiet import slower

    h, key = TimingHistory(), ("task", "cuda", "fp32/default")
    assert h.slower(key, 13.3) is None                   # nothing known yet
    h.add(key, 3.93, 0.13)
    why = h.slower(key, 13.29)
    assert why is not None and "3.38x the task's fastest median so far (3.93 ms)" in why
    assert h.slower(key, 4.5) is None                    # within 1.25x
    h.add(key, 13.29, 5.2)                               # a slow one recorded does not move the fastest
    assert h.slower(key, 13.0) is not None
    assert slower(0.030, 0.015) is None                  # 2x, but 15 us: launch jitter of a tiny task
    assert h.slower(("other", "cuda", "fp32/default"), 13.3) is None


@pytest.mark.parametrize("again, used", [(13.3, 3.93), (3.95, 3.95)])
def test_the_second_evaluation_slow_and_steady_is_timed_again_then_the_fastest_window_stands_in(again, used):
    """Slow twice against the task's fastest: the fastest window (measured earlier in the run) is
    used, so the speedup is the lower one, noted and not flagged (session x: 7_GoogleNetInceptionV1's
    eager read 5.77 ms twice, seconds after 3.10, its thread on the CPU throughout at full clocks,
    while the candidate beside it read the same as before). A quiet retime that is fast is kept."""
    from sandbox.checks import CandidateChecks
    from sandbox.result import Timing

    checks = CandidateChecks(EvalConfig(), "cuda", "0", TimingHistory())
    first = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_timing(3.93)))
    checks._steady(_Ref([4.1]), {}, first)
    assert first.eager_time.median_ms == 3.93 and first.reference_retimed == 1     # the faster window kept
    r = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_timing(13.29)))
    ref = _Ref([again])
    checks._steady(ref, {}, r)
    assert ref.asked == 1 and r.eager_time.median_ms == used and not r.has_flag("contended")
    assert r.eager_time.from_earlier is (used != again)
    assert ("its fastest window (3.93 ms) is used instead" in r.stderr) is (used != again)


def test_a_reference_off_its_running_median_but_not_slow_is_still_flagged():
    """Only a window slower than the task's fastest is replaced by it (the lower speedup); one off the
    running median the other way (faster than every earlier one, twice) stays ``contended``."""
    from sandbox.checks import CandidateChecks
    from sandbox.result import Timing

    checks = CandidateChecks(EvalConfig(), "cuda", "0", TimingHistory())
    for ms in (4.0, 4.02, 3.98, 4.01):
        r = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_timing(ms)))
        checks._steady(_Ref([ms]), {}, r)
        assert not r.has_flag("contended")
    fast = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_timing(2.0)))
    checks._steady(_Ref([2.01]), {}, fast)
    assert fast.has_flag("contended") and not fast.eager_time.from_earlier


def test_a_tasks_first_reference_window_is_timed_twice_and_the_faster_kept():
    """Nothing is known of a task's first evaluation: a slow and steady window there (the builtin's
    first candidate, session w's graph replays) would stand; a second window, quiet, is taken and
    the faster kept, with no flag. Later evaluations are compared with it."""
    from sandbox.checks import CandidateChecks
    from sandbox.result import Timing

    checks = CandidateChecks(EvalConfig(), "cuda", "0", TimingHistory())
    r = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_timing(13.29)))
    ref = _Ref([3.93])
    checks._steady(ref, {}, r)
    assert ref.asked == 1 and r.eager_time.median_ms == 3.93 and not r.has_flag("contended")
    later = EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_timing(13.0)))
    ref = _Ref([12.9])
    checks._steady(ref, {}, later)
    assert ref.asked == 1 and not later.has_flag("contended")
    assert later.eager_time.median_ms == 3.93 and later.eager_time.from_earlier


@pytest.mark.parametrize("again, used", [(6.96, 5.32), (5.34, 5.34)])
def test_the_compiled_reference_time_is_held_to_its_own_history_as_the_eager_one(again, used):
    """Session ag (one H100): level2/59's fourth compiled window read 6.96 ms, steady, after three of
    5.33 (its candidate read 1.32x torch.compile there, 1.01x in the other three). The compiled time
    now has the eager time's rule, in a history of its own: the task's first compiled window is timed
    twice and the faster kept; a later one far above the fastest is timed again (with ``compiled``
    asked) and, slow again, the fastest compiled window (5.32 ms) stands in. The eager history is not touched."""
    from sandbox.checks import CandidateChecks
    from sandbox.result import Timing

    class _Asked(_Ref):
        def ask(self, payload):
            assert payload.get("compiled") is True
            return super().ask(payload)

    checks = CandidateChecks(EvalConfig(), "cuda", "0", TimingHistory())

    def evaluation(eager, compiled):
        return EvalResult(status=Status.correct, task="t", device="cuda", eager_time=Timing(**_timing(eager)),
                          compile_time=Timing(**_timing(compiled)))

    first = evaluation(5.40, 7.09)
    checks._steady(_Ref([5.41]), {}, first)
    ref = _Asked([5.33])
    checks._steady(ref, {}, first, compiled=True)
    assert ref.asked == 1 and first.compile_time.median_ms == 5.33 and first.eager_time.median_ms == 5.40
    for ms in (5.33, 5.32):
        r = evaluation(5.40, ms)
        checks._steady(_Ref([]), {}, r)
        checks._steady(_Asked([]), {}, r, compiled=True)
        assert not r.flags
    slow = evaluation(5.40, 6.96)
    checks._steady(_Ref([]), {}, slow)
    ref = _Asked([again])
    checks._steady(ref, {}, slow, compiled=True)
    assert ref.asked == 1 and slow.compile_time.median_ms == used and not slow.has_flag("contended")
    assert slow.compile_time.from_earlier is (used != again)
    assert ("compiled time was far above the task's fastest twice" in slow.stderr) is (used != again)
    assert slow.eager_time.median_ms == 5.40 and not slow.eager_time.from_earlier
    unsteady_first = evaluation(5.40, 7.09)
    fresh = CandidateChecks(EvalConfig(), "cuda", "0", TimingHistory())
    fresh._steady(_Asked([]), {}, unsteady_first, compiled=True, retimed=True)   # its second window taken already
    assert unsteady_first.compile_time.median_ms == 7.09


def test_an_sm_flag_says_whether_the_process_was_a_worker_of_the_run_and_if_it_still_runs():
    from sandbox.quiet import _whose

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert _whose(ended.pid, {ended.pid}) == " (a worker of this run, ended)"
    assert _whose(os.getpid(), {os.getpid()}) == " (a worker of this run, running)"
    assert _whose(os.getpid(), set()) == ""
