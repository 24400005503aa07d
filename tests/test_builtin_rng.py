"""The builtin's seeded sections (trace, plan replay, self-check) hold the process's random
generator one thread at a time (agent/builtin/rng.py).

The loop proposes for its tasks in threads. Another task's trace (``fork_rng``, ``manual_seed``)
running between a replay's seed and its draws gave the replay's reference and its emulated
candidate different weights: on a GPU host level3/37_LSTMCn's recurrent kernel was left to
PyTorch as "not the reference's computation", and here the same replay under a tracing thread
read the task "ill-conditioned". The replay must give the same verdict beside tracing threads as alone.
"""
from __future__ import annotations

import threading
from pathlib import Path

from agent.builtin import _VERDICTS, replay_verdict
from agent.builtin.trace import _trace
from sandbox.tasks import read_spec

FIXTURES = Path(__file__).parent / "fixtures" / "builtin"


def test_a_replay_beside_tracing_threads_is_the_replay_alone():
    spec = read_spec(FIXTURES / "recurrent_mix.py", name="fixtures/recurrent_mix")
    other = read_spec(FIXTURES / "train_batchnorm.py", name="fixtures/train_batchnorm")
    _VERDICTS.clear()
    alone = replay_verdict(spec).as_dict()
    assert alone["ran"] and not alone.get("semantic") and not alone.get("unverifiable"), alone
    stop = threading.Event()

    def trace_others() -> None:
        while not stop.is_set():
            _trace(other, "cpu")            # uncached: its seeding and fork_rng every time

    threads = [threading.Thread(target=trace_others, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            _VERDICTS.clear()
            assert replay_verdict(spec).as_dict() == alone
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        _VERDICTS.clear()
