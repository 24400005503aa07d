"""The process's random generator, held by one thread at a time while the builtin uses it.

The builtin builds models and inputs under set seeds: the trace (``trace.py``) on the CPU way,
the plan replay (``replay.py``) twice per check (the reference and the emulated candidate must
draw the same weights, ``sandbox.harness.make_model``), the self-check. The loop proposes for
its tasks in threads (``agent/loop.py``), and PyTorch's default generator is one per process:
another thread's ``manual_seed`` or ``fork_rng`` (which restores the generator's state on exit)
between a replay's seed and its draws gave the two models different weights, so the replay
found a recurrent kernel "not the reference's computation" (level3/37_LSTMCn, proposed beside
24 other tasks on a GPU host) and left it to PyTorch. ``isolated_rng`` is ``fork_rng`` under one
re-entrant lock that every such section takes.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

RNG_LOCK = threading.RLock()


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """The CPU generator to this thread alone, its state restored on exit."""
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
        yield
