"""Executors: where the loop's evaluations run. A small interface (``executors.base.Executor``)
found by name through a registry, so ``--executor NAME`` picks one and a new one is a module:

* ``local`` (the default): the sandbox on this host, as always (``sandbox.evaluate.Sandbox``);
* ``ray``: each evaluation slot a Ray actor holding one GPU (or one CPU slot) around an unchanged
  Sandbox, which builds its candidates (or Ray tasks on CPU resources do, ``KERNELLOOP_RAY_BUILDS=tasks``)
  (``executors.ray_executor``).

Executor modules are imported only when named, so ``local`` never imports Ray.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from executors.base import Executor, ExecutorError

# name -> "module:factory"; a factory takes (device, config, **options) and returns an Executor.
REGISTRY: dict[str, str] = {
    "local": "executors.local:open_local",
    "ray": "executors.ray_executor:open_ray",
}


def executor_names() -> list[str]:
    return list(REGISTRY)


def executor_factory(name: str) -> Callable[..., Executor]:
    try:
        module_name, attr = REGISTRY[name].split(":")
    except KeyError:
        raise ExecutorError(f"no executor {name!r}: choose one of {', '.join(REGISTRY)}") from None
    return getattr(importlib.import_module(module_name), attr)


def open_executor(name: str, device: str, config: Any, **options: Any) -> Executor:
    """The executor ``name`` for ``device`` under the evaluation ``config`` (``EvalConfig``);
    ``options`` are the executor's own (``store``, ``address``, ...; unknown ones are ignored
    by executors that do not use them)."""
    return executor_factory(name)(device, config, **options)


__all__ = ["Executor", "ExecutorError", "REGISTRY", "executor_names", "open_executor"]
