"""Two drivers writing two runs into one PostgreSQL store at the same moment lose nothing.

Each driver is its own process running the real loop (``tests/fixtures/drivers/store_driver.py``:
builtin proposals, every model call, attempt, evaluation and analysis the loop stores) over the
same seed tasks, both started on a new database at once (the schema is created once, the
shared tasks are stored once). Afterwards each run is whole: every (task, round, sample)
attempt once, each with its model call and exactly one evaluation, every round analysed.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from executors.audit import run_audit
from store import Store
from store.models import Analysis, Attempt, ModelCall, Run, Task

DRIVER = Path(__file__).resolve().parent / "fixtures" / "drivers" / "store_driver.py"
TASKS = ["seeds/conv2d_divide_leakyrelu", "seeds/gemm_groupnorm_leakyrelu_sum", "seeds/gemm_sigmoid_gemm_logsumexp"]
ROUNDS, SAMPLES = 3, 3

pytestmark = pytest.mark.timeout(300)


def test_two_drivers_write_two_runs_into_one_postgresql_store_at_once(postgres_server) -> None:
    url = postgres_server.new_url()
    drivers = [subprocess.Popen([sys.executable, str(DRIVER), url, str(ROUNDS), str(SAMPLES), *TASKS],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [d.communicate(timeout=240) for d in drivers]
    for d, (out, err) in zip(drivers, outputs):
        assert d.returncode == 0, err[-3000:]
    run_ids = sorted(int(out.split()[-1]) for out, _ in outputs)
    store = Store(url)
    try:
        expected = len(TASKS) * ROUNDS * SAMPLES
        with store.reader() as s:
            assert sorted(s.scalars(sa.select(Run.id))) == run_ids
            assert s.scalar(sa.select(sa.func.count(Task.id))) == len(TASKS)      # shared, stored once
            for run_id in run_ids:
                assert s.get(Run, run_id).status == "finished"
                assert s.scalar(sa.select(sa.func.count(Attempt.id)).where(Attempt.run_id == run_id)) == expected
                calls = s.scalar(sa.select(sa.func.count(ModelCall.id)).where(
                    ModelCall.run_id == run_id, ModelCall.purpose == "propose"))
                assert calls == expected
                analysed = set(s.execute(sa.select(Analysis.task_id, Analysis.round).where(Analysis.run_id == run_id)))
                assert len(analysed) == len(TASKS) * ROUNDS
        for run_id in run_ids:
            audit = run_audit(store, run_id)
            assert audit["whole"], audit
            coded = audit["attempts_with_code"]
            assert coded > 0 and audit["evaluations"] == coded, audit
    finally:
        store.close()
