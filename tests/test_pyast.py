"""Parses of candidate source never run two at once (kernelloop.pyast): CPython 3.11's AST
constructor shares its recursion-depth state between threads, and concurrent parses failed a
whole test module with "SystemError: AST constructor recursion depth mismatch" (the sandbox's
static scan of four candidates evaluated at once, Python 3.11.7)."""
from __future__ import annotations

import ast
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from at_once import AtOnce

from sandbox import anticheat

HONEST = (Path(__file__).parent / "adversarial" / "cpu" / "honest.py").read_text()


def test_static_scans_in_many_threads_parse_one_at_a_time(monkeypatch):
    at_once = AtOnce()
    real = ast.parse

    def watched(*args, **kwargs):
        with at_once.inside():
            time.sleep(0.002)               # long enough for the other threads to arrive
            return real(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", watched)
    with ThreadPoolExecutor(max_workers=8) as pool:
        flags = list(pool.map(lambda _: anticheat.scan(HONEST), range(32)))
    assert at_once.most == 1, f"{at_once.most} parses ran at once"
    assert all(f == flags[0] for f in flags)      # and every scan still says the same
