"""The ``ray`` executor: one run's evaluations spread over a Ray cluster.

* Builds run where the candidate will be evaluated (``KERNELLOOP_RAY_BUILDS=slot``, the default):
  the slot's own ``Sandbox`` builds it, as the local executor does (warm build workers, the
  task's reference started while it builds), on its share of the node's cores (the node's CPUs
  over its GPUs). With ``KERNELLOOP_RAY_BUILDS=tasks`` builds are Ray tasks on CPU resources
  (``build_on_node``) instead, placed on the node of the slot that will evaluate the candidate
  (soft node affinity), so the build lands in the cache that slot's workers read; Ray re-runs a
  build whose worker or node died (``max_retries``). That spreads builds over CPU-only nodes, at
  a cost measured on two H200s (session p): 0.61x the local executor's rate, its first verdict
  at +49 s against +25 s and each candidate waiting longer for a warm worker.
* Each evaluation slot is a Ray actor (``EvaluationSlot``) holding one GPU (``num_gpus=1``) or,
  on the CPU target, one CPU, around an unchanged ``Sandbox`` with its reference workers. Ray
  restarts a lost slot wherever its resources are free (``max_restarts=-1``).
* An evaluation whose slot was lost (its node or actor died: ``RayActorError``,
  ``ActorDiedError``, ``ActorUnavailableError``, ``NodeDiedError``) is a harness failure
  (``sandbox.failures``): it is re-queued to the next live slot (at most ``MAX_INFRA_RETRIES``
  times, the causes kept in ``EvalResult.infra_retries``; past them it is ``infra_error``, which
  ``optimize --resume`` evaluates again). The lost slot leaves the choice until Ray has restarted
  it (an at-least-once ``ping``, ``max_task_retries=-1``, answers once it runs again); while no
  slot is live, evaluations wait for one, at most ``KERNELLOOP_RAY_SLOT_WAIT_S``. Evaluations
  themselves are at-most-once (``max_task_retries=0``): a lost one is re-queued by the driver,
  so the loss is on record.
* The driver stays the store's one writer: replies are JSON text (``executors.ray_slot``).
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from executors.base import ExecutorError
from executors.ray_slot import EvaluationSlot, build_on_node, spec_data
from sandbox.admission import TaskTooLarge
from sandbox.evaluate import sha256_text
from sandbox.slots import slot_preference
from sandbox.failures import MAX_INFRA_RETRIES
from sandbox.footprint import Footprint
from sandbox.result import EvalConfig, EvalResult, Status
from sandbox.tasks import TaskSpec

# How long an evaluation waits for a lost slot to come back (a node restarting, an autoscaler
# adding one) before it is stored as infra_error.
SLOT_WAIT_S = float(os.environ.get("KERNELLOOP_RAY_SLOT_WAIT_S", "900"))
# Evaluations one slot actor runs at once (its Sandbox pipelines them: builds and loads
# overlap with the device-held checks of others; the device itself is held by one at a time).
SLOT_CONCURRENCY = int(os.environ.get("KERNELLOOP_RAY_SLOT_CONCURRENCY", "16"))
BUILD_PLACES = ("slot", "tasks")


def build_place(value: Optional[str] = None) -> str:
    """Where candidates build (``slot``: in the evaluating slot's sandbox; ``tasks``: as Ray tasks),
    from ``value`` or ``KERNELLOOP_RAY_BUILDS``; anything else is an error naming the setting."""
    raw = (value if value is not None else os.environ.get("KERNELLOOP_RAY_BUILDS", "slot")).strip().lower() or "slot"
    if raw not in BUILD_PLACES:
        raise ExecutorError(f"KERNELLOOP_RAY_BUILDS={raw!r}: use 'slot' (build where the candidate is evaluated) "
                            "or 'tasks' (builds as Ray tasks on any node's CPUs)")
    return raw


def lost_slot_errors() -> tuple[type[BaseException], ...]:
    """Ray's exceptions for a slot or build that went away with its process or node."""
    from ray import exceptions as rx

    return (rx.RayActorError, rx.NodeDiedError, rx.WorkerCrashedError, rx.ObjectLostError,
            rx.LocalRayletDiedError)


@dataclass
class RaySlot:
    """The driver's view of one slot actor."""

    index: int
    actor: Any
    node: str
    load: int = 0                                   # evaluations in flight on it
    tasks: set[str] = field(default_factory=set)    # task keys whose references it started
    down: bool = False                              # lost; Ray is restarting it


class SlotsLost(Exception):
    """Every evaluation slot was lost and none came back in time."""


class EventLog:
    """Optional JSON-lines log of dispatches and losses (``KERNELLOOP_RAY_EVENTS``): what ran where."""

    def __init__(self, path: Optional[str]):
        self.path, self._lock = path, threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"t": round(time.time(), 3), "event": event, **fields})
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")


class RayExecutor:
    """Evaluates candidates on a Ray cluster; the same interface as ``Sandbox`` (``executors.base``)."""

    name = "ray"

    def __init__(self, device: str, config: EvalConfig, *, store: Any = None, address: Optional[str] = None,
                 slots: Optional[int] = None, build_cpus: Optional[float] = None,
                 warm_workers: Optional[int] = None, precompute: Optional[bool] = None,
                 node_env: Optional[dict[str, str]] = None, footprints: Any = None, builds: Optional[str] = None,
                 **_ignored: Any):
        try:
            import ray
        except ImportError:
            raise ExecutorError("--executor ray needs Ray: pip install 'ray>=2.40' (scripts/setup.sh installs it)") from None
        self._ray = ray
        self.builds = build_place(builds)
        self.device, self.config, self.store = device, config, store
        self._footprints = footprints      # a FootprintBook read where there is no store (a benchmark's)
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            address = address or os.environ.get("RAY_ADDRESS") or None
            try:
                ray.init(address=address, log_to_driver=False, include_dashboard=False,
                         configure_logging=False)
            except Exception as exc:  # noqa: BLE001 - ConnectionError and Ray's own
                raise ExecutorError(f"cannot join the Ray cluster at {address or '(a new local one)'}: {exc}") from None
        self._aborted = threading.Event()
        self._closed = False
        self._slots_changed = threading.Condition()
        self.events = EventLog(os.environ.get("KERNELLOOP_RAY_EVENTS"))
        self._runtime_env = {"env_vars": dict(node_env)} if node_env else None
        count = slots or self._slot_count(device)
        self.build_cpus = build_cpus or float(os.environ.get("KERNELLOOP_RAY_BUILD_CPUS", "4" if device == "cuda" else "1"))
        self.build_jobs = max(2, min(8, int(2 * self.build_cpus)))
        # each Ray worker that builds keeps a build worker warm for its next build (ray_slot.NodeBuilder),
        # as a Sandbox does, unless warm workers are turned off
        self.keep_builds_warm = warm_workers is None or warm_workers > 0
        actor_cls = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=SLOT_CONCURRENCY,
                               concurrency_groups={"control": 2})(EvaluationSlot).options(
            num_gpus=1 if device == "cuda" else 0, num_cpus=0 if device == "cuda" else 1,
            runtime_env=self._runtime_env)
        self._build_task = ray.remote(num_cpus=self.build_cpus, max_retries=3, retry_exceptions=False)(build_on_node)
        actors = [actor_cls.remote(device, config.model_dump_json(), warm_workers, precompute, self.builds == "slot")
                  for _ in range(count)]
        try:
            described = [json.loads(d) for d in ray.get([a.describe.remote() for a in actors], timeout=SLOT_WAIT_S)]
        except Exception as exc:  # noqa: BLE001 - GetTimeoutError, a slot that cannot start
            for a in actors:
                ray.kill(a)
            raise ExecutorError(f"the Ray cluster did not start {count} evaluation slot(s) "
                                f"({'one GPU' if device == 'cuda' else 'one CPU'} each): {exc}") from None
        names = {(d["device_name"], d["torch_version"]) for d in described}
        if len(names) > 1:
            for a in actors:
                ray.kill(a)
            raise ExecutorError("the cluster's slots differ in device or torch (one run's timings would not compare): "
                                + "; ".join(f"{n} / torch {t}" for n, t in sorted(names)))
        first = described[0]
        self.device_name, self.torch_version, self.arch = first["device_name"], first["torch_version"], first["arch"]
        self._facts = first["facts"]
        self.slots = [RaySlot(i, a, d["node"]) for i, (a, d) in enumerate(zip(actors, described))]
        self._books: dict[str, Any] = {}
        # where builds run and on how many cores, on record beside the slots (a run's rate depends on it)
        self.events("slots", nodes=[s.node for s in self.slots], device_name=self.device_name, builds=self.builds,
                    build_plans=[[d["build_slots"], d["build_jobs"]] for d in described])

    # ---------------------------------------------------------------- cluster
    def _slot_count(self, device: str) -> int:
        if device == "cuda":
            gpus = int(self._ray.cluster_resources().get("GPU", 0))
            if gpus < 1:
                raise ExecutorError("the Ray cluster has no GPU resources: start its GPU nodes with the GPUs "
                                    "visible (ray start --num-gpus N), or use --device cpu")
            return gpus
        return max(1, int(os.environ.get("KERNELLOOP_RAY_SLOTS", "1")))

    def device_facts(self) -> dict[str, Any]:
        return dict(self._facts)

    # ---------------------------------------------------------------- footprints (the store is the driver's)
    def _known_footprint(self, spec: TaskSpec) -> Optional[dict[str, Any]]:
        if self.store is None:
            fp = self._footprints.known(spec, self.device, self.config.numerics) if self._footprints else None
            return fp.to_dict() if fp is not None else None
        from store.repo import latest_footprint

        with self.store.reader() as s:
            fp = latest_footprint(s, spec.key, self.device, self.config.numerics.label, self.device_name,
                                  self.torch_version)
        return fp.to_dict() if fp is not None else None

    def _keep_footprints(self, spec: TaskSpec, measured: list[dict[str, Any]]) -> None:
        # a slot measures only the tasks it is asked about
        mine = [Footprint.from_dict(item["footprint"]) for item in measured if item["task_key"] == spec.key]
        if not mine:
            return
        if self.store is None:
            if self._footprints is not None:
                for fp in mine:
                    self._footprints.remember(spec, self.device, self.config.numerics, fp)
            return
        from store.repo import save_footprint

        with self.store.session() as s:
            for fp in mine:
                save_footprint(s, spec, fp, self.torch_version)

    # ---------------------------------------------------------------- slots
    def _pick(self, spec: TaskSpec) -> RaySlot:
        """The live slot the local sandbox's rule prefers (``slot_preference``: the least loaded,
        where a slot running the task's reference counts ``REFERENCE_AFFINITY`` evaluations less):
        each slot starts its own reference for a task (its model and warm-up compile hold that
        GPU's timings back), and the least-loaded rule alone started every task's reference on
        every slot. While every slot is lost, wait for one to come back (at most ``SLOT_WAIT_S``)."""
        deadline = time.monotonic() + SLOT_WAIT_S
        with self._slots_changed:
            while True:
                live = [s for s in self.slots if not s.down]
                if live or self._aborted.is_set() or time.monotonic() > deadline:
                    break
                self._slots_changed.wait(timeout=5.0)
            if not live:
                raise SlotsLost(f"no evaluation slot came back within {SLOT_WAIT_S:.0f} s")
            slot = min(live, key=lambda s: (*slot_preference(s.load, spec.key in s.tasks), s.index))
            slot.load += 1
            slot.tasks.add(spec.key)
            return slot

    def _unpick(self, slot: RaySlot) -> None:
        with self._slots_changed:
            slot.load -= 1

    def _slot_lost(self, slot: RaySlot) -> None:
        """Take a lost slot out of the choice until Ray has restarted it (where its resources are
        free: the same node back, or another one); a thread of its own waits for that."""
        with self._slots_changed:
            if slot.down:
                return
            slot.down = True
        threading.Thread(target=self._revive, args=(slot,), name=f"ray-slot-{slot.index}", daemon=True).start()

    def _revive(self, slot: RaySlot) -> None:
        ray = self._ray
        while not self._aborted.is_set() and not self._closed:
            try:        # at-least-once: queued until the actor runs again
                node = ray.get(slot.actor.ping.options(max_task_retries=-1).remote(), timeout=30.0)
            except lost_slot_errors() + (ray.exceptions.GetTimeoutError,):
                continue
            except Exception:  # noqa: BLE001 - the cluster went away (shutdown): nothing to revive
                return
            with self._slots_changed:
                if node != slot.node:
                    slot.tasks.clear()      # a new process: no reference of any task runs there
                slot.node, slot.down = node, False
                self._slots_changed.notify_all()
            self.events("slot_back", slot=slot.index, node=node)
            return

    def _build(self, slot: RaySlot, spec: TaskSpec, source: str) -> str:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        t0 = time.monotonic()
        ref = self._build_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(slot.node, soft=True),
                                       runtime_env=self._runtime_env).remote(
            spec_data(spec), source, self.device, self.config.model_dump_json(), self.arch, self.build_jobs,
            self.keep_builds_warm)
        outcome = json.loads(self._ray.get(ref))
        wall = time.monotonic() - t0
        built = (outcome.get("build") or {}).get("seconds") or 0.0
        outcome["wait_s"] = round(max(0.0, wall - built), 3)     # queued for CPUs, shipping
        return json.dumps(outcome)

    # ---------------------------------------------------------------- the executor interface
    def evaluate(self, spec: TaskSpec, source: str) -> EvalResult:
        t0 = time.monotonic()
        lost: list[str] = []
        data = spec_data(spec)
        while True:
            try:
                slot = self._pick(spec)
            except SlotsLost as exc:
                lost.append(f"SlotLost: {exc}")
                return self._lost_result(spec, source, lost, t0)
            try:
                build = None        # builds = slot: the slot's sandbox builds it (and prepares the task meanwhile)
                if self.builds == "tasks":
                    # the slot starts the task's reference while the build runs (Sandbox.prepare, as the local
                    # executor does): in session o's bench its candidates waited 16.6 s (median) for it after their build
                    slot.actor.prepare.options(concurrency_group="control").remote(data, self._known_footprint(spec))
                    build = self._build(slot, spec, source)
                self.events("evaluate", task=spec.name, slot=slot.index, node=slot.node,
                            candidate=sha256_text(source)[:12])
                reply = json.loads(self._ray.get(slot.actor.evaluate.remote(data, source, build,
                                                                            self._known_footprint(spec))))
            except lost_slot_errors() as exc:
                cause = f"SlotLost: evaluation slot {slot.index} on node {slot.node[:12]} was lost ({type(exc).__name__})"
                lost.append(cause)
                self.events("lost", task=spec.name, slot=slot.index, node=slot.node, error=type(exc).__name__)
                self._slot_lost(slot)
                if self._aborted.is_set() or len(lost) > MAX_INFRA_RETRIES:
                    return self._lost_result(spec, source, lost, t0)
                continue                    # re-queued: the next live slot evaluates it
            finally:
                self._unpick(slot)
            self._keep_footprints(spec, reply.get("footprints") or [])
            if reply.get("too_large"):
                raise TaskTooLarge(**reply["too_large"])
            result = EvalResult.model_validate(reply["result"])
            result.infra_retries = lost + result.infra_retries
            result.seconds = round(time.monotonic() - t0, 3)
            self.events("done", task=spec.name, slot=slot.index, node=reply.get("node"), status=result.status.value)
            return result

    def _lost_result(self, spec: TaskSpec, source: str, lost: list[str], t0: float) -> EvalResult:
        interrupted = self._aborted.is_set()
        return EvalResult(status=Status.runtime_error if interrupted else Status.infra_error, task=spec.name,
                          task_sha256=spec.sha256, candidate_sha256=sha256_text(source), device=self.device,
                          device_name=self.device_name, torch_version=self.torch_version, config=self.config,
                          error_type="Interrupted" if interrupted else "SlotLost", error_message=lost[-1],
                          infra_retries=lost[:-1], seconds=round(time.monotonic() - t0, 3))

    def too_large(self, spec: TaskSpec) -> Optional[TaskTooLarge]:
        while True:
            try:
                slot = self._pick(spec)
            except SlotsLost as exc:
                raise ExecutorError(str(exc)) from None
            try:
                reply = json.loads(self._ray.get(slot.actor.too_large.remote(spec_data(spec),
                                                                             self._known_footprint(spec))))
            except lost_slot_errors():
                self._slot_lost(slot)
                if self._aborted.is_set():
                    raise ExecutorError("the run was interrupted") from None
                continue
            finally:
                self._unpick(slot)
            self._keep_footprints(spec, reply.get("footprints") or [])
            return TaskTooLarge(**reply["too_large"]) if reply.get("too_large") else None

    def release(self, spec: TaskSpec) -> None:
        for slot in self.slots:
            if spec.key in slot.tasks:
                slot.actor.release.options(concurrency_group="control").remote(spec_data(spec))
                slot.tasks.discard(spec.key)

    def abort(self) -> None:
        self._aborted.set()
        for slot in self.slots:
            slot.actor.abort.options(concurrency_group="control").remote()

    def close(self) -> None:
        self._closed = True
        ray = self._ray
        closing = [s.actor.close.options(concurrency_group="control").remote() for s in self.slots]
        try:
            ray.get(closing, timeout=60)
        except Exception:  # noqa: BLE001 - a lost slot has nothing left to close
            pass
        for slot in self.slots:
            ray.kill(slot.actor)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_ray(device: str, config: EvalConfig, **options: Any) -> RayExecutor:
    return RayExecutor(device, config, **options)
