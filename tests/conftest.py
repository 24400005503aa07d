"""Shared pytest setup: the checkout on sys.path, the ``gpu`` and ``nvcc`` markers, a temporary store, a
small CPU sandbox."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped when torch sees none)")
    config.addinivalue_line("markers", "nvcc: builds CUDA code; needs nvcc and a CUDA build of torch, no GPU")
    config.addinivalue_line("markers", "triton: needs the triton package (the `test` extra installs it)")
    config.addinivalue_line("markers", "kernelbench: reads the real KernelBench checkout (KERNELLOOP_KERNELBENCH or "
                                       "../shared/KernelBench); skipped where it is missing, failed where CI is set")
    # The tests' own process computes with one intra-op thread, as the sandbox's CPU workers time
    # (sandbox.slots.cpu_timing_threads): beside the real-server tests' llama.cpp server (one
    # thread, nice 10) torch's two OpenMP threads waited on each other, and the level-3 replay tests
    # of test_builtin_replay.py took 103-200 s each against 4.5-5.7 s with one thread (2026-11-28,
    # the server running beside both). Workers and child processes set their own counts.
    import torch

    torch.set_num_threads(1)


def triton_missing() -> str | None:
    """Why Triton candidates cannot run here, or None where they can."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "needs the triton package (pip install 'triton>=3.9,<3.10', part of the `test` extra)"
    return None


FAKE_KERNELBENCH = ROOT / "tests" / "fixtures" / "kernelbench"     # made-up tasks and timings, in every clone


def in_ci() -> bool:
    """CI is set (``CI=true``, as .ci/run exports): there a missing KernelBench fails its tests."""
    import os

    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def kernelbench_missing() -> str | None:
    """Why the real KernelBench cannot be read here (naming where it was looked for), or None."""
    import os

    from evals.kernelbench import kernelbench_root

    root = kernelbench_root()
    where = (f"KERNELLOOP_KERNELBENCH={os.environ['KERNELLOOP_KERNELBENCH']}" if os.environ.get("KERNELLOOP_KERNELBENCH")
             else f"../shared/KernelBench beside the checkout ({root})")
    if not root.is_dir():
        return f"needs the real KernelBench: {where} does not exist (set KERNELLOOP_KERNELBENCH to a checkout)"
    missing = [d for d in ("level1", "level2", "results/timing") if not (root / d).is_dir()]
    if missing:
        return f"needs the real KernelBench: {where} has no {', '.join(missing)}"
    return None


@pytest.fixture(autouse=True)
def _kernelbench_or_skip(request: pytest.FixtureRequest) -> None:
    """A ``kernelbench`` test where the real checkout is missing: skipped, saying what is missing;
    failed instead where CI is set (CI has ../shared/KernelBench, so a skip there hides a loss)."""
    if request.node.get_closest_marker("kernelbench") is None:
        return
    why = kernelbench_missing()
    if why:
        if in_ci():
            pytest.fail(f"{why} (CI is set: KernelBench tests must run here)")
        pytest.skip(why)


@pytest.fixture(autouse=True)
def _no_learned_windows() -> None:
    """Model windows learned in this process (``agent.backends.context.KNOWN``, by base URL and model)
    start empty for each test: a fake server of a later test may get an earlier one's port, and the
    window an earlier test taught (an overflow, a small context) would trim the later one's prompts."""
    from agent.backends import context

    context.KNOWN.clear()


@pytest.fixture
def real_kernelbench() -> Path:
    """The real KernelBench checkout (only in ``kernelbench`` tests, which the fixture above guards)."""
    from evals.kernelbench import kernelbench_root

    return kernelbench_root()


def nvcc_missing() -> str | None:
    """Why CUDA code cannot be built here, or None where it can."""
    import torch
    from torch.utils import cpp_extension

    if not torch.version.cuda:
        return f"needs a CUDA build of torch (this is {torch.__version__}; scripts/nvcc_check.sh installs one aside)"
    home = cpp_extension.CUDA_HOME
    if not home or not (Path(home) / "bin" / "nvcc").exists():
        return "needs nvcc (CUDA_HOME/bin/nvcc)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests are skipped where ``torch.cuda.is_available()`` is False; ``nvcc`` tests
    where no CUDA build of torch or no nvcc is installed."""
    marked = {m: [i for i in items if i.get_closest_marker(m) is not None] for m in ("gpu", "nvcc", "triton")}
    why_triton = triton_missing() if marked["triton"] else None
    if why_triton:
        for item in marked["triton"]:
            item.add_marker(pytest.mark.skip(reason=why_triton))
    if not marked["gpu"] and not marked["nvcc"]:
        return
    import torch

    if marked["gpu"] and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in marked["gpu"]:
            item.add_marker(skip)
    why = nvcc_missing() if marked["nvcc"] else None
    if why:
        for item in marked["nvcc"]:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def tmp_store(tmp_path: Path):
    """A ``store.Store`` on a fresh SQLite file under the test's temporary directory."""
    from store import Store

    store = Store(tmp_path / "kernelloop-test.db")
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(scope="module")
def sandbox():
    """A CPU ``Sandbox`` with few trials and runs, one per test module (modules may define their own)."""
    from sandbox.evaluate import Sandbox
    from sandbox.result import EvalConfig

    cfg = EvalConfig(trials=2, timed_runs=3, warmup_runs=1, time_compile=False, run_timeout_s=60.0)
    with Sandbox("cpu", cfg, build_slots=1) as sb:
        yield sb


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the session (``tests/pgserver.py``); skipped, saying what is
    missing, where psycopg or the server binaries are not installed (scripts/setup.sh installs both)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import pgserver

    why = pgserver.missing()
    if why:
        pytest.skip(why)
    server = pgserver.PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new, empty store's URL: a SQLite file, then a fresh database on the PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kernelloop-test.db'}"
    return request.getfixturevalue("postgres_server").new_url()
