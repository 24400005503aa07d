"""Harness failures are not verdicts (sandbox.failures): a worker that dies or fails for a reason
that is not the candidate's is retried, then stored as ``infra_error`` with its cause; every
worker exit carries a cause; the candidate's own crashes still cost it the attempt."""
from __future__ import annotations

import resource
import textwrap
from pathlib import Path

import pytest

from sandbox.evaluate import Sandbox
from sandbox.failures import MAX_INFRA_RETRIES
from sandbox.process import WorkerDied, WorkerProcess
from sandbox.result import EvalConfig, Status
from sandbox.tasks import read_spec

CANDIDATE = textwrap.dedent('''
    import torch
    import torch.nn as nn
    from torch.utils.cpp_extension import load_inline

    CPP = r"""
    torch::Tensor relu(torch::Tensor x) {
      auto y = torch::empty_like(x);
      const float* p = x.data_ptr<float>(); float* q = y.data_ptr<float>();
      for (int64_t i = 0; i < x.numel(); ++i) q[i] = p[i] > 0.f ? p[i] : 0.f;
      return y;
    }
    """
    ext = load_inline(name="kl_failures_relu", cpp_sources=[CPP], functions=["relu"])


    class ModelNew(nn.Module):
        def forward(self, x):
            return ext.relu(x.contiguous())
''')

TASK = '''
import os
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        {body}
        return torch.relu(x)


def get_inputs():
    return [torch.randn({rows}, {cols})]


def get_init_inputs():
    return []
'''

CFG = EvalConfig(trials=2, timed_runs=3, warmup_runs=1, time_compile=False, profile=False,
                 run_timeout_s=60.0, build_timeout_s=600.0)


def _spec(tmp_path: Path, rows: int = 64, cols: int = 96, body: str = "pass"):
    path = tmp_path / "relu_task.py"
    path.write_text(TASK.format(rows=rows, cols=cols, body=body))
    return read_spec(path, name="test/relu_task")


def test_a_worker_whose_harness_code_raises_exits_non_zero_with_the_traceback():
    """The 'exited with code 0 before answering' bug: an exception in the worker's own code left
    through `finally: os._exit(0)`: status 0, the traceback never printed, no cause."""
    worker = WorkerProcess("candidate")
    try:
        with pytest.raises(WorkerDied) as info:
            worker.ask({"role": "candidate"}, 120.0)        # no device, task, seeds: a KeyError in the worker
    finally:
        worker.kill()
        worker.cleanup()
    assert info.value.returncode not in (0, None)
    assert info.value.role == "candidate"
    msg = str(info.value)
    assert "exited with code 0" not in msg
    assert "KeyError" in msg and "last stderr lines" in msg


@pytest.mark.slow
def test_saving_outputs_that_do_not_fit_is_a_harness_failure_with_its_cause(tmp_path):
    """Outputs larger than the file system takes (here: RLIMIT_FSIZE, inherited by the workers, where
    a full /dev/shm on the H100 gave ENOSPC): before, torch.save raised outside any handler and the
    candidate worker exited 0 without a word, stored as the candidate's runtime_error."""
    spec = _spec(tmp_path, rows=2048, cols=4096)             # 32 MiB of outputs
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, hard))
    try:
        with Sandbox("cpu", CFG, build_slots=1) as sandbox:
            result = sandbox.evaluate(spec, CANDIDATE)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert result.status is Status.infra_error, (result.status, result.error_message)
    assert "ran out of disk while saving the outputs" in result.error_message
    assert "File too large" in result.error_message
    assert len(result.infra_retries) == MAX_INFRA_RETRIES
    assert result.trials == []          # no trial of the candidate's was judged


@pytest.mark.slow
def test_a_dying_reference_is_retried_then_infra_error_never_the_candidates_fault(tmp_path, capsys):
    """The reference worker leaves with status 0 mid-trial (the issue's LayerNorm/Sum runs): the
    candidate is not blamed; the evaluation is retried with a fresh reference, then infra_error.
    Each retry is said on stderr as it starts, with its cause (on an H100 a task's evaluations failed
    and were retried for minutes with nothing printed)."""
    spec = _spec(tmp_path, body='if "kl-reference-" in os.getcwd(): os._exit(0)')
    with Sandbox("cpu", CFG, build_slots=1) as sandbox:
        result = sandbox.evaluate(spec, CANDIDATE)
    assert result.status is Status.infra_error, (result.status, result.error_message)
    assert result.error_type == "ReferenceDied"
    assert "the reference worker exited with code 0" in result.error_message
    assert len(result.infra_retries) == MAX_INFRA_RETRIES
    assert all("reference" in r for r in result.infra_retries)
    said = [line for line in capsys.readouterr().err.splitlines() if "a harness failure, not the candidate's" in line]
    assert len(said) == MAX_INFRA_RETRIES, said
    assert all(spec.name in line and "exited with code 0" in line for line in said), said
    assert [f"(try {k + 2} of {MAX_INFRA_RETRIES + 1})" in line for k, line in enumerate(said)] == [True] * len(said), said


@pytest.mark.slow
def test_a_candidate_worker_that_dies_before_the_candidates_code_runs_is_a_harness_failure(tmp_path):
    """A worker that cannot even start (here: a memory limit too small to import torch) never ran
    the candidate's code: infra_error with the exit's cause, not load_error/runtime_error."""
    config = CFG.model_copy(update={"memory_limit_mb": 120})
    with Sandbox("cpu", config, build_slots=1) as sandbox:
        result = sandbox.evaluate(_spec(tmp_path), CANDIDATE)
    assert result.status is Status.infra_error, (result.status, result.error_message)
    assert "before the candidate's code ran" in result.error_message
    assert "exited with code" in result.error_message or "killed by signal" in result.error_message
    assert len(result.infra_retries) == MAX_INFRA_RETRIES


@pytest.mark.slow
def test_a_candidate_that_exits_0_itself_still_costs_it_the_attempt(tmp_path):
    """os._exit(0) in the candidate's forward: after its code ran, so its runtime_error, no retry."""
    source = CANDIDATE.replace("return ext.relu(x.contiguous())", "import os; os._exit(0)")
    with Sandbox("cpu", CFG, build_slots=1) as sandbox:
        result = sandbox.evaluate(_spec(tmp_path), source)
    assert result.status is Status.runtime_error, (result.status, result.error_message)
    assert result.infra_retries == []
    assert "the candidate worker exited with code 0" in result.error_message


@pytest.mark.slow
def test_a_task_whose_reference_cannot_load_stops_with_its_cause_without_retries(tmp_path):
    """A broken task (its Model raises while constructed) is neither the candidate's fault nor a
    passing harness failure: evaluate raises TaskFailed naming the cause, at once."""
    from sandbox.reference import TaskFailed

    path = tmp_path / "broken_task.py"
    path.write_text(TASK.format(body="pass", rows=8, cols=8).replace(
        "class Model(nn.Module):\n", "class Model(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        raise ValueError('this task is broken')\n\n"))
    with Sandbox("cpu", CFG) as sandbox:
        with pytest.raises(TaskFailed, match="this task is broken"):
            sandbox.evaluate(read_spec(path), CANDIDATE)


GiB = 1 << 30


def test_a_candidate_out_of_device_memory_it_was_admitted_for_is_the_harness_s_failure():
    """On an H100 at KernelBench's published sizes (level1/24_LogSoftmax), candidates ran out of
    memory in their forward holding 12.6 GiB with 2 GiB free, admitted for 36 GiB, because another
    worker held 62 GiB: that was stored as the candidates' runtime_error."""
    from sandbox.failures import candidate_oom

    oom = {"ok": False, "error_type": "OutOfMemoryError",
           "error_message": "CUDA out of memory. Tried to allocate 6.00 GiB.",
           "memory_held": int(12.6 * GiB), "device_free": int(2 * GiB)}
    verdict = candidate_oom(oom, 36 * GiB)
    assert verdict is not None and verdict.infra
    assert "holding 12.60 GiB with 2.00 GiB free" in verdict.message and "36.00 GiB" in verdict.message
    assert candidate_oom({**oom, "memory_held": 40 * GiB}, 36 * GiB) is None     # held beyond its share: its own
    assert candidate_oom({**oom, "device_free": 30 * GiB}, 36 * GiB) is None     # its share was there to take
    assert candidate_oom(oom, 0) is None                                         # no share known (cpu)
    assert candidate_oom({k: v for k, v in oom.items() if k != "device_free"}, 36 * GiB) is None
    assert candidate_oom({**oom, "error_type": "ValueError", "error_message": "bad shape"}, 36 * GiB) is None
    assert candidate_oom({**oom, "harness_error": True}, 36 * GiB) is None       # candidate_reply judges those


@pytest.mark.gpu
def test_the_poison_is_reused_by_the_runs_allocations_not_held_beside_them():
    """The NaN poison before a candidate's run was poured in 256 MiB chunks, which could not
    serve a 6 GiB copy or output and stayed reserved beside them (24 GiB at level1/19_ReLU's
    sizes). Poured as blocks of the sizes the run allocates, it is what they are carved from."""
    from types import SimpleNamespace

    import torch

    from sandbox.worker import Worker

    torch.cuda.empty_cache()
    x = torch.randn(256 << 20, device="cuda")                       # 1 GiB of inputs
    base = torch.cuda.memory_reserved()
    Worker._poison(SimpleNamespace(role="candidate", device="cuda"), [x.nbytes, x.nbytes])   # copy, output
    copy = x.clone()
    out = torch.empty_like(x)
    grown = torch.cuda.memory_reserved() - base                     # before isnan's own 256 MiB
    assert grown <= 2 * x.nbytes + (64 << 20), grown                # in 256 MiB chunks: 4 GiB
    assert torch.isnan(out).all()                                   # handed the poisoned block
    del copy, out, x
    torch.cuda.empty_cache()


CANDIDATE_ALLOCATING = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class ModelNew(nn.Module):
        def forward(self, x):
            scratch = torch.empty({numel}, device=x.device)
            return torch.relu(x) + 0 * scratch[:1]
''')


@pytest.mark.gpu
def test_a_candidate_starved_by_another_process_is_infra_and_its_own_excess_is_its_own(tmp_path):
    """A process outside the admission's accounting holds all but 6 GiB of the GPU: a candidate
    admitted for 20 GiB that then cannot have 8 gets ``infra_error`` with the figures, never
    ``runtime_error``; with the GPU free, a candidate asking more than the GPU has keeps its
    ``runtime_error``."""
    import subprocess
    import sys

    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    spec = _spec(tmp_path, rows=4096, cols=16384)                   # 256 MiB of inputs
    with Sandbox("cuda", CFG) as sandbox:
        sandbox.memory.footprint(spec)                              # measured before the hog arrives
        # the candidate's admitted share, as for a task whose candidates may hold 20 GiB
        sandbox.memory.candidate_share = lambda spec, slot=0: 20 * GiB
        free = torch.cuda.mem_get_info()[0]
        hog = subprocess.Popen([sys.executable, "-c",
                                "import sys, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, "
                                "device='cuda'); print('held', flush=True); sys.stdin.read()",
                                str(free - 6 * GiB)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert hog.stdout.readline().strip() == b"held"
            starved = sandbox.evaluate(spec, CANDIDATE_ALLOCATING.format(numel=(8 * GiB) // 4))
        finally:
            hog.kill()
            hog.wait()
        assert starved.status is Status.infra_error, (starved.status, starved.error_message)
        assert "less than the" in starved.error_message and "admitted for" in starved.error_message
        assert len(starved.infra_retries) == MAX_INFRA_RETRIES
        greedy = sandbox.evaluate(spec, CANDIDATE_ALLOCATING.format(numel=(400 * GiB) // 4))
        assert greedy.status is Status.runtime_error and "OutOfMemoryError" in (greedy.error_type or ""), greedy


def test_a_worker_the_sandbox_ended_says_so_in_its_cause(tmp_path):
    """On an H100 a reference 'exited with code 0; its stderr is empty' under an evaluation of
    its task, a cause that named nothing: a worker the sandbox itself closed or restarted says
    that it did, and why."""
    from sandbox.reference import ReferenceWorker

    spec = _spec(tmp_path)
    ref = ReferenceWorker(spec, "cpu", 0)
    proc = ref.ensure()
    ref.close("its task ended")
    with pytest.raises(WorkerDied) as info:
        proc.ask({"op": "trial", "seed": 1, "index": 0}, 30)
    text = str(info.value)
    assert "exited with code 0" in text and "the sandbox ended it (reference closed: its task ended)" in text


def test_the_input_mutation_check_compares_in_chunks_and_ignores_patched_torch(monkeypatch):
    """Whole-tensor nan_to_num copies of both sides took 16 GiB more for an 8 GiB KernelBench
    level-1 input (the reference ran out of memory 'while checking the outputs')."""
    import torch

    import sandbox.worker_util as util

    monkeypatch.setattr(util, "EQUAL_CHUNK", 7)
    a = torch.arange(40, dtype=torch.float32)
    a[[3, 21]] = float("nan")
    assert util._equal_nan(a, a.clone())                              # NaN equal to NaN, across chunks
    changed = a.clone()
    changed[39] = -1.0
    assert not util._equal_nan(a, changed)                            # a difference in the last chunk
    moved = a.clone()
    moved[3], moved[4] = 0.0, float("nan")
    assert not util._equal_nan(a, moved)                              # NaN moved, zero in its place
    assert not util._equal_nan(a, a.clone().reshape(4, 10))
    assert util._equal_nan(torch.arange(9), torch.arange(9)) and not util._equal_nan(torch.arange(9), torch.zeros(9, dtype=torch.int64))
    last = torch.arange(9)
    last[8] = 0
    assert not util._equal_nan(torch.arange(9), last)                 # integers compared chunk by chunk too
    monkeypatch.setattr(torch, "nan_to_num", lambda x, **k: torch.zeros_like(x))   # a candidate's patch
    monkeypatch.setattr(torch, "equal", lambda x, y: True)
    assert not util._equal_nan(a, changed)


MUTATION_TASK = '''
import torch

class Model(torch.nn.Module):
    def forward(self, x, idx):
        return x * 2.0 + idx.float().mean()

def get_inputs():
    return [torch.randn(64, 32), torch.arange(10)]

def get_init_inputs():
    return []
'''


@pytest.mark.parametrize("copy", ["device", "host"])
def test_the_input_mutation_check_sees_a_candidate_s_writes_with_its_copy_where_the_plan_keeps_it(copy):
    """A task that fits the GPU only so keeps the candidate's inputs' copy in host memory
    (``MemoryGate.plan``, the trial's ``inputs_copy``): the same check, compared chunk by chunk on the
    inputs' device. A real candidate worker (on the CPU both copies are in host memory)."""
    from sandbox.numerics import Numerics
    from sandbox.tasks import TaskSpec

    spec = TaskSpec(name="t/mutation", path="mutation.py", source=MUTATION_TASK)
    writers = {"honest": "return x * 2.0 + idx.float().mean()",
               "float input": "x.add_(1.0)\n        return x * 2.0 + idx.float().mean()",
               "integer input": "idx[-1] = 0\n        return x * 2.0 + idx.float().mean()"}
    mutated = {}
    for name, body in writers.items():
        source = f"import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x, idx):\n        {body}\n"
        proc = WorkerProcess("candidate")
        try:
            loaded = proc.ask({"role": "candidate", "device": "cpu", "out_dir": str(proc.out_dir), "task": spec.__dict__,
                               "source": source, "init_seed": 0, "profile": False,
                               "numerics": Numerics().model_dump(mode="json")}, 120)
            assert loaded.get("ok"), loaded
            ask = {"op": "trial", "seed": 7, "index": 0, "output_bytes": 0}
            reply = proc.ask({**ask, "inputs_copy": "host"} if copy == "host" else ask, 120)
            assert reply.get("ok"), reply
            mutated[name] = reply["inputs_mutated"]
        finally:
            proc.kill()
            proc.cleanup()
    assert mutated == {"honest": [], "float input": [0], "integer input": [1]}
