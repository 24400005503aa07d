"""The backend interface: what a candidate is built from, how it is built, how its kernels are
recognised, and how its source may lower precision.

A backend is found by name (``sandbox.backends.backend_for``). The sandbox's cascade calls it
and never asks which backend it is:

* in the parent: ``scan`` (the static scan: the flags every backend raises, with this backend's
  precision patterns) and ``first_error`` (the first compiler error of a failed build, mapped to
  the candidate's line);
* in a worker, before the candidate's code runs: ``hook`` returns a ``BuildHook`` that is
  installed (``load_inline`` replaced, or Triton's launches instrumented), collects build
  records, counts calls into the candidate's own kernels, names them for the profiler and warms
  them up before the trials.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

from sandbox.result import Flag


@runtime_checkable
class BuildHook(Protocol):
    """Lives in a build or candidate worker, installed before the candidate's module runs."""

    records: list[Any]      # ``sandbox.build.BuildRecord``s: one per build (a failed one has ok=False)
    counter: Any            # ``sandbox.build.CallCounter``: calls into the candidate's own kernels

    def install(self) -> None:
        """Take over whatever the candidate builds or launches through."""

    def import_failed(self, exc: BaseException) -> None:
        """The candidate's module raised ``exc``: record a failed build where it is one."""

    def kernel_names(self) -> list[str]:
        """The names the profiler shows for the candidate's own kernels."""

    def warm_up(self, model: Any, make_args: Callable[[int], Sequence[Any]]) -> Optional[BaseException]:
        """Compile what compiles on first use before the trials (outside the device's lock);
        the compile failure, if any (recorded as a failed build), else None."""


@runtime_checkable
class Backend(Protocol):
    name: str               # the registry's name: cuda | cpu | triton
    device: str             # the device it targets: cuda | cpu
    no_call_reason: str     # the no_custom_kernel flag's reason where a forward ran none of its kernels

    def scan(self, source: str) -> list[Flag]:
        """The static scan (``sandbox.anticheat``) with this backend's precision patterns."""

    def first_error(self, log: str, source: str, build_dirs: list[str]) -> tuple[Optional[str], Optional[int]]:
        """The first compiler error of a failed build and the candidate line it points at."""

    def hook(self, max_jobs: Optional[int] = None) -> BuildHook:
        """A fresh build hook for one worker."""

    def worker_env(self) -> dict[str, str]:
        """Environment of the build and candidate workers, set before they import anything
        (the reference worker never gets it)."""
