"""The executor seam without a cluster: the registry, the local executor (the Sandbox as it was),
the pieces of the Ray slot that need no Ray (the build outcome a slot takes, the footprints it
relays), and the repacking of Ray's wheel for the GPU host."""
from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

from executors import ExecutorError, executor_names, open_executor
from executors.base import Executor, device_facts_of
from executors.ray_slot import RelayedFootprints, SlotSandbox, spec_data
from sandbox.evaluate import Sandbox
from sandbox.footprint import Footprint
from sandbox.result import BuildInfo, EvalConfig, EvalResult, Status
from sandbox.tasks import TaskSpec

REPO = Path(__file__).resolve().parent.parent
SPEC = TaskSpec(name="t/relu", path="/relu.py", source="import torch\n", overrides={"bias_shape": (16, 1, 1)})


def test_the_registry_names_local_and_ray_and_refuses_others():
    assert executor_names()[:2] == ["local", "ray"]
    with pytest.raises(ExecutorError, match="no executor 'slurm': choose one of local, ray"):
        open_executor("slurm", "cpu", EvalConfig())


def test_local_is_the_sandbox_unchanged_and_measures_facts_on_this_host():
    ex = open_executor("local", "cpu", EvalConfig(), warm_workers=0, address="ignored:1")
    try:
        assert type(ex) is Sandbox and isinstance(ex, Executor)
        assert len(ex.slots) == 1 and ex.device == "cpu"
        assert device_facts_of(ex) is None        # the CLI measures this host, as before
    finally:
        ex.close()


def test_a_task_travels_with_its_overrides_unchanged():
    data = spec_data(SPEC)
    assert TaskSpec(**data).key == SPEC.key and data["overrides"]["bias_shape"] == (16, 1, 1)


def _slot_sandbox() -> SlotSandbox:
    return SlotSandbox("cpu", EvalConfig(), warm_workers=0)


def test_a_slot_takes_the_build_outcome_of_its_node_instead_of_building():
    sb = _slot_sandbox()
    try:
        result = EvalResult(status=Status.runtime_error, task="t/relu", device="cpu")
        sb.use_build({"ok": True, "build": BuildInfo(ok=True, seconds=12.5, extensions=["ext_1"]).model_dump(),
                      "wait_s": 2.0})
        assert sb._build(SPEC, "not even python", result) is True      # no worker ran: it would fail
        assert result.build.seconds == 12.5 and result.phases["build_wait"] == 2.0

        failed = EvalResult(status=Status.runtime_error, task="t/relu", device="cpu")
        sb.use_build({"ok": False, "status": "compile_error", "error_type": "BuildError",
                      "error_message": "expected ';'", "stderr": "x", "build": BuildInfo(ok=False).model_dump()})
        assert sb._build(SPEC, "src", failed) is False
        assert failed.status is Status.compile_error and failed.error_message == "expected ';'"
    finally:
        sb.use_build(None)
        sb.close()


def test_a_slot_relays_footprints_given_by_the_driver_and_hands_back_what_it_measured():
    relay = RelayedFootprints()
    given = Footprint(task_key=SPEC.key, device="cpu", device_name="x", numerics="fp32/default", inputs_bytes=64)
    relay.give(SPEC, "cpu", "fp32/default", given.to_dict())
    assert relay.book._load(SPEC, "cpu", "fp32/default") == given
    assert relay.book._load(SPEC, "cpu", "bf16/default") is None
    measured = Footprint(task_key=SPEC.key, device="cpu", device_name="x", numerics="bf16/default", inputs_bytes=32)
    relay.book._save(SPEC, measured)
    out = relay.drain()
    assert out == [{"task_key": SPEC.key, "footprint": measured.to_dict()}]
    assert json.loads(json.dumps(out)) == out and relay.drain() == []          # JSON, and handed back once


def test_rays_wheel_is_repacked_without_its_java_jar(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    from repack_ray_wheel import repack

    src, dst = tmp_path / "ray-1-py3-none-any.whl", tmp_path / "out.whl"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("ray/__init__.py", "x = 1\n")
        z.writestr("ray/jars/ray_dist.jar", b"\0" * 4096)
        z.writestr("ray-1.dist-info/RECORD", "ray/__init__.py,sha256=a,6\nray/jars/ray_dist.jar,sha256=b,4096\n"
                                              "ray-1.dist-info/RECORD,,\n")
    repack(str(src), str(dst))
    with zipfile.ZipFile(dst) as z:
        assert sorted(z.namelist()) == ["ray-1.dist-info/RECORD", "ray/__init__.py"]
        assert "jars" not in z.read("ray-1.dist-info/RECORD").decode()
        assert z.read("ray/__init__.py") == b"x = 1\n"
