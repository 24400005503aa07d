"""A builtin candidate's module run in-process beside its reference (tests that build one real
candidate and compare it with PyTorch)."""
from __future__ import annotations

import torch

from sandbox.tasks import TaskSpec, load_task


def reference_and_candidate(spec: TaskSpec, source: str, seed: int = 5):
    """(the task, its Model and the candidate's ModelNew, each built right after ``manual_seed(seed)``)."""
    ns: dict = {"__name__": "kl_candidate"}
    exec(compile(source, "c.py", "exec"), ns)
    task = load_task(spec)
    torch.manual_seed(seed)
    ref = task.Model(*task.get_init_inputs())
    torch.manual_seed(seed)
    return task, ref, ns["ModelNew"](*task.get_init_inputs())


def flat_outputs(out) -> list:
    """A forward's outputs as a list (one tensor, or a tuple/list of them)."""
    return list(out) if isinstance(out, (tuple, list)) else [out]


def cuda_event_median_ms(fn, inputs, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn(*inputs)`` by CUDA events after ``warmup`` calls (the GPU check
    scripts' quick timing: no L2 flush, the same inputs; not the judge's convention)."""
    import statistics

    import torch

    times = []
    for _ in range(reps + warmup):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*inputs)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[warmup:])

