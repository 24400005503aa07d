"""Warm candidate workers (sandbox.pool), trial 0 precomputed by the reference, and the device
gate: each candidate still gets a process and an output folder of its own, never used before or
after; a warm worker that died is replaced and not blamed; precomputed outputs are the ones an
on-demand trial computes."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from sandbox.evaluate import Sandbox
from sandbox.harness import flatten_outputs, make_inputs, make_model
from sandbox.pool import DeviceGate, SlotLock, WarmPool
from sandbox.process import WorkerProcess
from sandbox.reference import Precomputed, ReferenceWorker
from sandbox.result import EvalConfig, EvalResult, Status
from sandbox.tasks import load_task, read_spec

HERE = Path(__file__).parent / "adversarial"
TASK = HERE / "task_small.py"
CFG = EvalConfig(trials=2, timed_runs=3, warmup_runs=1, time_compile=False, profile=False, run_timeout_s=60.0)


def _spec():
    return read_spec(TASK, name="adversarial/task_small")


def _pool(size: int = 1) -> WarmPool:
    return WarmPool(lambda slot: WorkerProcess("candidate"), {"device": "cpu", "profile": False}, size)


def _wait_ready(pool: WarmPool, slot: int = 0, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle = pool._idle.get(slot, [])
        if idle and all(w.done.is_set() for w in idle):
            return
        time.sleep(0.1)
    raise AssertionError("the warm workers did not get ready")


def test_device_gate_keeps_background_work_out_of_timing():
    gate = DeviceGate()
    log: list[str] = []
    bg_in = threading.Event()
    release_bg = threading.Event()

    def background():
        with gate.background():
            bg_in.set()
            log.append("bg start")
            release_bg.wait(5)
            log.append("bg end")

    def timing():
        with gate.timing():
            log.append("timing")

    b = threading.Thread(target=background)
    b.start()
    assert bg_in.wait(5)
    t = threading.Thread(target=timing)
    t.start()
    time.sleep(0.2)
    assert log == ["bg start"]              # timing waits for the background work to end
    late = threading.Thread(target=lambda: (gate.background().__enter__(), log.append("late bg")))
    late.start()
    time.sleep(0.2)
    assert "late bg" not in log             # new background work waits behind a waiting timing
    release_bg.set()
    b.join(5)
    t.join(5)
    late.join(5)
    assert log[:3] == ["bg start", "bg end", "timing"] and log[3] == "late bg"



def test_the_gate_accounts_each_kind_of_hold_its_waits_and_its_holds():
    """What held a slot's timings back, and what waited for them, by kind (the benchmark prints
    it): a reference start held 0.3 s after a timing came to wait for it; a load then waited for the
    timing's 0.2 s. Each wait is arranged by events, not by a thread's timely start, so a loaded
    host does not shorten it. Holds that never entered (abandoned) are not counted."""
    gate = DeviceGate()
    started, timed, asking = threading.Event(), threading.Event(), threading.Event()

    def reference_start():
        with gate.background(kind="reference start"):
            started.set()
            deadline = time.monotonic() + 5
            while gate._timing == 0 and time.monotonic() < deadline:     # until the timing waits for it
                time.sleep(0.005)
            time.sleep(0.3)

    def timing():
        assert started.wait(5)
        with gate.timing():
            timed.set()
            assert asking.wait(5)                                        # until the load waits for it
            time.sleep(0.2)

    threads = [threading.Thread(target=reference_start), threading.Thread(target=timing)]
    for t in threads:
        t.start()
    assert timed.wait(5)
    asking.set()
    with gate.background(kind="candidate load"):
        pass
    for t in threads:
        t.join(5)
    gone = threading.Event()
    gone.set()
    with gate.timing():
        held = gate.background(abandon=gone, kind="precompute")
        with held:
            assert not held.entered
    rows = gate.account
    assert set(rows) == {"reference start", "timing", "candidate load"}
    assert rows["timing"]["n"] == 2 and rows["reference start"]["n"] == rows["candidate load"]["n"] == 1
    assert rows["reference start"]["held_s"] >= 0.25 and rows["reference start"]["wait_s"] < 0.1
    assert rows["timing"]["wait_s"] >= 0.15                    # it waited for the reference start
    assert rows["candidate load"]["wait_s"] >= 0.1             # and the load waited for the timing


def test_a_timing_that_waits_for_background_work_lets_its_slot_go_and_takes_it_back_first():
    gate, slot = DeviceGate(), SlotLock()
    log: list[str] = []
    ev = {k: threading.Event() for k in ("bg_in", "bg_go", "other_in", "other_go", "queued_in")}

    def background():
        with gate.background():
            ev["bg_in"].set()
            ev["bg_go"].wait(5)
            log.append("bg end")

    def timing():
        with slot:                                   # the candidate holds its slot from its trials on
            with gate.timing(slot):
                assert slot.locked()                 # held again before the timed runs
                log.append("timing")

    def candidate(name: str, entered: threading.Event, go: threading.Event = None):
        with slot:                                   # another candidate's trials on the same slot
            entered.set()
            log.append(name)
            if go is not None:
                go.wait(5)

    b = threading.Thread(target=background)
    b.start()
    assert ev["bg_in"].wait(5)
    t = threading.Thread(target=timing)
    t.start()
    time.sleep(0.2)
    o = threading.Thread(target=candidate, args=("other trials", ev["other_in"], ev["other_go"]))
    o.start()
    assert ev["other_in"].wait(5), "the waiting timing kept its slot"
    late = threading.Thread(target=lambda: (gate.background().__enter__(), log.append("late bg")))
    late.start()
    ev["bg_go"].set()
    time.sleep(0.2)
    assert log == ["other trials", "bg end"]         # no new background work; the slot is still taken
    q = threading.Thread(target=candidate, args=("queued trials", ev["queued_in"]))
    q.start()                                        # arrives for the slot before the timing gets it back
    time.sleep(0.2)
    ev["other_go"].set()
    for th in (b, o, t, q):
        th.join(5)
    late.join(5)
    # the timing takes its slot back ahead of the candidate that queued; background waits for it
    assert log[:3] == ["other trials", "bg end", "timing"], log
    assert set(log[3:]) == {"queued trials", "late bg"}
    assert not slot.locked()


def test_a_precompute_still_at_the_gate_is_abandoned_by_its_trial_not_waited_for():
    # The trial holds the slot; a timing waits for the slot with new background work barred.
    # A precompute still waiting at the gate would wait for that timing forever.
    gate = DeviceGate()
    asked: list[dict] = []

    class Ref:
        def ask_if_running(self, req, *a):
            asked.append(req)
            return {"ok": True}

    bg = gate.background()
    bg.__enter__()                                   # background work running: the timing waits
    timer = threading.Thread(target=lambda: gate.timing().__enter__())
    timer.start()
    time.sleep(0.1)
    pre = Precomputed(Ref(), fp64=False, gate=gate)
    time.sleep(0.1)
    t0 = time.monotonic()
    assert pre.wait(5) is False and time.monotonic() - t0 < 1.0
    assert asked == [] and "its trial came first" in (pre.note or "")
    bg.__exit__(None, None, None)
    timer.join(5)


@pytest.mark.slow
def test_a_warm_worker_is_handed_out_once_with_a_fresh_folder_and_a_dead_one_is_replaced():
    pool = _pool(size=2)
    try:
        pool.prime(0)
        _wait_ready(pool)
        spawned_dirs = {w.proc.out_dir for w in pool._idle[0]}
        first = pool.take(0)
        second = pool.take(0)
        assert first is not second and first.proc.pid != second.proc.pid
        assert first.out_dir != second.out_dir
        for w in (first, second):
            assert w.out_dir.is_dir() and not any(w.out_dir.iterdir())
            assert w.out_dir not in spawned_dirs        # made when handed out, for this candidate
        _wait_ready(pool)
        idle = pool._idle[0]
        assert all(w.proc not in (first, second) for w in idle)
        # one ready worker dies before any candidate used it
        dead = idle[0].proc
        dead.proc.kill()
        dead.proc.wait(10)
        for w in list(idle):
            if w.proc is not dead:
                idle.remove(w)
                w.proc.kill()
        third = pool.take(0)
        assert third.proc.poll() is None and third is not dead
        assert pool.stats["replaced"] == 1
        reply = third.ask({"role": "candidate", "device": "cpu", "out_dir": str(third.out_dir),
                           "task": _spec().__dict__, "source": "import torch\nclass ModelNew(torch.nn.Module):\n"
                           "    def __init__(self, *a):\n        super().__init__()\n"
                           "    def forward(self, x):\n        return x\n", "init_seed": 1}, 120)
        assert reply.get("ok"), reply
        for w in (first, second, third):
            w.kill()
            w.cleanup()
    finally:
        pool.close()


@pytest.mark.slow
def test_candidates_never_share_a_worker_or_an_output_folder_and_a_dead_warm_one_is_not_blamed():
    spec = _spec()
    honest = (HERE / "cpu" / "honest.py").read_text()
    used: list[WorkerProcess] = []
    with Sandbox("cpu", CFG, build_slots=1, warm_workers=1) as sb:
        take = sb._candidate_worker

        def recording(slot):
            w = take(slot)
            used.append(w)
            return w

        sb._candidate_worker = recording
        first = sb.evaluate(spec, honest)
        _wait_ready(sb._pool)
        for w in sb._pool._idle[0]:         # the warm worker waiting for the next candidate dies
            w.proc.proc.kill()
            w.proc.proc.wait(10)
        second = sb.evaluate(spec, honest + "\n# another candidate\n")
        stats = sb.pool_stats
    assert first.status == Status.correct and second.status == Status.correct, (first.error_message,
                                                                                  second.error_message)
    assert len(used) == 2
    assert used[0].proc.pid != used[1].proc.pid and used[0].out_dir != used[1].out_dir
    assert all(w.proc.poll() is not None for w in used)          # each killed after its candidate
    assert stats["replaced"] == 1 and stats["taken_ready"] >= 1


def _outputs_file(tmp_path: Path, name: str, spec, seed: int, init_seed: int) -> str:
    task = load_task(spec, validate=False)
    model = make_model(task.Model, task, init_seed, "cpu")
    with torch.no_grad():
        out = flatten_outputs(model(*make_inputs(task, seed, "cpu")))
    path = tmp_path / name
    torch.save([x.contiguous() for x in out], str(path))
    return str(path)


@pytest.mark.slow
def test_precomputed_trial_zero_matches_the_on_demand_one_and_leaves_a_kept_trial_alone(tmp_path):
    spec, init_seed = _spec(), 7
    ref = ReferenceWorker(spec, "cpu", init_seed)
    config = EvalConfig().model_dump(mode="json")
    try:
        ref.ensure()
        pre = Precomputed(ref, fp64=True)
        assert pre.wait(120)
        # a trial kept for a compare in flight is not disturbed by a precompute in between
        ref.ask({"op": "trial", "seed": 11, "index": 1})
        other = Precomputed(ref, fp64=True)
        assert other.wait(120)
        kept = ref.ask({"op": "compare", "index": 1, "outputs": {"path": _outputs_file(tmp_path, "a.pt", spec, 11, init_seed)},
                        "config": config})
        assert kept["passed"], kept
        other.discard()

        checks = {}
        for how in ("precomputed", "on demand"):
            ask = {"op": "trial", "seed": pre.seed, "index": 0, "fp64": True}
            ref.ask(pre.request(ask) if how == "precomputed" else ask)
            path = _outputs_file(tmp_path, f"{how}.pt", spec, pre.seed, init_seed)
            reply = ref.ask({"op": "compare", "index": 0, "outputs": {"path": path}, "config": config})
            assert reply["passed"], reply
            checks[how] = reply["checks"]
        assert checks["precomputed"] == checks["on demand"]
        assert checks["precomputed"][0]["ref_fp64_rel_rms"] is not None
        # a token used or discarded is gone: the same request computes on demand (same seed, same outputs)
        ref.ask(pre.request({"op": "trial", "seed": pre.seed, "index": 0, "fp64": True}))
        again = ref.ask({"op": "compare", "index": 0, "config": config,
                         "outputs": {"path": _outputs_file(tmp_path, "again.pt", spec, pre.seed, init_seed)}})
        assert again["checks"] == checks["on demand"]
    finally:
        ref.close()


def test_precompute_seeds_are_fresh_and_secret_per_candidate():
    class Ref:
        def ask_if_running(self, payload, timeout=None):
            return {"ok": True}

    a, b = Precomputed(Ref(), fp64=True), Precomputed(Ref(), fp64=True)
    assert a.wait(5) and b.wait(5)
    assert a.seed != b.seed and a.token != b.token
    req = a.request({"op": "trial", "seed": 0, "index": 0})
    assert req["seed"] == a.seed and req["precomputed"] == a.token


@pytest.mark.slow
def test_precomputes_past_the_byte_budget_are_skipped_and_computed_on_demand(tmp_path):
    spec, init_seed = _spec(), 3
    ref = ReferenceWorker(spec, "cpu", init_seed, env={"KERNELLOOP_PRECOMPUTE_BYTES": "1"})
    config = EvalConfig().model_dump(mode="json")
    try:
        ref.ensure()
        first, second = Precomputed(ref, fp64=True), Precomputed(ref, fp64=True)
        assert first.wait(120) != second.wait(120)          # one kept, the other over the budget
        skipped = second if first.kept else first
        assert "already kept" in (skipped.note or "")
        ref.ask(skipped.request({"op": "trial", "seed": 0, "index": 0, "fp64": True}))
        path = _outputs_file(tmp_path, "skipped.pt", spec, skipped.seed, init_seed)
        reply = ref.ask({"op": "compare", "index": 0, "outputs": {"path": path}, "config": config})
        assert reply["passed"] and reply["checks"][0]["ref_fp64_rel_rms"] is not None, reply
    finally:
        ref.close()


def test_a_precompute_runs_only_with_its_memory_admitted_and_gives_it_back_once():
    """Computed ahead, a reference's trial outputs take device memory beside another
    candidate's trials: the memory is admitted first (none computed when it does not fit) and
    given back once, when the outputs are used or discarded."""
    from sandbox.admission import Admission

    asked: list[dict] = []

    class Ref:
        def ask_if_running(self, payload, timeout=None):
            asked.append(payload)
            return {"ok": True}

    ledger = Admission({"gpu0": 100})
    running = ledger.admit("other task", {"gpu0": 60 + 20})          # another candidate's run: 80 of 100
    assert ledger.try_admit("ahead", {"gpu0": 30}) is None        # 60 + 30 + its 20 in flight > 100
    released: list[int] = []

    def hold():
        return ledger.try_admit("ahead", {"gpu0": 15})

    def release(token):
        released.append(token)
        ledger.leave(token)

    too_big = Precomputed(Ref(), fp64=True, hold=lambda: ledger.try_admit("ahead", {"gpu0": 30}), release=release)
    assert not too_big.wait(5) and asked == [] and "does not fit" in too_big.note
    too_big.discard()
    assert released == []

    used = Precomputed(Ref(), fp64=True, hold=hold, release=release)
    assert used.wait(5) and len(asked) == 1
    assert ledger.try_admit("third", {"gpu0": 10}) is None       # 60 + 15 + 20 + 10 > 100 while held
    used.request({"op": "trial", "seed": 0, "index": 0})
    used.discard()
    used.discard()
    assert len(released) == 1
    unused = Precomputed(Ref(), fp64=True, hold=hold, release=release)
    assert unused.wait(5)
    unused.discard()                                                  # the kept outputs discarded, then given back
    assert len(released) == 2 and asked[-1]["op"] == "discard"
    token = ledger.try_admit("third", {"gpu0": 20})              # everything held ahead is back
    assert token is not None
    ledger.leave(token)
    ledger.leave(running)


def test_a_warm_up_waits_while_its_slot_is_timed():
    """A warm worker's warm-up launches device work (a context, the profiler's first kernels):
    on an H100 it showed in NVML as another process's SM use inside a timed window. It waits as
    background work while a timing runs on its slot."""
    gate = DeviceGate()
    asked = threading.Event()

    class Proc:
        def ask(self, message, timeout):
            asked.set()
            return {"ok": True, "seconds": 0.0}

        def kill(self):
            pass

        def cleanup(self):
            pass

    pool = WarmPool(lambda slot: Proc(), {"device": "cuda"}, 1, background=lambda slot: gate.background())
    try:
        with gate.timing():
            pool.prime(0)
            assert not asked.wait(0.5)
        assert asked.wait(5)
    finally:
        pool.close()


def test_a_warm_up_with_device_turns_waits_only_for_its_kernels():
    """With device turns (the GPU's candidate workers) a warm-up's imports and the profiler's
    start-up run while its slot is timed (on an H200 they held the gate 3.5-4 s, and timings and
    loads queued behind warm-ups); it asks for the device once, for its first kernels, waits
    there while the timing runs, and lets it go when it ends. A real worker, on the CPU."""
    gate = DeviceGate()
    asked, held = threading.Event(), []

    @contextlib.contextmanager
    def turn(slot):
        asked.set()
        with gate.background():
            began = time.monotonic()
            yield
            held.append(time.monotonic() - began)

    pool = WarmPool(lambda slot: WorkerProcess("candidate"), {"device": "cpu", "profile": True}, 1,
                    background=turn, turns=True)
    try:
        with gate.timing():
            pool.prime(0)
            assert asked.wait(120), "the warm-up never reached its kernels while the slot was timed"
            warming = pool._idle[0][0]
            assert not warming.done.wait(1.0)          # its kernels wait for the timing
        assert warming.done.wait(120) and warming.ok() and warming.error is None
        # one turn, held for the kernels alone: not the imports and the profiler's start-up
        assert len(held) == 1 and held[0] < warming.seconds / 2, (held, warming.seconds)
        # the pool's account: spawn to ready includes the process's start and torch's import, which
        # the worker's own seconds (from after its imports) do not
        summary = pool.summary()
        assert summary["started"] == 1 and summary["own_median_s"] == round(warming.seconds, 2)
        assert summary["ready_median_s"] > summary["own_median_s"] + 0.5, summary
        proc = pool.take(0)                             # the ready worker serves its candidate
        assert proc.proc.poll() is None
        proc.kill()
        proc.cleanup()
    finally:
        pool.close()


def test_a_reference_spawned_ahead_loads_its_task_into_the_same_process_later():
    """``ReferenceWorker.spawn`` (the sandbox calls it on cuda before it takes the slot's gate for a
    reference's start): the process is started and its imports waited for ("imported", the worker's
    first note), with no task loaded; ``ensure`` then loads the task into that same process, and the
    load alone is what the gate covers. An inline restart (a request finding no worker) takes the
    spawned process too. A real worker, on the CPU."""
    ref = ReferenceWorker(_spec(), "cpu", 1)
    try:
        ref.spawn()
        spawned = ref._spawned
        assert spawned is not None and spawned.proc.poll() is None and spawned.events == ["imported"]
        assert ref.needs_start() and ref.proc is None                # nothing loaded yet
        ref.spawn()                                                  # a second spawn starts nothing
        assert ref._spawned is spawned
        began = time.monotonic()
        ref.ensure()
        load_s = time.monotonic() - began
        assert ref.proc is spawned and ref._spawned is None and not ref.needs_start()
        assert ref.ask({"op": "trial", "seed": 3, "index": 0})["ok"]
        ref.close()
        began = time.monotonic()
        ref.ensure()                                                 # cold: process, imports and load
        assert time.monotonic() - began > load_s, "the spawned start should have been the shorter"
        ref.close()
        ref.spawn()
        spawned = ref._spawned
        assert ref.ask({"op": "trial", "seed": 3, "index": 0})["ok"] and ref.proc is spawned
    finally:
        ref.close()
    assert spawned.proc.poll() is not None


def test_on_cuda_a_starting_reference_imports_while_its_slot_is_timed_and_loads_after():
    """``Sandbox._start_reference`` on cuda (the device name set by hand; the worker runs on the
    CPU): the reference's process starts and imports while a timing holds the slot's gate, and
    only its load (a turn it asks for) waits for the timing to end. On the CPU target the whole
    start waits (imports share the cores), with nothing spawned ahead."""
    sandbox = Sandbox("cpu", CFG, warm_workers=0)
    try:
        spec = _spec()
        ref = sandbox.reference(spec, 0)
        gate = sandbox._gates[0]
        sandbox.device = "cuda"
        loaded = threading.Event()

        def start():
            sandbox._start_reference(ref, 0)
            loaded.set()

        with gate.timing():
            t = threading.Thread(target=start)
            t.start()
            def imported():
                worker = ref._spawned or ref.proc       # spawned, then taken by the start's load
                return worker is not None and "imported" in worker.events

            deadline = time.monotonic() + 120
            while not imported() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert imported(), "the imports waited for the timing"
            assert not loaded.wait(0.5)              # its load waits for the timing
        t.join(300)
        assert loaded.is_set() and not ref.needs_start()
        assert gate.account["reference start"]["n"] == 1         # one turn: the model (no warm-up compile)
        sandbox.device = "cpu"
        ref.close()
        with gate.timing():
            t = threading.Thread(target=start)
            loaded.clear()
            t.start()
            assert not loaded.wait(1.0) and ref._spawned is None   # cpu: nothing spawned ahead, all waits
        t.join(300)
        assert loaded.is_set() and gate.account["reference start"]["n"] == 2
    finally:
        sandbox.device = "cpu"
        sandbox.close()


@pytest.mark.parametrize("turns", ["1", "0"])
def test_on_cuda_a_reference_compiling_its_warm_up_leaves_the_slot_to_timings(monkeypatch, turns):
    """A reference's warm-up ``torch.compile`` (compile timings on) asks for the slot's gate only
    for its model and its runs (``sandbox.warm_compile``): while inductor generates and compiles
    its code (seconds here, C++ on the CPU; 10 s and more at KernelBench's sizes on a GPU) a
    timing on that slot gets the gate at once, where it used to wait for the whole start. The
    device name set to cuda by hand; the worker runs on the CPU, asking for turns as on a GPU.
    ``KERNELLOOP_REFERENCE_TURNS=0`` (to compare) holds the gate around the whole load, as before."""
    monkeypatch.setenv("KERNELLOOP_REFERENCE_TURNS", turns)
    cfg = EvalConfig(trials=2, timed_runs=3, warmup_runs=1, time_compile=True, profile=False, run_timeout_s=60.0)
    sandbox = Sandbox("cpu", cfg, warm_workers=0)
    try:
        ref = sandbox.reference(_spec(), 0)
        assert ref.warm_compile
        gate = sandbox._gates[0]
        sandbox.device = "cuda"
        began = time.monotonic()
        t = threading.Thread(target=sandbox._start_reference, args=(ref, 0))
        t.start()
        waits = []
        while t.is_alive():
            asked = time.monotonic()
            with gate.timing():
                waits.append(time.monotonic() - asked)
                time.sleep(0.02)
            time.sleep(0.05)
        t.join()
        start_s = time.monotonic() - began
        asked = time.monotonic()
        assert not ref.needs_start() and ref.ask({"op": "time", "seed": 5, "runs": 2, "warmup": 1, "compiled": True})["ok"]
        assert time.monotonic() - asked < 0.2 * start_s, "the warm-up's compiled module was not kept: it compiled again"
        row = gate.account["reference start"]
        if turns == "0":
            assert row["n"] == 1 and max(waits) > 0.3 * start_s, (row, max(waits), start_s)
            return
        assert row["n"] >= 3, row          # the model, the warm-up inputs, the compiled forward
        assert row["held_s"] < 0.5 * start_s, (row, start_s)
        assert max(waits) < 0.5 * start_s, (max(waits), start_s)
    finally:
        sandbox.device = "cpu"
        sandbox.close()


def test_a_worker_asking_for_a_device_turn_it_was_not_offered_is_the_harness_failure_it_is():
    """Turns are offered by the parent (``WorkerProcess.ask``'s ``device_turns``); a request that
    asks for one without the offer fails loudly, instead of waiting forever for a ``go``."""
    from sandbox.failures import WorkerDied

    proc = WorkerProcess("candidate")
    try:
        with pytest.raises(WorkerDied, match="asked for a device turn it was not offered"):
            proc.ask({"role": "warm", "device": "cpu", "profile": False, "device_turns": True}, 60)
    finally:
        proc.kill()
        proc.cleanup()


def test_a_tasks_reference_starts_while_its_first_candidate_builds_and_a_released_one_is_not_kept(monkeypatch):
    """``Sandbox.prepare``: the reference's start (its model and warm-up compile, 15-19 s on an
    H100 for KernelBench's level-2 tasks) overlaps the first candidate's build instead of
    following it. The build here waits until the task's reference runs: without the prepare
    it would wait in vain, since the reference used to start after the build."""
    spec = _spec()
    sandbox = Sandbox("cpu", CFG, warm_workers=1)
    build = Sandbox._build
    started_during_build: list[bool] = []

    def build_waiting_for_the_reference(self, spec, source, result):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ref = self._refs.get((spec.key, 0))
            # started: its process runs and its start (model, imports) is over, the lock let go
            if ref is not None and not ref.needs_start() and ref.lock.acquire(blocking=False):
                ref.lock.release()
                break
            time.sleep(0.1)
        started_during_build.append(ref is not None and not ref.needs_start())
        return build(self, spec, source, result)

    monkeypatch.setattr(Sandbox, "_build", build_waiting_for_the_reference)
    try:
        result = sandbox.evaluate(spec, (HERE / "cpu" / "honest.py").read_text())
        assert started_during_build == [True]
        assert result.status == Status.correct, result.error_message
        assert result.phases["reference"] < 1.0          # found running: nothing left to start
        # one sandbox without workers kept warm starts the reference after the build, as before
        plain = Sandbox("cpu", CFG, warm_workers=0)
        assert not plain.prepare_ahead
        plain.close()
    finally:
        sandbox.close()

    # a task released while its reference starts does not keep it
    sandbox = Sandbox("cpu", CFG, warm_workers=1)
    try:
        sandbox.prepare(spec)
        sandbox.release(spec)                           # the task ended (its candidates failed to build)
        deadline = time.monotonic() + 120
        while spec.key in sandbox._preparing and time.monotonic() < deadline:
            time.sleep(0.1)
        assert spec.key not in sandbox._preparing
        assert not any(k[0] == spec.key for k in sandbox._refs)
        assert sandbox.memory.admission.references() == []
    finally:
        sandbox.close()


_PID_WRITER = '''import os, json, torch
with open({path!r}, "a") as f:
    f.write(json.dumps({{"pid": os.getpid(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
class ModelNew(torch.nn.Module):
    def __init__(self, *a):
        super().__init__()
    def forward(self, x):
        return x
'''


def test_builds_run_in_warm_build_workers_each_used_once_with_the_gpu_hidden(tmp_path):
    """A build worker started ahead serves one build only (a fresh process per candidate, as a
    cold one), sees no GPU, and answers as a cold one does: an import that fails is left to the
    candidate's load (not the harness's failure), as from a cold worker."""
    spec = _spec()
    log = tmp_path / "pids.jsonl"
    source = _PID_WRITER.format(path=str(log))
    with Sandbox("cpu", CFG, build_slots=1, warm_workers=1) as sb:
        first = sb.build_only(spec, source)
        _wait_ready(sb._build_pool)
        second = sb.build_only(spec, source + "\n# another candidate\n")
        broken = sb.build_only(spec, "raise RuntimeError('candidate import fails')\n")
        stats = sb.build_pool_stats
    with Sandbox("cpu", CFG, build_slots=1, warm_workers=0) as cold:
        cold_broken = cold.build_only(spec, "raise RuntimeError('candidate import fails')\n")
        assert cold.build_pool_stats == {}
    assert first.ok and second.ok, (first.error_message, second.error_message)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 2 and seen[0]["pid"] != seen[1]["pid"]
    assert all(s["gpus"] == "" for s in seen)
    assert stats["taken_ready"] >= 1 and stats["started"] >= 2
    assert (broken.ok, broken.status, broken.error_type) == (cold_broken.ok, cold_broken.status, cold_broken.error_type)
    assert broken.status is not Status.infra_error


def test_a_ray_build_task_builds_in_a_worker_of_its_own(tmp_path):
    """``executors.ray_slot.build_on_node`` borrows the sandbox's build step without a sandbox (no
    build pool there): it starts its own build worker, as before."""
    from executors.ray_slot import build_on_node

    log = tmp_path / "pids.jsonl"
    reply = json.loads(build_on_node(_spec().__dict__, _PID_WRITER.format(path=str(log)), "cpu",
                                     CFG.model_dump_json(), None, 2))
    assert reply["ok"], reply
    assert len(log.read_text().splitlines()) == 1
    import ray

    assert not ray.is_initialized() and reply["node"] == ""     # no local Ray started to name the node


def test_a_ray_build_task_keeps_a_build_worker_warm_for_the_next(tmp_path):
    """With ``keep_warm`` (what the Ray executor asks), a process that runs build tasks one after
    another takes the worker its last build started ahead: still a fresh process per build, the GPU
    hidden, and a broken candidate gets the same verdict as with a cold worker."""
    from executors import ray_slot

    log = tmp_path / "pids.jsonl"
    source = _PID_WRITER.format(path=str(log))
    build = lambda text: json.loads(ray_slot.build_on_node(_spec().__dict__, text, "cpu",  # noqa: E731
                                                           CFG.model_dump_json(), None, 2, keep_warm=True))
    try:
        first = build(source)
        [pool] = ray_slot._NODE_BUILD_POOLS.values()
        _wait_ready(pool)
        second = build(source + "\n# another candidate\n")
        broken = build("raise RuntimeError('candidate import fails')\n")
        stats = dict(pool.stats)
    finally:
        ray_slot.close_node_build_pools()
    cold = json.loads(ray_slot.build_on_node(_spec().__dict__, "raise RuntimeError('candidate import fails')\n",
                                             "cpu", CFG.model_dump_json(), None, 2))
    assert first["ok"] and second["ok"], (first, second)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 2 and seen[0]["pid"] != seen[1]["pid"] and all(s["gpus"] == "" for s in seen)
    assert stats["taken_cold"] == 1 and stats["taken_ready"] >= 1, stats
    assert (broken["ok"], broken["status"], broken["error_type"]) == (cold["ok"], cold["status"], cold["error_type"])
    assert broken["status"] != "infra_error" and not ray_slot._NODE_BUILD_POOLS


def test_a_ray_slot_starts_the_reference_while_the_candidate_builds_elsewhere():
    """``EvaluationSlot.prepare`` (what the Ray executor calls as it sends the build to a build
    task): the slot's reference starts in the background and measures the task's footprint; the
    evaluation that follows finds the reference running and hands the footprint back with its reply."""
    from executors.ray_slot import EvaluationSlot, spec_data

    spec = _spec()
    slot = EvaluationSlot("cpu", CFG.model_dump_json(), 1, None)
    try:
        slot.prepare(spec_data(spec), None)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ref = slot.sandbox._refs.get((spec.key, 0))
            if ref is not None and not ref.needs_start() and spec.key not in slot.sandbox._preparing:
                break
            time.sleep(0.1)
        assert ref is not None and not ref.needs_start()
        reply = json.loads(slot.evaluate(spec_data(spec), (HERE / "cpu" / "honest.py").read_text(), None, None))
        result = EvalResult.model_validate(reply["result"])
        assert result.status == Status.correct, result.error_message
        assert result.phases["reference"] < 1.0          # found running: nothing left to start
        assert [f["task_key"] for f in reply["footprints"]] == [spec.key]
    finally:
        slot.close()


@pytest.mark.parametrize("setting, added", [(None, 10), ("0", 0), ("3", 3)])
def test_build_workers_and_their_compilers_run_nicer_than_timed_workers(monkeypatch, setting, added):
    """A build worker (and every compiler it starts: niceness is inherited) runs ``BUILD_NICE``
    nicer than the sandbox, so a timed run's host thread is not left waiting behind compilers for
    a time slice (``KERNELLOOP_BUILD_NICE`` sets it; 0 is off); a bad setting is named."""
    import os

    if setting is None:
        monkeypatch.delenv("KERNELLOOP_BUILD_NICE", raising=False)
    else:
        monkeypatch.setenv("KERNELLOOP_BUILD_NICE", setting)
    sandbox = Sandbox("cpu", CFG, warm_workers=0)
    try:
        worker = sandbox._spawn_build()
        try:
            worker.recv(120, until_event="imported")
            ours = os.getpriority(os.PRIO_PROCESS, 0)
            assert os.getpriority(os.PRIO_PROCESS, worker.proc.pid) == min(19, ours + added)
            candidate = sandbox._spawn_candidate(0)
            try:
                assert os.getpriority(os.PRIO_PROCESS, candidate.proc.pid) == ours      # timed workers are not
            finally:
                candidate.kill()
                candidate.cleanup()
        finally:
            worker.kill()
            worker.cleanup()
    finally:
        sandbox.close()
    monkeypatch.setenv("KERNELLOOP_BUILD_NICE", "low")
    from sandbox.slots import build_nice

    with pytest.raises(ValueError, match="KERNELLOOP_BUILD_NICE"):
        build_nice()
