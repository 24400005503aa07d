"""The triton backend (``sandbox.backends``): verdicts of Triton candidates on the CPU, through
Triton's interpreter, with every check of the CUDA backend: correct, incorrect, compile error at
the candidate's line (Triton's own front end lowers each kernel for sm_90), no custom kernel,
lowered precision (the float64 rule). Each candidate under tests/triton_cases/ states its expected
status and flag in its first lines."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from sandbox.backends import BackendError, backend_for, resolve_backend
from sandbox.result import EvalConfig, FlagKind

from remeasure import remeasured

HERE = Path(__file__).parent / "triton_cases"
TASK = HERE / "task_ew.py"


# ---------------------------------------------------------------- the seam (no Triton needed)

def test_backend_names_resolve_per_device():
    assert resolve_backend(None, "cuda") == "cuda"
    assert resolve_backend(None, "cpu") == "cpu"
    assert resolve_backend("triton", "cpu") == "triton"
    assert resolve_backend("triton", "cuda") == "triton"
    with pytest.raises(BackendError, match="needs --device cuda"):
        resolve_backend("cuda", "cpu")
    with pytest.raises(BackendError, match="no backend 'tilelang'"):
        resolve_backend("tilelang", "cuda")


def test_load_inline_backends_keep_their_config_hash():
    # the hashes of EvalConfig before backends existed (main at c3437e2): stored evaluation keys stay valid
    assert EvalConfig().hash() == "07f01a175102029f"
    assert EvalConfig(trials=3, timed_runs=5).hash() == "99918dd706a890fe"
    assert EvalConfig(backend="triton").hash() != EvalConfig().hash()


def _kinds(backend: str, source: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in backend_for(backend, "cpu").scan(source):
        out.setdefault(f.kind.value, []).append(f.reason)
    return out


@pytest.mark.triton
@pytest.mark.parametrize("snippet,reason", [
    ("acc += tl.dot(a, b)", "TF32 unless"),                                   # Triton's default for fp32
    ("acc += tl.dot(a, b, input_precision='tf32')", "TF32"),
    ("acc = tl.dot(a, b, allow_tf32=True)", "TF32"),
    ("x = tl.load(p).to(tl.float16)", "half types"),
    ("y = tl.load(p, dtype=tl.bfloat16)", "half types"),
    ("os.environ['TRITON_F32_DEFAULT'] = 'tf32'", "default float32 dot"),
])
def test_triton_scan_names_its_ways_to_lower_precision(snippet, reason):
    kinds = _kinds("triton", snippet)
    assert any(reason in r for r in kinds.get("precision", [])), kinds


@pytest.mark.triton
def test_triton_scan_leaves_full_precision_dots_alone():
    assert "precision" not in _kinds("triton", "acc += tl.dot(a, b, input_precision='ieee')\n"
                                               "acc += tl.dot(a, b, input_precision=\"tf32x3\")\n"
                                               "acc += tl.dot(a, b, allow_tf32=False)\n")
    # the load_inline backends' scan is unchanged: a tl.dot there is nothing it knows
    assert "precision" not in _kinds("cpu", "acc += tl.dot(a, b)")


@pytest.mark.triton
def test_triton_scan_flags_patching_triton():
    assert "suspicious" in _kinds("triton", "import triton\ntriton.jit = lambda f: f\n")
    assert "suspicious" not in _kinds("cpu", "import triton\ntriton.jit = lambda f: f\n")


@pytest.mark.triton
def test_triton_first_error_is_the_candidate_line():
    be = backend_for("triton", "cpu")
    assert be.first_error("x\ncandidate.py:13: error: CompilationError: arange's arguments\n", "", []) == (
        "candidate.py:13: error: CompilationError: arange's arguments", 13)
    text, line = be.first_error('Traceback\n  File "candidate.py", line 7, in <module>\nNameError: name "q"\n', "", [])
    assert line == 7 and "NameError" in text


# ---------------------------------------------------------------- verdicts through the interpreter

def _expect(path: Path) -> tuple[set[str], str]:
    text = path.read_text()
    status = re.search(r"^# expect-status: (\S+)", text, re.M).group(1)
    flag = re.search(r"^# expect-flag: ?(\S*)", text, re.M).group(1)
    return set(status.split("|")), flag


@pytest.fixture(scope="module")
def triton_sandbox():
    from sandbox.evaluate import Sandbox

    config = EvalConfig(trials=3, timed_runs=3, warmup_runs=1, time_compile=False, profile=True,
                        run_timeout_s=120.0, backend="triton")
    with Sandbox("cpu", config, build_slots=1, warm_workers=0) as sb:
        yield sb


def _evaluate(sb, name: str, source: str | None = None):
    from sandbox.tasks import read_spec

    spec, text = read_spec(TASK, name="triton/task_ew"), source or (HERE / f"{name}.py").read_text()
    return remeasured(lambda: sb.evaluate(spec, text))


CASES = ["correct", "incorrect", "compile_error", "no_custom_kernel", "lowered_precision", "half_cast"]


@pytest.mark.triton
@pytest.mark.parametrize("name", CASES)
def test_triton_candidate_verdict(triton_sandbox, name):
    result = _evaluate(triton_sandbox, name)
    expected, flag = _expect(HERE / f"{name}.py")
    flags = {f.kind.value for f in result.flags}
    detail = f"{name}: {result.status.value} {sorted(flags)} {result.error_message!r}"
    print("VERDICT", detail)
    if name == "correct":
        assert result.clean, detail
        # its own kernel ran: counted launches, and the profiler's row for it marked its own
        assert result.custom_calls_per_forward >= 1, detail
        assert any(k.own and k.name == "kernelloop_ext::add_relu_scale_kernel" for k in result.profile), detail
        return
    assert not result.clean, detail
    if result.status.value == "correct":
        assert "flagged" in expected and flag in flags, detail
    else:
        assert result.status.value in expected, detail
    if name == "compile_error":
        # the interpreter would have run it: Triton's front end refused it, at the candidate's line
        assert result.build.first_error_line == 13, result.build
        assert "tl.constexpr" in result.build.first_error
    if name == "no_custom_kernel":
        assert result.custom_calls_per_forward == 0
        assert any("@triton.jit kernels" in f.reason for f in result.flags if f.kind == FlagKind.no_custom_kernel)
    if name == "lowered_precision":
        assert FlagKind.precision.value not in flags        # no static pattern: measured
        assert FlagKind.inaccurate.value in flags, detail


@pytest.mark.triton
def test_triton_syntax_error_is_a_compile_error_at_its_line(triton_sandbox):
    source = (HERE / "correct.py").read_text().replace("    mask = offs < n\n", "    mask = offs < n +\n")
    line = source.splitlines().index("    mask = offs < n +") + 1
    result = _evaluate(triton_sandbox, "syntax", source)
    assert result.status.value == "compile_error", result.error_message
    assert result.build.first_error_line == line


@pytest.mark.triton
def test_each_candidate_has_its_own_triton_cache_removed_with_its_worker(triton_sandbox):
    source = (HERE / "correct.py").read_text().replace(
        "        return out", "        import os\n        print('CACHE', os.environ['TRITON_CACHE_DIR'])\n        return out")
    dirs = []
    for _ in range(2):
        result = _evaluate(triton_sandbox, "cache", source)
        assert result.clean, (result.status, result.flags, result.error_message)
        found = set(re.findall(r"^CACHE (\S+)$", result.stdout, re.M))
        assert len(found) == 1, result.stdout[-500:]
        dirs.append(Path(found.pop()))
    assert dirs[0] != dirs[1]
    assert all(d.name == "triton-cache" and d.parent.name.startswith("kl-candidate-") for d in dirs), dirs
    assert not any(d.exists() for d in dirs)        # gone with the worker's temporary directory


# ---------------------------------------------------------------- prompts, answers, runs

def _first_prompt(backend, device="cpu"):
    from agent.prompts import build_proposal_messages
    from agent.types import DeviceFacts
    from sandbox.tasks import read_spec

    facts = DeviceFacts(device=device, name="a device", torch_version="2.13.0")
    _, messages, sha = build_proposal_messages(read_spec(HERE / "task_add_relu.py", name="triton/add_relu"), facts, 0,
                                               [], None, None, backend=backend)
    return messages, sha


def test_triton_prompt_has_its_own_contract_and_worked_example():
    messages, sha = _first_prompt("triton")
    system, user = messages[0]["content"], messages[-1]["content"]
    assert "Triton kernels (`@triton.jit`)" in system and "load_inline" not in user
    assert "launched from `forward` as `kernel[grid](...)`" in user
    assert 'input_precision="ieee"' in user                    # the contract names tl.dot's TF32 default
    assert "Triton's interpreter" in user                      # said on a CPU target only
    assert "interpreter" not in _first_prompt("triton", "cuda")[0][-1]["content"]
    assert "add_relu_kernel[(triton.cdiv(n, 1024),)]" in user  # the worked example
    cpu_messages, cpu_sha = _first_prompt(None)
    assert cpu_sha != sha and "load_inline" in cpu_messages[-1]["content"]
    assert _first_prompt("cpu")[1] == cpu_sha                  # None is the device's own backend


def _example_answer(user: str) -> str:
    from agent.parse import parse_answer

    parsed = parse_answer(user[user.index("Example."):])
    assert parsed.ok, parsed.error
    return parsed.source


def test_a_triton_answer_parses():
    source = _example_answer(_first_prompt("triton")[0][-1]["content"])
    assert "@triton.jit" in source and "class ModelNew" in source


@pytest.mark.triton
def test_the_worked_example_is_a_correct_candidate(triton_sandbox):
    from sandbox.tasks import read_spec

    source = _example_answer(_first_prompt("triton")[0][-1]["content"])
    spec = read_spec(HERE / "task_add_relu.py", name="triton/add_relu")
    result = remeasured(lambda: triton_sandbox.evaluate(spec, source))
    assert result.clean, (result.status, result.flags, result.error_message)


def test_cli_backend_option_resolves_per_device():
    import typer

    from kernelloop.cli_common import resolve_kernel_backend

    assert resolve_kernel_backend(None, "cuda") is None
    assert resolve_kernel_backend("cuda", "cuda") is None          # the device's own: stored as before
    assert resolve_kernel_backend("cuda", "cpu") is None           # CUDA's place on the CPU target is C++
    with pytest.raises((SystemExit, typer.Exit)):
        resolve_kernel_backend("tilelang", "cuda")


@pytest.mark.triton
def test_cli_triton_backend_is_stored_by_name():
    from kernelloop.cli_common import resolve_kernel_backend

    assert resolve_kernel_backend("triton", "cpu") == "triton"
    assert resolve_kernel_backend(None, "cpu", "triton") == "triton"   # a stored run's, kept


def test_triton_backend_without_triton_says_so_before_any_candidate(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(BackendError, match="needs the triton package"):
        backend_for("triton", "cpu")


def test_runs_of_older_stores_get_their_devices_backend(tmp_path):
    import sqlalchemy as sa

    from store import Store
    from store.migrations import MIGRATIONS

    path = tmp_path / "v5.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE kernelloop_meta (key VARCHAR(64) PRIMARY KEY, value TEXT NOT NULL)"))
        conn.execute(sa.text("INSERT INTO kernelloop_meta VALUES ('app', 'kernelloop'), ('schema_version', '5')"))
        for m in MIGRATIONS[:5]:
            m(conn)
        for device in ("cuda", "cpu"):
            conn.execute(sa.text("INSERT INTO runs (kind, status, model, critic, device, device_name, torch_version, "
                                 "code_version, config, started_at) VALUES ('optimize', 'finished', 'builtin', "
                                 "'grounded', :d, 'x', '2.13', 'v', '{}', '2026-01-01 00:00:00')"), {"d": device})
    engine.dispose()
    store = Store(path)
    try:
        from store.models import Run

        with store.reader() as s:
            assert [(r.device, r.backend) for r in s.scalars(sa.select(Run).order_by(Run.id))] == [
                ("cuda", "cuda"), ("cpu", "cpu")]
    finally:
        store.close()


# ---------------------------------------------------------------- the builtin proposer

def _spec(name: str):
    from sandbox.tasks import discover, read_spec, with_device_sizes

    return with_device_sizes(read_spec(discover([name])[0]), "cpu")


def test_builtin_writes_triton_for_elementwise_groups():
    from agent.builtin import propose

    cand = propose(_spec("seeds/conv2d_divide_leakyrelu"), "cpu", 0, 0, [], backend="triton")
    # on the cpu device the convolution keeps its bias (oneDNN adds it): the group starts at div
    assert cand.choices["backend"] == "triton" and cand.covered_ops == ["div", "leaky_relu"]
    assert "@triton.jit" in cand.source and "load_inline" not in cand.source
    assert "self.conv(x)" in cand.source                         # the library operator stays on PyTorch
    # the samples of a round differ (block size, warps), and what history holds is not proposed again
    second = propose(_spec("seeds/conv2d_divide_leakyrelu"), "cpu", 0, 1, [], backend="triton")
    assert second.source != cand.source

    assert propose(_spec("seeds/conv2d_divide_leakyrelu"), "cpu", 1, 0, [_attempt(cand.source, None)],
                   backend="triton").source != cand.source


def _attempt(source, result):
    from agent.types import AttemptView

    return AttemptView(attempt_id=1, round=0, sample=0, parse_status="ok", source=source, result=result)


def test_builtin_triton_narrows_a_group_that_failed():
    from agent.builtin import propose
    from sandbox.result import BuildInfo, EvalResult, Status

    spec = _spec("seeds/conv2d_divide_leakyrelu")
    first = propose(spec, "cpu", 0, 0, [], backend="triton")
    assert [g["ops"] for g in first.choices["groups"]] == [["div", "leaky_relu"]]    # the conv keeps its bias on cpu
    # a compile error at a line inside kl_g0's kernel: that group is halved next round
    line = next(i for i, text in enumerate(first.source.splitlines(), 1) if "tl.where(" in text)
    failed = EvalResult(status=Status.compile_error, task=spec.name, device="cpu",
                        build=BuildInfo(ok=False, first_error="candidate.py:%d: error: ..." % line, first_error_line=line))
    second = propose(spec, "cpu", 1, 0, [_attempt(first.source, failed)], backend="triton")
    assert [g["ops"] for g in second.choices["groups"]] == [["div"], ["leaky_relu"]], second.choices
    assert second.choices["cuts"]


def test_builtin_triton_leaves_operators_without_a_triton_form_to_pytorch():
    from agent.builtin.triton_gen import tl_expr

    assert "tl.exp" in tl_expr("sigmoid", ["x"], {})
    with pytest.raises(KeyError):
        tl_expr("softplus", ["x"], {"beta": 1.0, "threshold": 20.0})     # log1p: no interpreter form in 3.9


@pytest.mark.triton
def test_builtin_triton_candidate_is_correct(triton_sandbox):
    from agent.builtin import propose

    spec = _spec("seeds/conv2d_divide_leakyrelu")
    cand = propose(spec, "cpu", 0, 0, [], backend="triton")
    result = remeasured(lambda: triton_sandbox.evaluate(spec, cand.source))
    assert result.clean, (result.status, result.flags, result.error_message)
    assert result.custom_calls_per_forward == 1


# ---------------------------------------------------------------- the GPU's compile errors, mapped on the CPU

_GPU_MAPPING = r"""
import json, os, sys
os.chdir(sys.argv[2])
from sandbox.backends.triton_hook import TritonHook
from sandbox.tasks import exec_source
source = open(sys.argv[1]).read()
hook = TritonHook("cuda")              # compiled mode: Triton's JIT, no interpreter
hook.install(source)
ns = exec_source(source, "candidate.py", module_name="kernelloop_candidate")
import torch
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from sandbox.backends.triton_frontend import signature_of
kernel = ns["add_relu_scale_kernel"]
x = torch.randn(8)
sig = signature_of(kernel.fn, (x, x, x, 8, 1.5), {"BLOCK": 1024})
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
options = backend.parse_options({})
context = ir.context(); ir.load_dialects(context); backend.load_dialects(context)
try:   # what the JIT does at a kernel's first launch on a GPU
    ASTSource(kernel, *sig).make_ir(target, options, backend.get_codegen_implementation(options),
                                    backend.get_module_map(), context)
    print(json.dumps({"compiled": True}))
except Exception as exc:
    print(json.dumps({"kernels": hook.kernel_names(), "line": hook._line_of(exc), "type": type(exc).__name__,
                      "cache": os.environ["TRITON_CACHE_DIR"]}))
"""


@pytest.mark.triton
def test_a_gpu_compile_error_maps_to_the_candidate_line(tmp_path):
    """Without a GPU, Triton's JIT in compiled mode (the hook as a GPU worker installs it) meets the
    non-constexpr tl.arange bound at the kernel's first compile: the hook maps its error to line 13."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _GPU_MAPPING, str(HERE / "compile_error.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer == {"kernels": ["add_relu_scale_kernel"], "line": 13, "type": "CompilationError",
                      "cache": str(tmp_path / "triton-cache")}, proc.stderr[-2000:]


def test_the_llm_critic_reviews_triton_attempts_as_triton():
    from agent.critic.base import get_critic
    from agent.types import AttemptView, DeviceFacts
    from sandbox.result import BuildInfo, EvalResult, Status
    from sandbox.tasks import read_spec

    task = read_spec(TASK, name="triton/task_ew")
    gpu = DeviceFacts(device="cuda", name="NVIDIA H100 80GB HBM3", torch_version="2.13.0")

    def system(backend):
        res = EvalResult(status=Status.incorrect, task=task.name, device="cuda", build=BuildInfo(ok=True),
                         config=EvalConfig(backend=backend))
        view = AttemptView(attempt_id=1, round=0, sample=0, parse_status="ok", source="x = 1\n", result=res,
                           evaluation_id=101)
        class Model:                    # the critic only renders its prompt here
            def chat(self, messages):
                raise AssertionError("not called")
        return get_critic("llm", backend=Model()).messages(task, [view], gpu)[0]["content"]

    assert "custom Triton kernels" in system("triton")
    assert "custom CUDA kernels" in system(None)
