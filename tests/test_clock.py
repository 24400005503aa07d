"""The cuda timing loop's order, on a simulated GPU (no GPU needed): nothing of the host's
launch or synchronize latency lands between the events, and work a call leaves on a stream
it did not join still ends its run."""
from __future__ import annotations

import pytest

from hardware import clock

LAUNCH_MS = 0.15      # host time from a Python call to its first kernel reaching the GPU
SYNC_MS = 0.02        # host time for a synchronize to return once the GPU is idle
FLUSH_MS = 0.08


class SimGpu:
    """One stream of work (``main``), a side stream, and the host's clock; events take the
    time at which their stream reaches them."""

    def __init__(self):
        self.host = 0.0
        self.main = 0.0          # when the work queued on the main stream is done
        self.side = 0.0
        self.log: list[str] = []

    def queue(self, ms: float, side: bool = False) -> None:
        if side:
            self.side = max(self.side, self.host) + ms
        else:
            self.main = max(self.main, self.host) + ms
        self.host += 0.005

    def sync(self) -> None:
        self.log.append("sync")
        self.host = max(self.host, self.main, self.side) + SYNC_MS

    class Event:
        def __init__(self, enable_timing=True):
            self.t = None

    def record(self, event, stream=None) -> None:
        self.log.append(event)
        event.t = max(self.main, self.host)
        self.main = event.t

    def elapsed(self, a, b) -> float:
        return b.t - a.t


@pytest.fixture
def gpu(monkeypatch):
    sim = SimGpu()
    sim.events = []

    def event(enable_timing=True):
        e = SimGpu.Event()
        sim.events.append(e)
        return e

    class Flusher:
        def __init__(self, device, enabled=True):
            self.enabled = enabled

        def __call__(self):
            if self.enabled:
                sim.log.append("flush")
                sim.queue(FLUSH_MS)

    def spin(cycles):
        sim.log.append("spin")
        sim.queue(cycles / 1000.0)

    monkeypatch.setattr(clock, "_cuda_sync", sim.sync)
    monkeypatch.setattr(clock, "_Event", event)
    monkeypatch.setattr(clock, "_record", sim.record)
    monkeypatch.setattr(clock, "_elapsed_time", sim.elapsed)
    monkeypatch.setattr(clock, "_current_stream", lambda: "main")
    monkeypatch.setattr(clock, "_spin", spin)
    monkeypatch.setattr(clock._Spin, "cycles_per_ms", 1000.0)
    monkeypatch.setattr(clock, "L2Flusher", Flusher)
    return sim


def _call(sim, kernel_ms, side_ms=0.0):
    def fn():
        sim.log.append("fn")
        sim.host += LAUNCH_MS               # the Python call and its launch
        sim.queue(kernel_ms)
        if side_ms:
            sim.queue(side_ms, side=True)   # launched on a side stream, never joined
        return None
    return fn


def test_the_start_event_waits_behind_queued_work_and_the_end_event_precedes_the_synchronize(gpu):
    samples, clock_name = clock.time_samples(_call(gpu, 0.5), lambda i: (), "cuda", warmup=1, runs=3)
    assert clock_name == "cuda_event"
    start, end, after = gpu.events[-3:]
    names = {id(start): "start", id(end): "end", id(after): "after"}
    last_run = [names.get(id(x), x) for x in gpu.log[-9:]]
    # per run: synchronize, flush and spin queued, start, the call, end, synchronize, after-event, synchronize
    assert last_run == ["sync", "flush", "spin", "start", "fn", "end", "sync", "after", "sync"]
    # The host's 0.15 ms launch latency and the synchronize's 0.02 ms are off the clock: the
    # samples are the kernel's 0.5 ms.
    assert samples == pytest.approx([0.5] * 3, abs=1e-9)


def test_unjoined_side_stream_work_that_outlasts_the_call_stays_on_the_clock(gpu):
    samples, _ = clock.time_samples(_call(gpu, 0.5, side_ms=2.0), lambda i: (), "cuda", warmup=1, runs=3)
    # the last run ends when its side kernel does (it started on its own stream before the start
    # event, which waited behind the flush), not when the main stream's 0.5 ms kernel did
    start = gpu.events[-3]
    assert samples[-1] == pytest.approx(gpu.side - start.t, abs=1e-9)
    assert min(samples) > 1.8
    joined, _ = clock.time_samples(_call(gpu, 0.5, side_ms=0.3), lambda i: (), "cuda", warmup=1, runs=3)
    assert joined == pytest.approx([0.5] * 3, abs=1e-9)      # side work done within the call: not counted twice


def test_cpu_times_the_call_alone(monkeypatch):
    ticks = iter(range(0, 10_000_000, 1_000_000))
    monkeypatch.setattr(clock, "_perf_counter_ns", lambda: next(ticks))
    samples, name = clock.time_samples(lambda: None, lambda i: (), "cpu", warmup=0, runs=3, flush_l2=False)
    assert name == "perf_counter" and samples == [1.0, 1.0, 1.0]


def test_rebinding_the_clocks_own_names_is_reported_as_tampering(monkeypatch):
    assert clock.tampered_functions() == []
    monkeypatch.setattr(clock, "_elapsed_time", lambda a, b: 0.001)
    assert clock.tampered_functions() == ["hardware.clock._elapsed_time"]
    monkeypatch.setattr(clock, "preamble", lambda flusher, spin=None: None)
    assert "hardware.clock.preamble" in clock.tampered_functions()
