"""The numerics verdict table on a GPU: regression candidates of our own on KernelBench tasks
(tests/numerics/cuda/), each evaluated under every convention its header names, at published
sizes. Each file states ``# task: levelN/...py`` and ``# expect: LABEL=status ...``.

Prints one ``NUMERICS`` line per (candidate, convention) with the verdict, the elements outside
KernelBench's tolerance and the float64 errors; ``KERNELLOOP_VERDICTS`` names a JSON file to
write them to.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from evals.kernelbench import kernelbench_paths
from sandbox.evaluate import Sandbox
from sandbox.numerics import Numerics
from sandbox.result import EvalConfig
from sandbox.tasks import read_spec

HERE = Path(__file__).parent / "numerics" / "cuda"
CASES = sorted(HERE.glob("*.py"))


def _header(path: Path) -> tuple[str, dict[str, str]]:
    text = path.read_text()
    task = re.search(r"^# task: (\S+)", text, re.M).group(1)
    expect = dict(pair.split("=") for pair in re.search(r"^# expect: (.+)$", text, re.M).group(1).split())
    return task, expect


PARAMS = [(p, label) for p in CASES for label in _header(p)[1]]
ROWS: list[dict] = []


@pytest.fixture(scope="module")
def sandboxes():
    made: dict[str, Sandbox] = {}
    yield lambda label: made.setdefault(label, Sandbox("cuda", EvalConfig(
        trials=3, timed_runs=10, warmup_runs=2, time_compile=False, profile=True, run_timeout_s=120.0,
        numerics=Numerics(precision=label.split("/")[0], math=label.split("/")[1]))))
    for sb in made.values():
        sb.close()
    out = os.environ.get("KERNELLOOP_VERDICTS")
    if out:
        Path(out).write_text(json.dumps(ROWS, indent=1))


@pytest.mark.gpu
@pytest.mark.kernelbench
@pytest.mark.parametrize("path, label", PARAMS, ids=[f"{p.stem}-{lab}" for p, lab in PARAMS])
def test_numerics_verdict(sandboxes, path, label):
    task, expect = _header(path)
    spec = read_spec(kernelbench_paths([task])[0], name=task)
    result = sandboxes(label).evaluate(spec, path.read_text())
    outputs = [o for t in result.trials for o in t.outputs]
    first = result.trials[0].outputs[0] if result.trials and result.trials[0].outputs else None
    row = {"candidate": path.stem, "task": task, "numerics": label, "status": result.status.value,
           "expected": expect[label], "clean": result.clean, "flags": sorted(f.kind.value for f in result.flags),
           "outside_kernelbench_tolerance": max((o.outside_tolerance for o in outputs), default=None),
           "numel": first.numel if first else None,
           "fp64_rel_rms": first.fp64_rel_rms if first else None,
           "ref_fp64_rel_rms": first.ref_fp64_rel_rms if first else None,
           "candidate_ms": result.candidate_time.median_ms if result.candidate_time else None,
           "eager_ms": result.eager_time.median_ms if result.eager_time else None,
           "reason": (result.first_failed_trial().reason if result.first_failed_trial() else result.error_message)}
    ROWS.append(row)
    print("NUMERICS " + json.dumps(row))
    assert result.status.value == expect[label], row
    if expect[label] == "correct":
        assert not result.has_flag("inaccurate") and not result.has_flag("no_custom_kernel"), row
