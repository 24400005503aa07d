"""The seed situations, end to end: each fixture candidate of ``tests/fixtures/critic``
is built, checked and timed by the sandbox, then analysed by the grounded critic, which
must name the cause the manifest states (and quote only stored figures).

CPU fixtures build six small C++ extensions (identical sources share one build); the
CUDA versions run under ``-m gpu`` on a machine with a GPU.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import pytest

from agent.critic.base import get_critic
from agent.critic.numbers import check_text, evidence_figures
from agent.types import AnalysisOut, AttemptView, DeviceFacts
from sandbox.result import EvalConfig, EvalResult
from sandbox.tasks import TaskSpec, read_spec, with_device_sizes

from remeasure import remeasured

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "critic"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]
BY_NAME = {f["name"]: f for f in MANIFEST}

CPU_CONFIG = EvalConfig(trials=2, warmup_runs=1, timed_runs=5, time_compile=False)
GPU_CONFIG = EvalConfig(trials=2, warmup_runs=3, timed_runs=20, time_compile=False)


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def task_spec(fx: dict[str, Any], device: str) -> TaskSpec:
    path = ROOT / fx["task"]
    if not path.is_file():
        pytest.skip(f"task file {fx['task']} is not in this checkout")
    name = fx["task"].removeprefix("tasks/").removesuffix(".py")
    spec = read_spec(path, overrides=fx.get("overrides") or {}, name=name)
    return with_device_sizes(spec, device)


def expectation(fx: dict[str, Any], device: str) -> dict[str, Any]:
    exp = {k: (list(v) if isinstance(v, list) else v) for k, v in fx["expect"].items()}
    for k, v in (fx.get(f"expect_{device}") or {}).items():
        if isinstance(v, list):
            exp[k] = list(exp.get(k, [])) + v
        else:
            exp[k] = v
    return exp


def candidate_source(fx: dict[str, Any], device: str) -> Optional[str]:
    rel = fx.get(device)
    return (FIXTURES / rel).read_text() if rel else None


class Evaluations:
    """One sandbox per device for the whole module; each fixture evaluated once."""

    def __init__(self, device: str, config: EvalConfig):
        self.device, self.config = device, config
        self.results: dict[str, Optional[EvalResult]] = {}
        self._sandbox = None

    def sandbox(self):
        if self._sandbox is None:
            from sandbox.evaluate import Sandbox

            self._sandbox = Sandbox(self.device, self.config)
        return self._sandbox

    def attempt(self, name: str, attempt_id: int = 1) -> AttemptView:
        fx = BY_NAME[name]
        source = candidate_source(fx, self.device)
        if source is None:
            from agent.parse import parse_answer

            answer = (FIXTURES / fx["answer"]).read_text() if fx.get("answer") else ""
            parsed = parse_answer(answer, "stop")
            return AttemptView(attempt_id=attempt_id, round=1, sample=attempt_id, parse_status=parsed.status,
                               source=parsed.source, result=None, parse_error=parsed.error)
        if name not in self.results:
            spec = task_spec(fx, self.device)
            # a correct candidate flagged `contended` only, timed on a disturbed machine, has no clean
            # verdict, so no "best" or "faster" finding: measured again (the build is cached)
            self.results[name] = remeasured(lambda: self.sandbox().evaluate(spec, source))
        return AttemptView(attempt_id=attempt_id, round=1, sample=attempt_id, parse_status="ok", source=source,
                           result=self.results[name], evaluation_id=1000 + attempt_id)

    def prefetch_builds(self, names: list[str]) -> None:
        """Build the fixtures' extensions concurrently (nvcc is slow), so that each evaluation
        afterwards finds its build cached. Only builds run at once: an evaluation timed while
        other builds hold the CPUs would be measured, and judged, under that load."""
        from concurrent.futures import ThreadPoolExecutor

        sandbox = self.sandbox()
        build = getattr(sandbox, "_build", None)
        if build is None:
            return
        todo = [BY_NAME[n] for n in names if candidate_source(BY_NAME[n], self.device)
                and (ROOT / BY_NAME[n]["task"]).is_file()]

        def one(fx: dict[str, Any]) -> None:
            from sandbox.result import Status

            spec = task_spec(fx, self.device)
            scratch = EvalResult(status=Status.runtime_error, task=spec.name, device=self.device)
            build(spec, candidate_source(fx, self.device), scratch)

        with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
            list(pool.map(one, todo))

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()


@pytest.fixture(scope="module")
def cpu_evals():
    ev = Evaluations("cpu", CPU_CONFIG)
    yield ev
    ev.close()


@pytest.fixture(scope="module")
def gpu_evals():
    if not _gpu_available():
        pytest.skip("no CUDA GPU")
    ev = Evaluations("cuda", GPU_CONFIG)
    ev.prefetch_builds(GPU_FIXTURES)     # nvcc builds are slow: build them all at once first
    yield ev
    ev.close()


def device_facts(device: str, attempt: AttemptView) -> DeviceFacts:
    r = attempt.result
    return DeviceFacts(device=device, name=(r.device_name if r else "") or device,
                       torch_version=(r.torch_version if r else "") or "")


def analyse(fx: dict[str, Any], attempts: list[AttemptView], device: str) -> AnalysisOut:
    spec = task_spec(fx, device)
    facts = device_facts(device, attempts[0])
    analysis = get_critic("grounded").analyze(spec, attempts, facts)
    bad = check_text(analysis.markdown, evidence_figures(attempts, facts), strict=True)
    assert not bad, f"figures not in the evidence: {[str(q) for q in bad]}\n{analysis.markdown}"
    return analysis


def check_fixture(name: str, evals: Evaluations) -> AnalysisOut:
    fx = BY_NAME[name]
    exp = expectation(fx, evals.device)
    attempt = evals.attempt(name)
    r = attempt.result
    context = f"{name} on {evals.device}: " + (
        f"{r.status.value} {r.error_type}: {(r.error_message or '')[:400]}\n{(r.stderr or '')[-1500:]}" if r else
        f"parse status {attempt.parse_status}")
    if exp.get("status") is None:
        assert r is None, context
        assert attempt.parse_status == exp["parse_status"], context
    else:
        assert r is not None and r.status.value == exp["status"], context
    analysis = analyse(fx, [attempt], evals.device)
    found = [f for f in analysis.findings if f.attempt_id in (attempt.attempt_id, None)]
    categories = [f.category for f in found]
    for c in exp.get("categories", []):
        assert c in categories, f"{context}\nexpected finding {c!r}, got {categories}\n{analysis.markdown}"
    for c in exp.get("absent_categories", []):
        assert c not in categories, f"{context}\nunexpected finding {c!r}\n{analysis.markdown}"
    text = "\n".join(f.cause for f in found).lower()
    for word in exp.get("keywords", []):
        assert word.lower() in text, f"{context}\n{word!r} not in the findings:\n{analysis.markdown}"
    if "error_line_text" in exp:
        line = r.build.first_error_line
        assert line is not None, context
        assert attempt.source.splitlines()[line - 1].strip() == exp["error_line_text"]
        assert f"line {line}" in text
    if "speedup_eager_above" in exp:
        assert r.speedup_eager is not None and r.speedup_eager > exp["speedup_eager_above"], \
            f"{context}: speedup vs eager {r.speedup_eager}"
    return analysis


# ----------------------------------------------------------------------------- cpu

CPU_FIXTURES = [f["name"] for f in MANIFEST]


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_FIXTURES)
def test_cpu_fixture(name, cpu_evals):
    check_fixture(name, cpu_evals)


@pytest.mark.slow
def test_cpu_task_history_like_seed_000(cpu_evals):
    """Several attempts of one task analysed together, as the loop does: an empty answer, a
    compile error, a fixed-size array; each keeps its own cause, nothing is correct yet."""
    names = ["empty_answer", "compile_error_undeclared", "fixed_array_256"]
    attempts = [cpu_evals.attempt(n, attempt_id=i) for i, n in enumerate(names, 1)]
    # the fixed-array candidate ran with output_size=1024; analyse under those sizes
    analysis = analyse(BY_NAME["fixed_array_256"], attempts, "cpu")
    by_attempt = {a.attempt_id: [f.category for f in analysis.findings if f.attempt_id == a.attempt_id]
                  for a in attempts}
    assert by_attempt[1] == ["no_code"]
    assert by_attempt[2][0] == "compile_error"
    assert "fixed_size_array" in by_attempt[3]
    assert "No attempt is correct yet" in analysis.markdown
    rows = [line for line in analysis.markdown.splitlines() if line.startswith("| ") and "attempt" not in line]
    assert len(rows) == 3


@pytest.mark.slow
def test_cpu_overflow_versus_latent(cpu_evals):
    """The same kernel: incorrect with Inf on inputs that overflow, correct with a latent
    risk on inputs that cannot; the analysis of the two together says both."""
    over, latent = cpu_evals.attempt("lse_overflow", 1), cpu_evals.attempt("lse_latent", 2)
    assert over.source == latent.source
    assert over.result.status.value == "incorrect" and latent.result.status.value == "correct"
    out = over.result.first_failed_trial().outputs[0]
    assert out.inf_count + out.nan_count > 0
    analysis = analyse(BY_NAME["lse_latent"], [over, latent], "cpu")
    cats = {(f.attempt_id, f.category) for f in analysis.findings}
    assert (1, "overflow") in cats and (2, "latent_overflow") in cats and (2, "nan_inf") not in cats


# ----------------------------------------------------------------------------- cuda

GPU_FIXTURES = [f["name"] for f in MANIFEST if f.get("cuda") or f.get("answer")]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_gpu_fixture(name, gpu_evals):
    dump = os.environ.get("KERNELLOOP_CRITIC_DUMP")
    try:
        analysis = check_fixture(name, gpu_evals)
    finally:
        if dump:    # the evidence and the analysis, for reading after a run on a GPU machine
            out = Path(dump)
            out.mkdir(parents=True, exist_ok=True)
            r = gpu_evals.results.get(name)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps({"name": name, "result": r.model_dump(mode="json") if r else None}) + "\n")
    if dump:
        with open(Path(dump) / "analyses.md", "a") as f:
            f.write(f"\n\n<!-- fixture {name} -->\n{analysis.markdown}")
