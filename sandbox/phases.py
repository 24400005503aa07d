"""Where an evaluation's time goes: consecutive stages added to ``EvalResult.phases``."""
from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Callable, Iterator, Optional

from sandbox.result import EvalResult


# Told the name of each stage as it starts, in the thread that evaluates (``kernelloop mcp``'s
# progress notifications); set with ``listening``.
_listener: contextvars.ContextVar[Optional[Callable[[str], None]]] = contextvars.ContextVar(
    "kernelloop_stage_listener", default=None)


@contextlib.contextmanager
def listening(fn: Callable[[str], None]) -> Iterator[None]:
    """Within the block, ``fn(stage)`` as each stage of an evaluation in this thread starts."""
    token = _listener.set(fn)
    try:
        yield
    finally:
        _listener.reset(token)


class Stages:
    """Consecutive stages of one evaluation, their seconds added to ``result.phases`` (where
    an evaluation's time goes): ``enter`` ends the stage before it, ``enter(None)`` the last."""

    def __init__(self, result: EvalResult):
        self.result, self.name, self.t0 = result, None, time.monotonic()

    def enter(self, name: Optional[str]) -> None:
        now = time.monotonic()
        if self.name:
            self.result.phases[self.name] = round(self.result.phases.get(self.name, 0.0) + now - self.t0, 3)
        self.name, self.t0 = name, now
        listener = _listener.get()
        if name and listener is not None:
            listener(name)


@contextlib.contextmanager
def phase(result: EvalResult, name: str):
    """One stage, as a block."""
    stages = Stages(result)
    stages.enter(name)
    try:
        yield
    finally:
        stages.enter(None)
