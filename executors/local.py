"""The ``local`` executor: the sandbox on this host, exactly as the loop used it before
executors existed (its GPUs as slots, builds on its cores, footprints read from and written to
the store)."""
from __future__ import annotations

from typing import Any, Optional

from sandbox.evaluate import Sandbox, _device_name
from sandbox.result import EvalConfig


def open_local(device: str, config: EvalConfig, *, store: Any = None, warm_workers: Optional[int] = None,
               precompute: Optional[bool] = None, **_ignored: Any) -> Sandbox:
    footprints = None
    if store is not None:
        import torch

        from store.repo import footprint_book

        footprints = footprint_book(store, _device_name(device), torch.__version__)
    return Sandbox(device, config, footprints=footprints, warm_workers=warm_workers, precompute=precompute)
