"""What runs on a Ray node for the ``ray`` executor: the build task (CPU resources) and the
evaluation slot actor (one GPU, or one CPU slot on the CPU target) around an unchanged
``Sandbox``, so its isolation, memory admission and timing rules apply on every node as on
one host.

What travels: the task (``TaskSpec`` fields) and the candidate's source go to the node; a
build leaves its binaries in that node's own build cache (``KERNELLOOP_CACHE`` there) and
only its outcome comes back. Everything that comes back to the driver is JSON text (the
``EvalResult``, the build's outcome, measured footprints): the driver parses it with ``json``
and pydantic and never unpickles an object that a candidate could have shaped. Nodes never
open the store.
"""
from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any, Optional

from sandbox.admission import TaskTooLarge
from sandbox.backends import backend_for
from sandbox.evaluate import Sandbox
from sandbox.footprint import Footprint, FootprintBook
from sandbox.pool import BUILD_WARM_MESSAGE, BuildPause, WarmPool
from sandbox.result import BuildInfo, EvalConfig, EvalResult, Status
from sandbox.tasks import TaskSpec


def spec_data(spec: TaskSpec) -> dict[str, Any]:
    """A task as it travels to a node (Ray pickles it driver -> node; overrides keep their types)."""
    return {"name": spec.name, "path": spec.path, "source": spec.source, "overrides": dict(spec.overrides)}


def node_id() -> str:
    """The Ray node this runs on; "" where Ray is not running in this process (asking Ray's runtime
    context there would start a local Ray instance that outlives the call: a test of the build task
    left one beside the rest of the suite, dashboard and idle workers included)."""
    import ray

    if not ray.is_initialized():
        return ""
    return ray.get_runtime_context().get_node_id()


# --------------------------------------------------------------------------- builds

# A Ray worker process runs one build task after another (Ray reuses its workers), so it keeps one
# build worker warm for the next task it gets, as a Sandbox's build pool does: torch's import
# (1.5-3 s on a GPU host) is paid ahead instead of inside each build. Keyed by what the build worker
# is started with; its processes die with the Ray worker (the keeper's parent-death signal).
_NODE_BUILD_POOLS: dict[tuple[str, ...], WarmPool] = {}
_NODE_BUILD_POOLS_LOCK = threading.Lock()


def close_node_build_pools() -> None:
    """Stop this process's warm build workers (a test's cleanup; a Ray worker's exit does it too)."""
    with _NODE_BUILD_POOLS_LOCK:
        pools = list(_NODE_BUILD_POOLS.values())
        _NODE_BUILD_POOLS.clear()
    for pool in pools:
        pool.close()


class NodeBuilder:
    """The part of a Sandbox that its build step reads (``Sandbox._build`` and ``_build_env``),
    on a node that only builds: no device is opened and no slot is held. The build is the
    sandbox's own, unchanged: a worker with the GPU hidden, the content-hashed cache, the
    compiler's first error. With ``keep_warm`` its worker comes from this process's warm build
    pool (one worker started ahead for the next build); without, each build starts its own."""

    _build_env = Sandbox._build_env
    _build = Sandbox._build
    _spawn_build = Sandbox._spawn_build

    def __init__(self, device: str, config: EvalConfig, arch: Optional[str], jobs: int, keep_warm: bool = False):
        self.device, self.config, self.arch, self.build_jobs = device, config, arch, jobs
        self.backend = backend_for(config.backend, device)
        self._build_pause = BuildPause()     # nothing is timed on a node that only builds: never held
        self._build_pool: Optional[WarmPool] = self._node_pool() if keep_warm else None

    def _node_pool(self) -> WarmPool:
        key = (self.device, *sorted(f"{k}={v}" for k, v in self._build_env().items()))
        with _NODE_BUILD_POOLS_LOCK:
            pool = _NODE_BUILD_POOLS.get(key)
            if pool is None:
                pool = _NODE_BUILD_POOLS[key] = WarmPool(self._spawn_build, BUILD_WARM_MESSAGE, 1)
        return pool


def build_on_node(spec: dict[str, Any], source: str, device: str, config_json: str, arch: Optional[str],
                  jobs: int, keep_warm: bool = False) -> str:
    """Build a candidate into this node's cache; its outcome as JSON (``BuildOutcome`` fields).
    ``keep_warm``: take this process's warm build worker and start the next one (the Ray build task)."""
    task = TaskSpec(**spec)
    config = EvalConfig.model_validate_json(config_json)
    scratch = EvalResult(status=Status.runtime_error, task=task.name, device=device, config=config)
    ok = NodeBuilder(device, config, arch, jobs, keep_warm)._build(task, source, scratch)
    return json.dumps({"ok": ok, "node": node_id(), "status": None if ok else scratch.status.value,
                       "error_type": scratch.error_type, "error_message": scratch.error_message,
                       "stderr": scratch.stderr,
                       "build": scratch.build.model_dump(mode="json") if scratch.build else None})


class SlotSandbox(Sandbox):
    """A Sandbox whose build step takes the outcome of the build task that ran on this node
    (the binaries are in this node's cache). Without one (the build ran on another node, whose
    cache this node does not share), it builds as any Sandbox does."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._prebuilt = threading.local()

    def use_build(self, outcome: Optional[dict[str, Any]]) -> None:
        """The build outcome for the evaluation this thread runs next (None: build here)."""
        self._prebuilt.outcome = outcome

    def _build(self, spec: TaskSpec, source: str, result: EvalResult) -> bool:
        outcome = getattr(self._prebuilt, "outcome", None)
        if outcome is None:
            return super()._build(spec, source, result)
        result.build = BuildInfo.model_validate(outcome["build"]) if outcome.get("build") else None
        result.phases["build_wait"] = round(result.phases.get("build_wait", 0.0) + outcome.get("wait_s", 0.0), 3)
        if not outcome["ok"]:
            result.status = Status(outcome["status"])
            result.error_type, result.error_message = outcome.get("error_type"), outcome.get("error_message")
            result.stderr = outcome.get("stderr") or ""
        return bool(outcome["ok"])


# --------------------------------------------------------------------------- footprints

class RelayedFootprints:
    """The slot's footprint book: what the driver read from the store comes with each call;
    what the slot measures goes back with the call's reply (the driver stores it)."""

    def __init__(self) -> None:
        self._given: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._outbox: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.book = FootprintBook(load=self._load, save=self._save)

    def give(self, spec: TaskSpec, device: str, numerics_label: str, footprint: Optional[dict[str, Any]]) -> None:
        if footprint is not None:
            with self._lock:
                self._given[(spec.key, device, numerics_label)] = footprint

    def _load(self, spec: TaskSpec, device: str, numerics_label: str) -> Optional[Footprint]:
        with self._lock:
            data = self._given.get((spec.key, device, numerics_label))
        return Footprint.from_dict(data) if data is not None else None

    def _save(self, spec: TaskSpec, fp: Footprint) -> None:
        with self._lock:
            self._outbox[(spec.key, fp.device, fp.numerics)] = {"task_key": spec.key, "footprint": fp.to_dict()}

    def drain(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self._outbox = list(self._outbox.values()), {}
        return out


# --------------------------------------------------------------------------- the slot actor

def slot_cores(device: str, node: str) -> Optional[int]:
    """The cores one slot's builds may use: its node's CPU resources over the node's GPUs (each
    GPU is a slot), at most the cores this process may run on. Without Ray's view of the node, or
    on the CPU target (whose slots hold a CPU each and build on the cores they see), None: the
    sandbox sizes its builds on the cores it sees."""
    if device != "cuda" or not node:
        return None
    import ray

    from sandbox.slots import usable_cores

    for n in ray.nodes():
        if n.get("NodeID") == node and n.get("Alive", True):
            res = n.get("Resources") or {}
            cpus, gpus = float(res.get("CPU", 0)), float(res.get("GPU", 0))
            if cpus >= 1 and gpus >= 1:
                return max(1, min(usable_cores(), int(cpus // gpus)))
    return None


class EvaluationSlot:
    """One evaluation slot: a Sandbox that sees one GPU (Ray sets CUDA_VISIBLE_DEVICES for the
    actor's ``num_gpus=1``) or, on the CPU target, the node's CPU; its reference workers live as
    long as the actor. Methods answer JSON text."""

    def __init__(self, device: str, config_json: str, warm_workers: Optional[int], precompute: Optional[bool],
                 builds_here: bool = False):
        """``builds_here``: candidates build in this slot's sandbox, on its share of the node's cores
        (``slot_cores``) rather than as Ray tasks."""
        self.relay = RelayedFootprints()
        self.node = node_id()
        cores = slot_cores(device, self.node) if builds_here else None
        self.sandbox = SlotSandbox(device, EvalConfig.model_validate_json(config_json), footprints=self.relay.book,
                                   warm_workers=warm_workers, precompute=precompute, cores=cores)

    def describe(self) -> str:
        sb = self.sandbox
        return json.dumps({"node": self.node, "host": socket.gethostname(), "pid": os.getpid(),
                           "build_slots": sb.build_slots, "build_jobs": sb.build_jobs,
                           "device_name": sb.device_name, "torch_version": sb.torch_version, "arch": sb.arch,
                           "gpus": [g for g in sb.slots if g is not None], "facts": self._facts()})

    def _facts(self) -> dict[str, Any]:
        """``agent.types.DeviceFacts`` fields, measured here (the probe is cached per node)."""
        import torch

        sb = self.sandbox
        facts: dict[str, Any] = {"device": sb.device, "name": sb.device_name, "torch_version": sb.torch_version}
        if sb.device == "cuda":
            props = torch.cuda.get_device_properties(0)
            facts["compute_capability"] = f"{props.major}.{props.minor}"
            facts["sm_count"] = props.multi_processor_count
        try:
            from hardware.probe import get_probe

            probe = get_probe(sb.device, measure=True)
            if sb.device == "cuda":
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - device facts are optional context
            probe = None
        if probe is not None:
            facts["bandwidth_gbps"], facts["tflops"] = probe.bandwidth_gbps, dict(probe.tflops)
        return facts

    def ping(self) -> str:
        return self.node

    def prepare(self, spec: dict[str, Any], footprint: Optional[dict[str, Any]]) -> None:
        """Start the task's reference on this slot while the candidate builds elsewhere (never
        blocks: ``Sandbox.prepare``), as the local executor does before its own build; a footprint
        it measures goes back with the next evaluation's reply."""
        task = TaskSpec(**spec)
        sb = self.sandbox
        self.relay.give(task, sb.device, sb.config.numerics.label, footprint)
        sb.prepare(task)

    def evaluate(self, spec: dict[str, Any], source: str, build: Optional[str],
                 footprint: Optional[dict[str, Any]]) -> str:
        task = TaskSpec(**spec)
        sb = self.sandbox
        self.relay.give(task, sb.device, sb.config.numerics.label, footprint)
        outcome = json.loads(build) if build else None
        if outcome is not None and outcome.get("node") != self.node:
            outcome = None              # built on another node: its cache is not here
        sb.use_build(outcome)
        try:
            result = sb.evaluate(task, source)
        except TaskTooLarge as exc:
            return json.dumps({"too_large": too_large_data(exc), "footprints": self.relay.drain()})
        finally:
            sb.use_build(None)
        return json.dumps({"result": result.model_dump(mode="json"), "node": self.node,
                           "footprints": self.relay.drain()})

    def too_large(self, spec: dict[str, Any], footprint: Optional[dict[str, Any]]) -> str:
        task = TaskSpec(**spec)
        sb = self.sandbox
        self.relay.give(task, sb.device, sb.config.numerics.label, footprint)
        big = sb.too_large(task)
        return json.dumps({"too_large": too_large_data(big) if big is not None else None,
                           "footprints": self.relay.drain()})

    def release(self, spec: dict[str, Any]) -> None:
        self.sandbox.release(TaskSpec(**spec))

    def abort(self) -> None:
        self.sandbox.abort()

    def close(self) -> None:
        self.sandbox.close()


def too_large_data(exc: TaskTooLarge) -> dict[str, Any]:
    return {"task": exc.task, "pool": exc.pool, "needed": exc.needed, "available": exc.available,
            "detail": exc.detail}
