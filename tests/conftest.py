"""Shared pytest setup: the checkout on sys.path, the ``gpu`` marker, a temporary store."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped when torch sees none)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``@pytest.mark.gpu`` are skipped when ``torch.cuda.is_available()`` is False."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def tmp_store(tmp_path: Path):
    """A ``store.Store`` on a fresh SQLite file under the test's temporary directory."""
    from store import Store

    store = Store(tmp_path / "kernelloop-test.db")
    try:
        yield store
    finally:
        store.close()
