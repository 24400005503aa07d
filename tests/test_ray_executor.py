"""``--executor ray`` on a real Ray cluster: a head and worker nodes, each its own ``ray start``
process tree on loopback (``tests/raycluster.py``), running ``kernelloop optimize --model builtin
--device cpu`` on seed tasks as a real CLI process.

* A worker node's raylet is SIGKILLed while an evaluation runs on it and another node joins:
  the run completes, the lost evaluation was re-queued as a harness failure (its cause kept in
  ``infra_retries``) and evaluated on the new node, and every attempt was evaluated exactly once.
* The driver is SIGKILLed while an evaluation is in flight; ``--resume`` on the same cluster
  finishes the run with nothing lost and nothing evaluated twice.

Each node has a build cache of its own (``KERNELLOOP_CACHE``), as separate machines would.

The waits are for events the run reports (an evaluation in flight, the CLI's exit), never for a
time: their deadlines only end a run that is stuck. They are generous because a loaded machine
is slow, not wrong: beside a CPU hog and the rest of the suite on 2 cores, the first evaluation
on node a took over 240 s to start (its build on a starved node).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import raycluster  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
STUCK_S = 900          # a wait this long means the run is stuck, not slow


@pytest.fixture
def cluster_or_skip():
    """A head node with no resources of its own (the driver's); each test adds its workers."""
    why = raycluster.missing()
    if why:
        pytest.skip(why)
    with raycluster.LoopbackCluster() as cluster:
        yield cluster

EVAL_ARGS = ["--model", "builtin", "--device", "cpu", "--no-compile", "--trials", "2", "--timed-runs", "3",
             "--critic", "grounded"]


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_until(what: str, predicate, proc: subprocess.Popen, timeout: float = STUCK_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"the CLI exited ({proc.returncode}) before {what}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def audit(db: Path, run_id: int) -> dict:
    from executors.audit import run_audit
    from store import Store

    store = Store(db)
    try:
        return run_audit(store, run_id)
    finally:
        store.close()


def cli(cluster, tmp_path: Path, name: str, args: list[str], events_path: Path) -> subprocess.Popen:
    env = cluster.env(KERNELLOOP_RAY_EVENTS=str(events_path), KERNELLOOP_CACHE=str(tmp_path / "driver-cache"),
                      KERNELLOOP_RAY_SLOT_WAIT_S=str(STUCK_S))
    return cluster.popen([sys.executable, "-m", "kernelloop.cli", *args, "--executor", "ray",
                          "--ray-address", cluster.address], env=env, cwd=str(Path(__file__).resolve().parent.parent),
                         stdout=open(tmp_path / f"{name}.out", "wb"), stderr=open(tmp_path / f"{name}.err", "wb"))


def output(tmp_path: Path, name: str) -> str:
    return ((tmp_path / f"{name}.out").read_text(errors="replace")[-3000:] + "\n--- stderr ---\n"
            + (tmp_path / f"{name}.err").read_text(errors="replace")[-3000:])


def test_a_worker_node_killed_mid_evaluation_costs_one_re_queued_evaluation(cluster_or_skip, tmp_path: Path) -> None:
    cluster = cluster_or_skip
    db, ev = tmp_path / "store.db", tmp_path / "events.jsonl"
    cluster.add_worker("a", 3, KERNELLOOP_CACHE=str(tmp_path / "cache-a"))
    proc = cli(cluster, tmp_path, "run", ["optimize", "seeds/conv2d_divide_leakyrelu", "--rounds", "1",
                                          "--samples", "2", *EVAL_ARGS, "--db", str(db)], ev)
    try:
        wait_until("an evaluation in flight on node a", lambda: any(e["event"] == "evaluate" for e in events(ev)), proc)
        node_a = next(e["node"] for e in events(ev) if e["event"] == "evaluate")
        cluster.kill_worker("a")
        cluster.add_worker("b", 3, KERNELLOOP_CACHE=str(tmp_path / "cache-b"))
        rc = proc.wait(STUCK_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, output(tmp_path, "run")
    report = audit(db, 1)
    assert report["whole"] and report["status"] == "finished", report
    assert report["attempts_with_code"] == 2 and report["evaluations"] == 2, report
    assert "infra_error" not in report["statuses"], report
    log = events(ev)
    lost = [e for e in log if e["event"] == "lost"]
    assert lost and all(e["node"] == node_a for e in lost), log
    done = [e for e in log if e["event"] == "done"]
    assert len(done) == 2 and all(e["node"] != node_a for e in done), log     # both finished on node b
    assert report["evaluations_with_infra_retries"] >= 1, report              # the loss is on record


def test_driver_killed_then_resumed_on_the_cluster_loses_and_repeats_nothing(cluster_or_skip, tmp_path: Path) -> None:
    cluster = cluster_or_skip
    db, ev = tmp_path / "store.db", tmp_path / "events.jsonl"
    cluster.add_worker("c", 3, KERNELLOOP_CACHE=str(tmp_path / "cache-c"))
    first = cli(cluster, tmp_path, "first", ["optimize", "seeds/gemm_groupnorm_leakyrelu_sum", "--rounds", "1",
                                             "--samples", "2", *EVAL_ARGS, "--db", str(db)], ev)
    try:
        wait_until("an evaluation in flight", lambda: any(e["event"] == "evaluate" for e in events(ev)), first)
        first.kill()                                    # SIGKILL: nothing is marked, nothing flushed
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    before = audit(db, 1)
    assert before["status"] == "running" and before["evaluations"] == 0, before
    assert before["attempts_with_code"] == 2, before
    second = cli(cluster, tmp_path, "second", ["optimize", "--resume", "1", "--db", str(db)], ev)
    try:
        rc = second.wait(STUCK_S)
    finally:
        if second.poll() is None:
            second.kill()
    assert rc == 0, output(tmp_path, "second")
    after = audit(db, 1)
    assert after["whole"] and after["status"] == "finished", after
    assert after["attempts"] == before["attempts"] and after["evaluations"] == 2, after
