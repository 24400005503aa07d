"""``ast.parse`` behind one lock, for every parse of candidate, task or generated source.

CPython 3.11 keeps its AST constructor's recursion depth in state the interpreter's threads
share: two parses at once can fail with ``SystemError: AST constructor recursion depth
mismatch``. The sandbox scans candidates in the threads that evaluate them, the loop proposes
in threads: in the fresh-clone suite on Python 3.11.7 one such failure in the static scan
(``sandbox.anticheat``) ended a whole test module's fixture. A parse takes milliseconds; the
lock costs nothing anyone would measure.
"""
from __future__ import annotations

import ast
import threading

_LOCK = threading.RLock()      # re-entrant: a finalizer run by a parse's allocations may parse too


def parse(source: str, filename: str = "<unknown>", mode: str = "exec") -> ast.Module:
    with _LOCK:
        return ast.parse(source, filename=filename, mode=mode)
