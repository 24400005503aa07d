"""The loop keeps enough candidates in flight to feed every device slot (agent.loop.tasks_in_flight):
with one sample a task it used to keep four tasks, so four candidates, in flight on a GPU, whose
builds (20-26 s each on an H100 host) left the device idle."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from agent.loop import CANDIDATES_PER_SLOT, LoopConfig, OptimizeLoop
from agent.types import Completion, DeviceFacts
from sandbox.result import EvalConfig, EvalResult, Status
from sandbox.tasks import read_spec
from store import Store

TASK = Path(__file__).parent / "adversarial" / "task_small.py"


class _Backend:
    name, default_critic, max_concurrency = "fake", "grounded", 4

    def complete(self, request, sample):
        # a source of its own per task and sample (identical ones are evaluated once)
        return Completion(text=f"```python\n# {request.task.name} {sample}\nimport torch\n"
                               "class ModelNew(torch.nn.Module):\n"
                               f"    def forward(self, x):\n        return x * {request.round}\n```", model="fake")


class _Sandbox:
    """Counts the evaluations in flight at once (each takes a moment, as a build would)."""

    device, device_name, torch_version = "cpu", "fake cpu", "0"

    def __init__(self, slots: int):
        self.config, self.slots = EvalConfig(), [None] * slots
        self.inside = self.most = 0
        self.lock = threading.Lock()

    def evaluate(self, spec, source):
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(2.0)
        with self.lock:
            self.inside -= 1
        return EvalResult(status=Status.incorrect, task=spec.name, device="cpu", device_name=self.device_name,
                          candidate_sha256=str(hash(source)), torch_version="0", config=self.config)


def _run(tmp_path: Path, tasks: int, samples: int, slots: int) -> tuple[int, int]:
    store = Store(tmp_path / f"k{tasks}-{samples}-{slots}.db")
    sandbox = _Sandbox(slots)
    loop = OptimizeLoop(store, _Backend(), sandbox, LoopConfig(model="fake", device="cpu", rounds=1, samples=samples,
                                                               critic="grounded"),
                        DeviceFacts(device="cpu", name="fake cpu", torch_version="0"))
    specs = []
    for i in range(tasks):              # tasks of their own (a task is known by its source)
        path = tmp_path / f"t{i}.py"
        path.write_text(TASK.read_text() + f"\n# task {i}\n")
        specs.append(read_spec(path, name=f"feed/t{i}"))
    loop.run(loop.start_run(specs, "test"), specs)
    return loop.tasks_in_flight(), sandbox.most


def test_one_sample_a_task_keeps_a_slot_fed_with_eight_candidates(tmp_path):
    assert CANDIDATES_PER_SLOT == 8
    tasks, most = _run(tmp_path, tasks=12, samples=1, slots=1)
    assert tasks == 8 and most == 8                 # was 4 (the model's concurrency)


def test_several_samples_and_slots(tmp_path):
    tasks, most = _run(tmp_path, tasks=6, samples=2, slots=1)
    assert tasks == 4 and most == 8                 # 4 tasks x 2 samples
    tasks, most = _run(tmp_path, tasks=10, samples=2, slots=2)
    assert tasks == 8 and most == 16                # two slots: twice as many
