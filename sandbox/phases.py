"""Where an evaluation's time goes: consecutive stages added to ``EvalResult.phases``."""
from __future__ import annotations

import contextlib
import time
from typing import Optional

from sandbox.result import EvalResult


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


@contextlib.contextmanager
def phase(result: EvalResult, name: str):
    """One stage, as a block."""
    stages = Stages(result)
    stages.enter(name)
    try:
        yield
    finally:
        stages.enter(None)
