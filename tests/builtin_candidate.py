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
