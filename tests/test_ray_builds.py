"""Where the Ray executor's candidates build, without a cluster: the setting that picks the slot's
own sandbox or Ray build tasks (``KERNELLOOP_RAY_BUILDS``), the cores a cuda slot's builds get
(its node's CPUs over its GPUs, from Ray's view of the node) and how a sandbox sizes its builds
on them. Session p measured build tasks at 0.61x the local executor; a slot that builds sizes its
builds as the local executor does, but on its share of the node, not on every core it sees."""
from __future__ import annotations

import json
import sys
import threading
import types

import pytest

import sandbox.slots
from executors import ExecutorError
from executors import ray_slot
from executors.ray_executor import EventLog, RayExecutor, RaySlot, build_place
from executors.ray_slot import EvaluationSlot, slot_cores
from sandbox.evaluate import Sandbox
from sandbox.slots import REFERENCE_AFFINITY
from sandbox.result import EvalConfig, EvalResult, Status
from sandbox.slots import build_plan, usable_cores
from sandbox.tasks import TaskSpec

SPEC = TaskSpec(name="t/relu", path="/relu.py", source="import torch\n")


@pytest.mark.parametrize("setting, place", [(None, "slot"), ("", "slot"), ("  ", "slot"), ("slot", "slot"),
                                            (" SLOT\n", "slot"), ("tasks", "tasks"), (" Tasks ", "tasks")])
def test_builds_go_to_the_slot_unless_tasks_are_asked_for(monkeypatch, setting, place):
    if setting is None:
        monkeypatch.delenv("KERNELLOOP_RAY_BUILDS", raising=False)
    else:
        monkeypatch.setenv("KERNELLOOP_RAY_BUILDS", setting)
    assert build_place() == place


def test_the_executors_own_option_comes_before_the_environment(monkeypatch):
    monkeypatch.setenv("KERNELLOOP_RAY_BUILDS", "tasks")
    assert build_place("slot") == "slot"
    monkeypatch.setenv("KERNELLOOP_RAY_BUILDS", "slot")
    assert build_place("TASKS") == "tasks"


@pytest.mark.parametrize("setting", ["task", "nodes", "slot,tasks", "0"])
def test_any_other_place_is_an_error_naming_the_setting(monkeypatch, setting):
    monkeypatch.setenv("KERNELLOOP_RAY_BUILDS", setting)
    with pytest.raises(ExecutorError, match=r"KERNELLOOP_RAY_BUILDS=.*'slot'.*'tasks'"):
        build_place()
    monkeypatch.delenv("KERNELLOOP_RAY_BUILDS")
    with pytest.raises(ExecutorError, match="KERNELLOOP_RAY_BUILDS"):
        build_place(setting)


@pytest.mark.parametrize("cores", [1, 4, 16, 64])
def test_a_sandbox_sizes_its_builds_on_the_cores_it_is_given(cores):
    with Sandbox("cpu", EvalConfig(), warm_workers=0, cores=cores) as sb:
        assert (sb.build_slots, sb.build_jobs) == build_plan(cores)
        assert sb._build_sem._value == sb.build_slots          # builds at once, as planned


def test_a_sandbox_given_no_cores_sizes_its_builds_on_those_it_may_run_on():
    with Sandbox("cpu", EvalConfig(), warm_workers=0) as sb:
        assert (sb.build_slots, sb.build_jobs) == build_plan(usable_cores())
    assert build_plan(16) == (4, 4) != build_plan(2)             # so the cases above tell them apart


def _ray_seeing(monkeypatch, nodes):
    """Ray's view of the cluster as ``slot_cores`` reads it (``ray.nodes()``), no cluster started."""
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(nodes=lambda: nodes))


def _no_ray(monkeypatch):
    def nodes():
        raise AssertionError("Ray was asked about the nodes")
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(nodes=nodes))


def test_a_cpu_slot_or_one_without_a_node_builds_on_the_cores_it_sees(monkeypatch):
    _no_ray(monkeypatch)
    assert slot_cores("cpu", "n1") is None
    assert slot_cores("cuda", "") is None


def test_a_cuda_slot_gets_its_nodes_cpus_over_its_gpus_at_most_the_cores_it_may_use(monkeypatch):
    _ray_seeing(monkeypatch, [
        {"NodeID": "head", "Alive": True, "Resources": {"CPU": 4.0}},
        {"NodeID": "n1", "Alive": True, "Resources": {"CPU": 32.0, "GPU": 2.0, "memory": 1e11}},
        {"NodeID": "n2", "Alive": True, "Resources": {"CPU": 30.0, "GPU": 4.0}},
        {"NodeID": "gone", "Alive": False, "Resources": {"CPU": 64.0, "GPU": 1.0}},
        {"NodeID": "nocpu", "Alive": True, "Resources": {"CPU": 0.0, "GPU": 8.0}}])
    monkeypatch.setattr(sandbox.slots, "usable_cores", lambda: 128)
    assert slot_cores("cuda", "n1") == 16
    assert slot_cores("cuda", "n2") == 7                         # whole cores, rounded down
    assert slot_cores("cuda", "head") is None                    # no GPU there
    assert slot_cores("cuda", "gone") is None                    # a dead node's resources say nothing
    assert slot_cores("cuda", "nocpu") is None                   # no CPUs given to Ray: the cores it sees
    assert slot_cores("cuda", "elsewhere") is None
    monkeypatch.setattr(sandbox.slots, "usable_cores", lambda: 8)
    assert slot_cores("cuda", "n1") == 8                         # never more than this process may run on


@pytest.mark.parametrize("builds_here, expected", [(True, build_plan(16)), (False, build_plan(usable_cores()))])
def test_a_slot_that_builds_sizes_its_sandbox_on_its_share_and_says_so(monkeypatch, builds_here, expected):
    asked = []
    monkeypatch.setattr(ray_slot, "slot_cores", lambda device, node: asked.append(device) or 16)
    monkeypatch.setattr(EvaluationSlot, "_facts", lambda self: {})     # no device probe
    slot = EvaluationSlot("cpu", EvalConfig().model_dump_json(), 0, None, builds_here)
    try:
        assert asked == (["cpu"] if builds_here else [])
        described = json.loads(slot.describe())
        assert (described["build_slots"], described["build_jobs"]) == expected
        assert (slot.sandbox.build_slots, slot.sandbox.build_jobs) == expected
    finally:
        slot.close()


class _Method:
    """A slot actor's method as the driver calls it (``.options(...).remote(...)``), calls recorded."""

    def __init__(self, name, calls, reply=None):
        self.name, self.calls, self.reply = name, calls, reply

    def options(self, **_):
        return self

    def remote(self, *args):
        self.calls.append((self.name, args))
        return self.reply


def _driver(builds, calls):
    ex = object.__new__(RayExecutor)         # the cluster half of __init__ is not under test
    ex.device, ex.config, ex.store, ex._footprints, ex.builds = "cpu", EvalConfig(), None, None, builds
    ex._aborted, ex._slots_changed, ex.events = threading.Event(), threading.Condition(), EventLog(None)
    ex._ray = types.SimpleNamespace(get=lambda ref, timeout=None: ref)
    verdict = EvalResult(status=Status.correct, task=SPEC.name, device="cpu").model_dump(mode="json")
    actor = types.SimpleNamespace(prepare=_Method("prepare", calls),
                                  evaluate=_Method("evaluate", calls, json.dumps({"result": verdict, "node": "n1"})))
    ex.slots = [RaySlot(0, actor, "n1")]
    ex._build = lambda slot, spec, source: calls.append(("build", (spec.name,))) or json.dumps({"ok": True})
    return ex


def test_the_driver_leaves_the_build_to_the_slot_or_sends_it_to_a_build_task():
    calls = []
    assert _driver("slot", calls).evaluate(SPEC, "src").status == Status.correct
    assert [name for name, _ in calls] == ["evaluate"]
    assert calls[0][1][1:3] == ("src", None)                        # no build outcome: the slot's sandbox builds

    calls.clear()
    assert _driver("tasks", calls).evaluate(SPEC, "src").status == Status.correct
    assert [name for name, _ in calls] == ["prepare", "build", "evaluate"]   # the reference starts while it builds
    assert calls[2][1][1:3] == ("src", json.dumps({"ok": True}))


def test_a_tasks_evaluations_follow_its_reference_until_its_slot_is_that_much_busier():
    """As the local sandbox's GPUs: a task's candidates go to the slot already running its
    reference until that slot has ``REFERENCE_AFFINITY`` more in flight than the least-loaded
    one (each slot would start its own reference otherwise); a new task goes to the least loaded."""
    ex = _driver("slot", [])
    ex.slots = [RaySlot(0, None, "n1"), RaySlot(1, None, "n2")]
    picked = [ex._pick(SPEC).index for _ in range(REFERENCE_AFFINITY + 1)]
    assert picked == [0] * (REFERENCE_AFFINITY + 1)             # slot 1 idle, but without the reference
    assert ex._pick(SPEC).index == 1                             # now that much busier: the other slot
    other = TaskSpec(name="other", path="other.py", source="x = 1\n")
    assert ex._pick(other).index == 1                            # least loaded (5 against 1)
