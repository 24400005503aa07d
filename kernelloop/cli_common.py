"""Options and helpers shared by every command group."""
from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

import sys

# Rich falls back to 80 columns when output is not a terminal; tables are wider than that.
console = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

def _inherit_db(ctx: typer.Context, value: Optional[str]) -> Optional[str]:
    """``--db`` given to a command group (``kernelloop logs --db X show N``) holds for its
    subcommands unless they are given their own (``KERNELLOOP_DB`` counts as given)."""
    if value is not None:
        return value
    parent = ctx.parent
    while parent is not None:
        inherited = (parent.params or {}).get("db")
        if inherited is not None:
            return inherited
        parent = parent.parent
    return None


DbOption = typer.Option(None, "--db", envvar="KERNELLOOP_DB", callback=_inherit_db,
                        help="SQLite file or SQLAlchemy URL of the store [default: ./kernelloop.db]")
DeviceOption = typer.Option(None, "--device", "-d",
                            help="cuda or cpu [default: cuda if a GPU is visible, else cpu]")
SetOption = typer.Option(None, "--set", help="size override name=value (repeatable), e.g. --set batch_size=16")
PrecisionOption = typer.Option(None, "--precision",
                               help="fp32 | fp16 | bf16: model and inputs cast as KernelBench casts them "
                                    "(tolerance 1e-4, 1e-2, 1e-2) [default: fp32]")
MathOption = typer.Option(None, "--math",
                          help="default (PyTorch's defaults: cuDNN convolutions in TF32, cuBLAS matmuls in fp32) | "
                               "strict (IEEE fp32 everywhere) [default: default]")


BackendOption = typer.Option(None, "--backend",
                             help="what candidates are written in: cuda (load_inline; C++ on --device cpu, the cpu "
                                  "backend) | triton (@triton.jit kernels; on --device cpu through Triton's "
                                  "interpreter) [default: the device's load_inline backend]")


def resolve_kernel_backend(name: Optional[str], device: str, base: Optional[str] = None) -> Optional[str]:
    """``--backend`` on ``device`` as stored in ``EvalConfig.backend``: None for the device's own
    ``load_inline`` backend (``cuda`` names the C++ one on ``--device cpu``, as CUDA's sources
    become C++ there), else the backend's name; unset: ``base`` (a stored run's)."""
    from sandbox.backends import BackendError

    try:
        return kernel_backend(name, device, base)
    except BackendError as exc:
        fail(str(exc))


def kernel_backend(name: Optional[str], device: str, base: Optional[str] = None) -> Optional[str]:
    """``resolve_kernel_backend`` raising ``sandbox.backends.BackendError`` (naming the cause)."""
    from sandbox.backends import backend_for, resolve_backend

    if name is None and base is None:
        return None
    name = base if name is None else name
    if name == "cuda" and device == "cpu":
        name = "cpu"
    resolved = resolve_backend(name, device)
    backend_for(resolved, device)           # one that cannot run here says why now, not per candidate
    return None if resolved == device else resolved


def resolve_numerics(precision: Optional[str], math: Optional[str], base=None):
    """``--precision`` and ``--math`` as a ``sandbox.numerics.Numerics`` (unset ones from ``base``)."""
    from sandbox.numerics import parse_numerics

    try:
        return parse_numerics(precision, math, base)
    except ValueError as exc:
        fail(str(exc))


def resolve_device(device: Optional[str], gpu_needed: bool = True) -> str:
    """The device a command runs on; ``gpu_needed=False`` (building only) accepts ``cuda`` with
    a CUDA build of torch and no GPU."""
    try:
        return device_here(device, gpu_needed)
    except ValueError as exc:
        fail(str(exc))


def device_here(device: Optional[str], gpu_needed: bool = True) -> str:
    """``resolve_device`` raising ``ValueError`` (naming the cause) for a device that is not there."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, not {device!r}")
    if device == "cuda" and not gpu_needed:
        if not torch.version.cuda:
            raise ValueError(f"--device cuda --build-only needs a CUDA build of torch (this is torch {torch.__version__})")
        return device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    return device


def open_store(db: Optional[str]):
    from store import Store, StoreError

    try:
        return Store(db)
    except StoreError as exc:
        fail(str(exc))


def fail(message: str, code: int = 2) -> "typer.Exit":
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)
