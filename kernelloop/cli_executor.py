"""The ``--executor`` and ``--ray-address`` options of ``optimize`` and ``replay``, and opening
the executor they name (``executors``) with the CLI's error handling."""
from __future__ import annotations

from typing import Any, Callable, Optional

import typer

from kernelloop.cli_common import err_console, fail, resolve_device

ExecutorOption = typer.Option("local", "--executor",
                              help="where candidates are evaluated: local (this host's sandbox) | ray (a Ray "
                                   "cluster: builds as tasks on CPUs, one slot actor per GPU)")
RayAddressOption = typer.Option(None, "--ray-address", envvar="RAY_ADDRESS",
                                help="with --executor ray: the cluster to join (host:port of its head, or ray://...) "
                                     "[default: RAY_ADDRESS, else a new single-node Ray on this host]")


def resolve_executor_device(device: Optional[str], executor: str) -> str:
    """``--device`` for an executor: ``local`` needs the device here; ``ray`` evaluates on the
    cluster's nodes, so a driver without a GPU may run a ``cuda`` run."""
    if executor == "local" or device is None:
        return resolve_device(device)
    if device not in ("cuda", "cpu"):
        fail(f"--device must be cuda or cpu, not {device!r}")
    return device


def open_cli_executor(executor: str, device: str, config: Any, store: Any, ray_address: Optional[str]) -> Any:
    from executors import ExecutorError, open_executor

    try:
        ex = open_executor(executor, device, config, store=store, address=ray_address)
    except (ExecutorError, ValueError) as exc:    # ValueError: a setting the sandbox refuses, named in exc
        fail(str(exc))
    if executor != "local":
        err_console.print(f"executor {executor}: {len(ex.slots)} evaluation slot(s), {ex.device_name}, "
                          f"torch {ex.torch_version}", highlight=False)
    return ex


def cli_device_facts(executor: Any, measure_here: Callable[[], Any]) -> Any:
    """The device facts the prompts show: measured by the executor's own slots where it has
    them (a Ray cluster's GPU nodes), else ``measure_here()`` (this host, as before)."""
    from agent.types import DeviceFacts
    from executors.base import device_facts_of

    facts = device_facts_of(executor)
    return DeviceFacts(**facts) if facts is not None else measure_here()
