"""Backends: what candidates are written in. A small interface (``sandbox.backends.base``) found by
name, as executors are (``executors/``):

* ``cuda``: CUDA kernels through ``torch.utils.cpp_extension.load_inline`` (the product);
* ``cpu``: C++ kernels through the same ``load_inline`` (CI and laptops run the whole loop);
* ``triton``: ``@triton.jit`` kernels; on ``cpu`` through Triton's interpreter (``TRITON_INTERPRET=1``).

A backend's module is imported only when named, so ``cuda`` and ``cpu`` never import Triton.
``None`` (runs and configs stored before backends existed) is the device's ``load_inline``
backend: ``cuda`` on ``cuda``, ``cpu`` on ``cpu``.
"""
from __future__ import annotations

import importlib
from typing import Optional

from sandbox.backends.base import Backend, BuildHook

# name -> "module:factory"; a factory takes the device and returns a Backend.
REGISTRY: dict[str, str] = {
    "cuda": "sandbox.backends.inline:InlineBackend",
    "cpu": "sandbox.backends.inline:InlineBackend",
    "triton": "sandbox.backends.triton:TritonBackend",
}
# the devices each backend runs on
DEVICES: dict[str, tuple[str, ...]] = {"cuda": ("cuda",), "cpu": ("cpu",), "triton": ("cuda", "cpu")}


class BackendError(ValueError):
    """A backend that does not exist or does not run on the device; the message says which do."""


def backend_names() -> list[str]:
    return list(REGISTRY)


def resolve_backend(name: Optional[str], device: str) -> str:
    """The backend's name on ``device``: None is the device's own ``load_inline`` backend."""
    if name is None:
        return device
    if name not in REGISTRY:
        raise BackendError(f"no backend {name!r}: choose one of {', '.join(REGISTRY)}")
    if device not in DEVICES[name]:
        runs_on = " or ".join(f"--device {d}" for d in DEVICES[name])
        raise BackendError(f"the {name} backend needs {runs_on}; on --device {device} choose "
                           f"{' or '.join(n for n, ds in DEVICES.items() if device in ds)}")
    return name


def backend_for(name: Optional[str], device: str) -> Backend:
    resolved = resolve_backend(name, device)
    module_name, attr = REGISTRY[resolved].split(":")
    return getattr(importlib.import_module(module_name), attr)(resolved, device)


__all__ = ["Backend", "BackendError", "BuildHook", "REGISTRY", "backend_for", "backend_names", "resolve_backend"]
