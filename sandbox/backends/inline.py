"""The ``cuda`` and ``cpu`` backends: C++/CUDA kernels through ``load_inline``, built by the
sandbox's build hook (``sandbox.build``) exactly as before backends existed."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from sandbox import anticheat
from sandbox.build import HookedBuilder, first_compiler_error
from sandbox.result import Flag


class InlineHook(HookedBuilder):
    """``sandbox.build.HookedBuilder`` as a ``BuildHook``: kernels are the ``__global__``
    functions its builds declare; a failed ``load_inline`` has recorded itself already; nothing
    compiles on first use."""

    def install(self, source: str = "") -> None:
        super().install()

    def import_failed(self, exc: BaseException) -> None:
        pass

    def kernel_names(self) -> list[str]:
        return sorted({k for r in self.records for k in r.kernel_names})

    def warm_up(self, model: Any, make_args: Callable[[int], Sequence[Any]]) -> Optional[BaseException]:
        return None


class InlineBackend:
    no_call_reason = "no call into the candidate's own compiled extension during a forward"

    def __init__(self, name: str, device: str):
        self.name, self.device = name, device

    def scan(self, source: str) -> list[Flag]:
        return anticheat.scan(source)

    def first_error(self, log: str, source: str, build_dirs: list[str]) -> tuple[Optional[str], Optional[int]]:
        return first_compiler_error(log, source, build_dirs)

    def hook(self, max_jobs: Optional[int] = None) -> InlineHook:
        return InlineHook(max_jobs=max_jobs)

    def worker_env(self) -> dict[str, str]:
        return {}
