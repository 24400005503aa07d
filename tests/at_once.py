"""How many threads are inside a block at once, and the most there ever were (tests that assert a
limit on concurrency: admission, footprint measurements, parses)."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class AtOnce:
    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            yield
        finally:
            with self._lock:
                self.now -= 1
