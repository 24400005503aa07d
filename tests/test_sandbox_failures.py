"""Every worker exit carries a cause: a worker whose own (harness) code raises says so."""
from __future__ import annotations

import pytest

from sandbox.process import WorkerDied, WorkerProcess


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
