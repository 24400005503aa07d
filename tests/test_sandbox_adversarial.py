"""The adversarial regression suite: one candidate per known exploit, each must get the
right verdict (incorrect, an error status, or correct *but flagged*), never a clean pass.

Each file under tests/adversarial/<device>/ states what it expects in its first lines:
``# expect-status: incorrect|flagged`` and ``# expect-flag: suspicious`` (``clean``: a legitimate
technique that resembles an exploit, ``legit_*``, must pass clean); optionally
``# expect-strays: yes`` (processes it left running were found and killed) and
``# expect-reason: WORD`` (a word of the failing trial's reason). After every evaluation no
process a candidate started may be alive (the helpers in these files name themselves ``kladv-*``).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from sandbox.evaluate import Sandbox
from sandbox.result import EvalConfig, Status
from sandbox.tasks import read_spec

from remeasure import remeasured

HERE = Path(__file__).parent / "adversarial"
TASK = HERE / "task_small.py"


def _expectations(path: Path) -> tuple[set[str], str]:
    text = path.read_text()
    status = re.search(r"^# expect-status: (\S+)", text, re.M).group(1)
    flag = re.search(r"^# expect-flag: ?(\S*)", text, re.M).group(1)
    return set(status.split("|")), flag


def _extra(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^# expect-(strays|reason): ?(\S*)", path.read_text(), re.M))


def leftover_helpers() -> list[str]:
    """Live processes named like the adversarial helpers (``kladv-*``): none may outlive its evaluation."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().startswith("kladv"):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    found.append(entry.name)
        except OSError:
            continue
    return found


def check_containment(name: str, result, extra: dict[str, str]) -> None:
    detail = (f"{name}: strays={result.stray_processes_killed} {result.stray_processes} "
              f"containment={result.containment} checked={result.timed_runs_checked}")
    assert not leftover_helpers(), "a candidate's process outlived its evaluation: " + detail
    assert result.containment in ("cgroup", "subreaper"), detail
    if extra.get("strays") == "yes":
        assert result.stray_processes_killed >= 1 and result.has_flag("suspicious"), detail
        assert any("left" in f.reason and "process" in f.reason for f in result.flags), detail
    else:
        assert result.stray_processes_killed == 0, detail
    if extra.get("reason"):
        failed = result.first_failed_trial()
        assert failed is not None and extra["reason"] in (failed.reason or ""), detail
    if name == "honest":
        assert result.timed_runs_checked == result.config.timed_runs, detail


def check_verdict(name: str, result, expected: set[str], flag: str) -> None:
    got = result.status.value
    flags = {f.kind.value for f in result.flags}
    detail = f"{name}: status={got} flags={sorted(flags)} error={result.error_message!r}"
    if name == "honest" or expected == {"clean"}:
        assert result.clean, "a legitimate candidate was not clean: " + detail
        return
    assert not result.clean, "an exploit passed clean: " + detail
    if got == "correct":
        assert "flagged" in expected, detail
        assert flag in flags, detail
    else:
        assert got in expected, detail
    if flag and "flagged" not in expected and got != "correct":
        # flags the static scan or the dynamic checks must raise even when the verdict already fails
        assert flag in flags, detail


CPU_CASES = sorted((HERE / "cpu").glob("*.py"))


@pytest.fixture(scope="module")
def cpu_sandbox():
    config = EvalConfig(trials=3, timed_runs=5, warmup_runs=1, time_compile=False, profile=True,
                        run_timeout_s=30.0, build_timeout_s=600.0, memory_limit_mb=8192)
    with Sandbox("cpu", config, build_slots=1) as sandbox:
        yield sandbox


@pytest.mark.parametrize("path", CPU_CASES, ids=[p.stem for p in CPU_CASES])
def test_cpu_exploit_verdict(cpu_sandbox, path):
    expected, flag = _expectations(path)
    result = remeasured(lambda: cpu_sandbox.evaluate(read_spec(TASK, name="adversarial/task_small"), path.read_text()))
    print(f"VERDICT {path.stem}: {result.status.value} flags={sorted(f.kind.value for f in result.flags)} "
          f"strays={result.stray_processes_killed} checked={result.timed_runs_checked} "
          f"speedup={result.speedup_eager}")
    check_verdict(path.stem, result, expected, flag)
    check_containment(path.stem, result, _extra(path))


CUDA_CASES = sorted((HERE / "cuda").glob("*.py"))


@pytest.fixture(scope="module")
def cuda_sandbox():
    config = EvalConfig(trials=3, timed_runs=10, warmup_runs=2, time_compile=False, profile=True,
                        run_timeout_s=30.0, build_timeout_s=600.0)
    with Sandbox("cuda", config) as sandbox:
        yield sandbox


@pytest.mark.gpu
@pytest.mark.parametrize("path", CUDA_CASES, ids=[p.stem for p in CUDA_CASES])
def test_cuda_exploit_verdict(cuda_sandbox, path, record_property):
    expected, flag = _expectations(path)
    result = cuda_sandbox.evaluate(read_spec(TASK, name="adversarial/task_small"), path.read_text())
    record_property("verdict", f"{result.status.value} {sorted(f.kind.value for f in result.flags)}")
    print(f"VERDICT {path.stem}: {result.status.value} flags={sorted(f.kind.value for f in result.flags)} "
          f"strays={result.stray_processes_killed} checked={result.timed_runs_checked} "
          f"speedup={result.speedup_eager} error={(result.error_message or '')[:100]!r}")
    for f in result.flags:
        if f.kind.value == "contended":      # the measuring conditions, not the candidate: say which
            print(f"  contended: {f.reason[:300]}")
    check_verdict(path.stem, result, expected, flag)
    check_containment(path.stem, result, _extra(path))


def test_suite_covers_every_known_exploit():
    names = {p.stem for p in CPU_CASES}
    for required in ("stale_empty", "cache_by_data_ptr", "cache_by_id", "cache_constant", "return_input",
                     "mutate_inputs", "background_thread", "lazy_subclass", "patched_timer", "patched_harness",
                     "forged_stdout", "sys_exit", "os_exit", "seed_predict", "lowered_precision",
                     "try_except_fallback", "calls_reference", "only_torch_ops", "truncated_mantissa",
                     "detached_sleeper", "detached_load", "skipped_runs"):
        assert required in names
    cuda_names = {p.stem for p in CUDA_CASES}
    assert names - {"segfault"} <= cuda_names | {"segfault"}
    assert {"side_stream", "patched_sync", "illegal_address", "tf32_in_cpp", "graph_of_torch",
            "side_stream_before_start", "join_in_comment"} <= cuda_names
    # legitimate techniques that resemble exploits: they must stay clean
    assert {"legit_cuda_graph", "legit_joined_side_stream"} <= cuda_names


# Triton versions (sandbox.backends.triton): on a GPU every case runs compiled; without one, the
# cases not marked `# expect-device: gpu` run through Triton's interpreter on the CPU.
TRITON_CASES = sorted((HERE / "triton").glob("*.py"))


def _triton_case(path: Path):
    marks = [pytest.mark.triton]
    if re.search(r"^# expect-device: gpu", path.read_text(), re.M):
        marks.append(pytest.mark.gpu)
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.fixture(scope="module")
def triton_sandbox():
    import torch

    gpu = torch.cuda.is_available()
    config = EvalConfig(trials=3, timed_runs=10 if gpu else 5, warmup_runs=2 if gpu else 1, time_compile=False,
                        profile=True, run_timeout_s=120.0, build_timeout_s=600.0, backend="triton")
    with Sandbox("cuda" if gpu else "cpu", config, build_slots=1) as sandbox:
        yield sandbox


@pytest.mark.parametrize("path", [_triton_case(p) for p in TRITON_CASES])
def test_triton_exploit_verdict(triton_sandbox, path, record_property):
    expected, flag = _expectations(path)
    result = remeasured(lambda: triton_sandbox.evaluate(read_spec(TASK, name="adversarial/task_small"), path.read_text()))
    record_property("verdict", f"{result.status.value} {sorted(f.kind.value for f in result.flags)}")
    print(f"VERDICT triton/{path.stem} on {triton_sandbox.device}: {result.status.value} "
          f"flags={sorted(f.kind.value for f in result.flags)} error={(result.error_message or '')[:100]!r}")
    check_containment(path.stem, result, _extra(path))
    if expected == {"correct"} and not flag:        # the honest cases: a clean pass
        assert result.clean, f"{path.stem}: {result.status.value} {result.flags} {result.error_message!r}"
        return
    check_verdict(path.stem, result, expected, flag)


def test_triton_suite_covers_its_exploits():
    names = {p.stem for p in TRITON_CASES}
    assert {"honest", "stale_empty", "side_stream", "cache_by_data_ptr", "cached_output", "skipped_timed_runs",
            "tf32_dot", "ieee_dot", "patched_launch", "detached_load"} <= names
