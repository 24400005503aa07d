"""sandbox.failures: whose failure it is, and what an ``infra_error`` does downstream (metrics,
the evaluation cache, the model's history, ``optimize --resume``). The sandbox itself is
exercised in tests/test_sandbox_failures.py."""
from __future__ import annotations

import errno
import signal
from pathlib import Path

import pytest

from agent.loop import LoopConfig, OptimizeLoop
from agent.types import Completion, DeviceFacts
from evals.metrics import AttemptRecord, compute_metrics
from sandbox import failures
from sandbox.failures import InfraFailure, candidate_reply, classify, exit_cause, resource_exhausted
from sandbox.process import WorkerDied, WorkerTimeout
from sandbox.result import EvalConfig, EvalResult, Status
from sandbox.tasks import read_spec
from store import Store

TASK = Path(__file__).parent / "adversarial" / "task_small.py"


class FakeWorker:
    def __init__(self, role: str = "candidate", events: tuple[str, ...] = (), stderr: str = ""):
        self.role, self.events, self._stderr = role, list(events), stderr
        self.oom_kills_at_start = None

    def output(self, which: str) -> str:
        return self._stderr if which == "stderr" else ""


# ----------------------------------------------------------------------------- classify

def test_a_candidate_death_after_its_code_ran_is_the_candidates_even_with_status_0():
    died = WorkerDied("the candidate worker exited with code 0", 0, "candidate")
    assert not classify(died, FakeWorker(events=("candidate_code",))).infra
    before = classify(died, FakeWorker(events=()))
    assert before.infra and "before the candidate's code ran" in before.message


def test_reference_failures_are_the_harness_and_candidate_timeouts_the_candidates():
    assert classify(WorkerDied("the reference worker exited with code 0", 0, "reference")).infra
    assert classify(WorkerTimeout("slow", "reference")).infra
    assert not classify(WorkerTimeout("slow", "candidate"), FakeWorker(events=("candidate_code",))).infra
    assert classify(InfraFailure("shared memory full")).infra
    assert not classify(WorkerDied("the sandbox was stopped", None)).infra   # unknown: as before
    with pytest.raises(TypeError):
        classify(ValueError("a bug of the parent is no evaluation failure"))


def test_a_candidate_reply_is_infra_only_for_the_harness_running_out_of_room():
    disk = {"ok": False, "harness_error": True, "harness_step": "saving the outputs", "error_type": "OSError",
            "error_message": "[Errno 28] No space left on device", "errno": errno.ENOSPC,
            "memory_held": 1 << 30, "harness_bytes": 1 << 30}
    v = candidate_reply(disk)
    assert v is not None and v.infra and "disk" in v.message and "saving the outputs" in v.message
    oom = {**disk, "error_type": "OutOfMemoryError", "error_message": "CUDA out of memory", "errno": None}
    assert candidate_reply(oom).infra                                      # the harness's own buffers
    hoarded = {**oom, "memory_held": 40 << 30, "harness_bytes": 2 << 30}
    assert candidate_reply(hoarded) is None                                # the candidate holds the memory
    assert candidate_reply({**disk, "error_type": "KeyError", "error_message": "x", "errno": None}) is None
    # the candidate's own forward running out of memory is its failure (no harness_error)
    assert candidate_reply({"ok": False, "error_type": "OutOfMemoryError", "error_message": "CUDA out of memory"}) is None


def test_resource_exhaustion_is_read_from_errno_and_words():
    assert resource_exhausted("OSError", "x", errno.ENOSPC) == "disk"
    assert resource_exhausted("RuntimeError", "DefaultCPUAllocator: can't allocate memory") == "memory"
    assert resource_exhausted("RuntimeError", "shape mismatch") is None


def test_every_exit_has_a_cause_with_the_last_stderr_lines():
    w = FakeWorker(stderr="line\n" * 20 + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6 GiB\n")
    text = exit_cause(w, 1)
    assert text.startswith("the candidate worker exited with code 1")
    assert "out of memory" in text and "Tried to allocate 6 GiB" in text
    assert text.count("line") <= failures.STDERR_LINES
    assert "killed by signal SIGKILL" in exit_cause(FakeWorker(), -signal.SIGKILL)
    assert "stderr is empty" in exit_cause(FakeWorker(), 0)


# ----------------------------------------------------------------------------- metrics

def _rec(aid: int, task: str, status: str, clean: bool = False, speedup: float | None = None) -> AttemptRecord:
    return AttemptRecord(attempt_id=aid, task=task, round=0, status=status, clean=clean,
                         speedup_eager=speedup, candidate_ms=1.0 if clean else None)


def test_infra_errors_count_in_no_rate():
    records = [_rec(1, "a", "correct", True, 2.0), _rec(2, "a", "infra_error"),
               _rec(3, "b", "incorrect"), _rec(4, "b", "infra_error"),
               _rec(5, "c", "infra_error"), _rec(6, "c", "infra_error")]
    m = compute_metrics(records)
    assert m.tasks == 2 and m.tasks_infra_only == 1                  # c: no verdict at all
    assert m.correctness_rate == 0.5 and m.fast_p_eager["1"] == 0.5
    assert m.attempts == 2 and m.evaluated_attempts == 2 and m.attempt_correctness_rate == 0.5
    assert m.infra_error_attempts == 4 and m.status_counts["infra_error"] == 4


# ----------------------------------------------------------------------------- the loop and the store

class _Backend:
    name, default_critic, max_concurrency = "fake", "grounded", 1

    def __init__(self):
        self.histories: list[list[str]] = []

    def complete(self, request, sample):
        self.histories.append([v.result.status.value for v in request.history if v.result is not None])
        return Completion(text="```python\nimport torch\nclass ModelNew(torch.nn.Module):\n"
                               f"    def forward(self, x):\n        return x * {request.round}\n```", model="fake")


class _Sandbox:
    """Fails with a harness failure while ``infra`` is set, else says incorrect."""

    device, device_name, torch_version = "cpu", "fake cpu", "0"

    def __init__(self):
        self.config, self.infra, self.calls = EvalConfig(), True, 0

    def evaluate(self, spec, source):
        self.calls += 1
        status = Status.infra_error if self.infra else Status.incorrect
        return EvalResult(status=status, task=spec.name, device="cpu", device_name=self.device_name,
                          candidate_sha256=str(hash(source)), torch_version="0", config=self.config,
                          error_type="ReferenceDied" if self.infra else None,
                          error_message="the reference worker was killed by signal SIGKILL" if self.infra else None)


def test_infra_errors_are_not_reused_not_shown_to_the_model_and_evaluated_again_on_resume(tmp_path):
    store = Store(tmp_path / "k.db")
    backend, sandbox = _Backend(), _Sandbox()
    spec = read_spec(TASK, name="adversarial/task_small")
    loop = OptimizeLoop(store, backend, sandbox, LoopConfig(model="fake", device="cpu", rounds=2, samples=1,
                                                            critic="grounded"),
                        DeviceFacts(device="cpu", name="fake cpu", torch_version="0"))
    run_id = loop.start_run([spec], "test")
    loop.run(run_id, [spec])
    assert sandbox.calls == 2
    assert backend.histories == [[], []]            # round 1's prompt saw no harness failure
    statuses = [s for (s,) in store.reader().execute(
        __import__("sqlalchemy").text("SELECT status FROM evaluations ORDER BY id"))]
    assert statuses == ["infra_error", "infra_error"]

    # --resume: both attempts evaluated again (not reused from the cache), nothing asked again
    sandbox.infra = False
    loop2 = OptimizeLoop(store, backend, sandbox, loop.config, loop.device)
    loop2.run(run_id, [spec])
    assert sandbox.calls == 4 and len(backend.histories) == 2
    statuses = [s for (s,) in store.reader().execute(
        __import__("sqlalchemy").text("SELECT status FROM evaluations ORDER BY id"))]
    assert statuses == ["infra_error", "infra_error", "incorrect", "incorrect"]
    store.close()
