"""The Ray executor without a store (a benchmark's) reads and keeps footprints in the book it is
handed, as the local executor does: its slots then admit candidates against measured footprints
instead of measuring them again (on two H200s its candidates waited 32 s each for memory
without them, evals/gpu_runs/2026-11-26-session-j.md). No cluster is needed for this logic."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")

from executors.ray_executor import RayExecutor  # noqa: E402
from sandbox.footprint import Footprint, FootprintBook  # noqa: E402
from sandbox.result import EvalConfig  # noqa: E402
from sandbox.tasks import read_spec  # noqa: E402

TASK = Path(__file__).parent / "adversarial" / "task_small.py"


def executor(book):
    ex = object.__new__(RayExecutor)         # the cluster half of __init__ is not under test
    ex.device, ex.config, ex.store, ex._footprints = "cpu", EvalConfig(), None, book
    return ex


def test_a_ray_executor_without_a_store_reads_and_keeps_footprints_in_its_book():
    spec = read_spec(TASK, name="adversarial/task_small")
    book = FootprintBook()
    ex = executor(book)
    assert ex._known_footprint(spec) is None                        # nothing measured yet: the slot measures
    fp = Footprint(spec.key, "cpu", "cpu", ex.config.numerics.label, params_bytes=4096, reference_peak_bytes=1 << 20)
    ex._keep_footprints(spec, [{"task_key": spec.key, "footprint": fp.to_dict()},
                               {"task_key": "another", "footprint": fp.to_dict()}])
    assert book.known(spec, "cpu", ex.config.numerics) == fp        # the slot's measurement kept
    assert ex._known_footprint(spec) == fp.to_dict()                 # and handed to the next evaluation
    assert executor(None)._known_footprint(spec) is None             # no book, no store: as before
