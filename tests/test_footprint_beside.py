"""Footprints measured beside running work (sandbox.admission.MemoryGate.footprint,
sandbox.footprint.Beside): admitted for a capped share of the GPU, under the slot's gate, and
measured again alone where the cap may have changed the figures."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
from at_once import AtOnce

from sandbox.admission import BESIDE_SHARE, MemoryGate
from sandbox.footprint import Beside, Footprint, FootprintBook, measure_footprint
from sandbox.numerics import Numerics
from sandbox.tasks import TaskSpec, read_spec

MiB, GiB = 1 << 20, 1 << 30
BUDGET = 8 * GiB
CONTEXT = 512 * MiB


def _spec(name: str) -> TaskSpec:
    return TaskSpec(name=name, path=f"/{name}.py", source=f"# {name}\n")


def _fp(spec: TaskSpec, **kw) -> Footprint:
    figures = {"inputs_bytes": 64 * MiB, "outputs_bytes": 64 * MiB, "forward_peak_bytes": 128 * MiB,
               "reference_resident_bytes": 16 * MiB, "reference_peak_bytes": 256 * MiB}
    return Footprint(task_key=spec.key, device="cuda", device_name="test", numerics="fp32/default",
                     **{**figures, **kw})


class _Gate:
    """The slot's gate as the sandbox hands it over: records who held it, and when."""

    def __init__(self):
        self.held: list[tuple[int, str]] = []
        self.inside = 0

    def __call__(self, slot: int, kind: str):
        @contextlib.contextmanager
        def hold():
            self.held.append((slot, kind))
            self.inside += 1
            try:
                yield
            finally:
                self.inside -= 1
        return hold()


def _gate_with(measure, device_work) -> MemoryGate:
    return MemoryGate("cuda", 1, Numerics(), FootprintBook(measure=measure),
                      {"gpu0": BUDGET, "host": 64 * GiB, "shm": 64 * GiB}, device_work=device_work)


@pytest.fixture(autouse=True)
def _context(monkeypatch):
    monkeypatch.setenv("KERNELLOOP_CUDA_CONTEXT", str(CONTEXT))
    monkeypatch.delenv("KERNELLOOP_FOOTPRINT_BESIDE", raising=False)


def test_a_footprint_is_measured_beside_a_running_run_for_a_capped_share_under_the_slots_gate():
    gate = _Gate()
    seen: list[dict] = []

    def measure(spec, device, numerics, env=None, beside=None):
        assert beside is not None
        with beside.device_work():
            seen.append({"cap": beside.cap_bytes, "gpu": memory.admission.usage("gpu0"), "gate": gate.inside})
        return _fp(spec, cap_bytes=beside.cap_bytes)

    memory = _gate_with(measure, gate)
    running = memory.admission.admit("running", {"gpu0": 3 * GiB})      # another task's run holds the GPU
    fp = memory.footprint(_spec("new"), 0)
    cap = int(BESIDE_SHARE * BUDGET) - CONTEXT
    # measured at once (the run still admitted), held in the ledger for its context and cap, under the gate
    assert seen == [{"cap": cap, "gpu": 3 * GiB + CONTEXT + cap, "gate": 1}]
    assert gate.held == [(0, "footprint")]
    assert fp.cap_bytes == cap and memory.admission.usage("gpu0") == 3 * GiB    # the hold left with it
    memory.admission.leave(running)
    # known now: asked again, not measured again
    assert memory.footprint(_spec("new"), 0) is fp and len(seen) == 1


@pytest.mark.parametrize("why", ["cap_reached", "oom"])
def test_a_measurement_that_reached_its_cap_or_ran_out_of_memory_under_it_is_measured_again_alone(why):
    """A capped allocator gives cached blocks back to stay under the cap, so its peak may read
    low; out of memory under the cap says nothing of the task alone. Both are measured again
    with the device alone: after the running run has left, and without a cap."""
    events: list[str] = []

    def measure(spec, device, numerics, env=None, beside=None):
        if beside is not None:
            events.append("beside")
            return _fp(spec, cap_bytes=beside.cap_bytes,
                       **({"cap_reached": True} if why == "cap_reached" else {"oom": "CUDA out of memory"}))
        events.append("alone")
        return _fp(spec, reference_peak_bytes=3 * GiB)

    memory = _gate_with(measure, _Gate())
    running = memory.admission.admit("running", {"gpu0": 3 * GiB})

    def leave_later():
        time.sleep(0.4)
        events.append("run left")
        memory.admission.leave(running)

    threading.Thread(target=leave_later).start()
    fp = memory.footprint(_spec("big"), 0)
    assert events == ["beside", "run left", "alone"]
    assert fp.cap_bytes == 0 and not fp.cap_reached and fp.oom is None and fp.reference_peak_bytes == 3 * GiB


def test_switched_off_or_without_a_gate_every_footprint_is_measured_alone(monkeypatch):
    calls: list = []

    def measure(spec, device, numerics, env=None, beside=None):
        calls.append(beside)
        return _fp(spec)

    _gate_with(measure, None).footprint(_spec("a"), 0)
    monkeypatch.setenv("KERNELLOOP_FOOTPRINT_BESIDE", "0")
    _gate_with(measure, _Gate()).footprint(_spec("b"), 0)
    assert calls == [None, None]


def test_at_most_two_measurements_beside_running_work_at_once_per_gpu():
    at_once = AtOnce()

    def measure(spec, device, numerics, env=None, beside=None):
        with at_once.inside():
            time.sleep(0.2)
        return _fp(spec, cap_bytes=beside.cap_bytes)

    memory = MemoryGate("cuda", 1, Numerics(), FootprintBook(measure=measure),
                        {"gpu0": 64 * GiB, "host": 64 * GiB, "shm": 64 * GiB}, device_work=_Gate())
    threads = [threading.Thread(target=memory.footprint, args=(_spec(f"t{i}"), 0)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert at_once.most == 2


@pytest.mark.gpu
def test_a_capped_measurement_on_a_gpu_matches_the_uncapped_one_or_says_it_reached_its_cap(tmp_path):
    """The real worker: under a cap well above the task's peak the figures are those measured
    without one; under a cap below it, the measurement ran out of memory or says the cap was reached."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    source = ("import torch\nclass Model(torch.nn.Module):\n"
              "    def forward(self, x):\n        return torch.relu(x @ x) + 1\n"
              "def get_inputs():\n    return [torch.randn(8192, 8192)]\n"
              "def get_init_inputs():\n    return []\n")
    path = tmp_path / "mm.py"
    path.write_text(source)
    spec = read_spec(str(path), name="mm")
    alone = measure_footprint(spec, "cuda", Numerics())
    roomy = measure_footprint(spec, "cuda", Numerics(), beside=Beside(16 * GiB, contextlib.nullcontext))
    tight = measure_footprint(spec, "cuda", Numerics(), beside=Beside(512 * MiB, contextlib.nullcontext))
    assert alone.oom is None and alone.cap_bytes == 0
    assert roomy.oom is None and not roomy.cap_reached and roomy.cap_bytes == 16 * GiB
    assert (roomy.reference_peak_bytes, roomy.forward_peak_bytes) == (alone.reference_peak_bytes,
                                                                      alone.forward_peak_bytes)
    assert tight.oom is not None or tight.cap_reached
