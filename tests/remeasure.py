"""An evaluation measured again while its only doubt is its timing (``contended``), as the builtin
proposer measures such a candidate again (``agent.builtin.feedback``): tests that expect a clean
pass of an honest candidate run on CI's two cores beside a llama.cpp server and a second pytest,
where a burst of load may take a timing block, and the judge rightly says so rather than give a
speedup. Any other flag stands at once; so does a third contended result."""
from __future__ import annotations

from typing import Callable

from sandbox.result import EvalResult

TRIES = 3


def remeasured(evaluate: Callable[[], EvalResult], tries: int = TRIES) -> EvalResult:
    result = evaluate()
    for _ in range(tries - 1):
        if not result.contended_only:
            break
        result = evaluate()
    return result
