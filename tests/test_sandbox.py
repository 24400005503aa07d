"""Sandbox mechanics: comparison policy, static scan, timing summary, build cache and locks,
compiler-error mapping, and the one-shot ``kernelloop eval`` command."""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from sandbox import anticheat
from sandbox.build import HookedBuilder, extension_key, first_compiler_error
from sandbox.numerics import Numerics
from sandbox.compare import compare_outputs, fp64_errors, fp64_verdict
from sandbox.evaluate import Sandbox
from sandbox.result import EvalConfig, FlagKind, Status
from sandbox.slots import REFERENCE_AFFINITY
from sandbox.tasks import read_spec
from sandbox.timing import summarize

ADV = Path(__file__).parent / "adversarial"
TASK = ADV / "task_small.py"
CFG = EvalConfig()


# ------------------------------------------------------------------ comparison policy
def test_identical_outputs_pass():
    x = torch.randn(8, 33)
    ok, reason, checks = compare_outputs([x], [x.clone()], CFG)
    assert ok and reason is None and checks[0].mismatched == 0 and checks[0].max_abs_err == 0


def test_error_within_tolerance_passes_and_beyond_fails():
    x = torch.randn(64, 64)
    assert compare_outputs([x], [x + 5e-5], CFG)[0]
    ok, reason, checks = compare_outputs([x], [x + 1e-3], CFG)
    assert not ok and "outside atol=0.0001" in reason and checks[0].mismatch_pattern == "everywhere"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_chunked_comparison_agrees_with_one_chunk_and_leaves_the_reference_alone(monkeypatch, dtype):
    import sandbox.compare as compare

    g = torch.Generator().manual_seed(7)
    ref = torch.randn(3, 5, 67, generator=g).to(dtype)
    out = (ref.double() + torch.randn(ref.shape, generator=g, dtype=torch.float64) * 2e-4).to(dtype)
    out.view(-1)[3] = float("nan")
    ref.view(-1)[150], out.view(-1)[150] = float("inf"), float("inf")
    out.view(-1)[700] = float("-inf")
    out[2, 4, 60:] += 1.0
    before = ref.clone()
    whole = compare_outputs([ref], [out], CFG)
    monkeypatch.setattr(compare, "CHUNK", 64)         # chunk edges fall inside rows and runs of NaN
    chunked = compare_outputs([ref], [out], CFG)
    assert torch.equal(ref, before)
    assert whole[0] == chunked[0] and whole[1] == chunked[1]
    assert [c.model_dump() for c in whole[2]] == [c.model_dump() for c in chunked[2]]
    c = chunked[2][0]
    assert (c.nan_count, c.inf_count, c.ref_nonfinite) == (1, 1, 1) and c.mismatched > 7


def test_tolerance_follows_the_precision_as_kernelbench_sets_it():
    x = torch.randn(32, 32).half()
    near = (x.float() + 5e-3).half()
    ok, _, checks = compare_outputs([x], [near], EvalConfig(numerics=Numerics(precision="fp16")))
    assert ok and checks[0].tolerance.atol == pytest.approx(1e-2)
    ok, _, checks = compare_outputs([x.bfloat16()], [near.bfloat16()], EvalConfig(numerics=Numerics(precision="bf16")))
    assert ok and checks[0].tolerance.rtol == pytest.approx(1e-2)
    # an fp32 run holds every output to 1e-4, whatever its dtype (KernelBench: one tolerance per precision)
    ok, _, checks = compare_outputs([x], [near], CFG)
    assert not ok and checks[0].tolerance.atol == pytest.approx(1e-4)


def test_tail_mismatch_is_called_tile_edges():
    ref = torch.randn(16, 300)
    out = ref.clone()
    out[:, 256:] += 1.0            # columns past the last multiple of 256 were never written right
    ok, _, checks = compare_outputs([ref], [out], CFG)
    assert not ok and checks[0].mismatch_pattern == "tile_edges"


def test_some_rows_and_scattered_patterns():
    ref = torch.randn(64, 40)
    out = ref.clone()
    out[3] += 1
    out[10] += 1
    assert compare_outputs([ref], [out], CFG)[2][0].mismatch_pattern == "some_rows"
    out = ref.clone()
    out.view(-1)[torch.arange(0, ref.numel(), 7)] += 1     # every row hit, a few columns each
    assert compare_outputs([ref], [out], CFG)[2][0].mismatch_pattern == "scattered"


def test_nan_where_reference_is_finite_fails_but_matching_nan_passes():
    ref = torch.randn(10)
    out = ref.clone()
    out[2] = float("nan")
    ok, reason, checks = compare_outputs([ref], [out], CFG)
    assert not ok and checks[0].nan_count == 1 and "NaN" in reason
    ref2 = ref.clone()
    ref2[2] = float("nan")
    assert compare_outputs([ref2], [out], CFG)[0]


def test_shape_dtype_and_count_mismatches():
    x = torch.randn(4, 5)
    assert "shape" in compare_outputs([x], [x.t()], CFG)[1]
    assert "dtype" in compare_outputs([x], [x.double()], CFG)[1]
    assert "2 output" in compare_outputs([x], [x, x], CFG)[1]


# ------------------------------------------------------------------ the float64 check
def _gemm(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(64, 512, generator=g), torch.randn(512, 48, generator=g)
    return a, b, (a.double() @ b.double())


def test_fp64_errors_measure_both_sides_against_float64():
    a, b, ref64 = _gemm()
    ref = a @ b
    truncated = (ref.view(torch.int32) & ~0xff).view(torch.float32)      # 15 significand bits
    ref_rel, cand_rel = fp64_errors(ref, truncated, ref64)
    assert 0 < ref_rel < 1e-6                        # float32 GEMM: a few ulps
    assert 1e-6 < cand_rel < 2 ** -15                 # truncation: much worse, still within rtol
    assert fp64_errors(ref, ref.clone(), ref64) == (ref_rel, ref_rel)
    # non-finite elements are the tolerance check's business: left out here
    nan_ref = ref.clone(); nan_ref[0, 0] = float("nan")
    assert fp64_errors(nan_ref, nan_ref.clone(), ref64)[0] == pytest.approx(ref_rel, rel=0.05)
    # not applicable: integer outputs, a float32 "float64 run", other shapes
    assert fp64_errors(ref.int(), ref.int(), ref64) is None
    assert fp64_errors(ref, ref, ref64.float()) is None
    assert fp64_errors(ref, ref, ref64[:1]) is None


def test_fp64_verdict_allows_reordered_sums_and_flags_lost_bits():
    a, b, ref64 = _gemm(1)
    ref = a @ b
    reordered = sum(a[:, k:k + 64] @ b[k:k + 64] for k in range(0, 512, 64))   # another summation order
    truncated = (ref.view(torch.int32) & ~0xff).view(torch.float32)
    tf32ish = (a.view(torch.int32) & ~0x1fff).view(torch.float32) @ (b.view(torch.int32) & ~0x1fff).view(torch.float32)
    checks = compare_outputs([ref, ref, ref], [reordered, truncated, tf32ish], CFG)[2]
    for c, cand in zip(checks, (reordered, truncated, tf32ish)):
        c.ref_fp64_rel_rms, c.fp64_rel_rms = fp64_errors(ref, cand, ref64)
    assert fp64_verdict(checks[0], CFG.numerics) is None
    assert "relative RMS error" in fp64_verdict(checks[1], CFG.numerics)
    assert fp64_verdict(checks[2], CFG.numerics) is not None
    # an all-elementwise output: a reference error of ~0 still leaves a few epsilons of room
    checks[0].ref_fp64_rel_rms, checks[0].fp64_rel_rms = 0.0, 3 * CFG.numerics.eps
    assert fp64_verdict(checks[0], CFG.numerics) is None
    # a reference that is itself far from its float64 run (random numbers in forward): no verdict
    checks[1].ref_fp64_rel_rms = 0.5
    assert fp64_verdict(checks[1], CFG.numerics) is None


# ------------------------------------------------------------------ static scan
@pytest.mark.parametrize("snippet, kind", [
    ("y = x.half()", FlagKind.precision),
    ("torch.backends.cuda.matmul.allow_tf32 = True", FlagKind.precision),
    ("at::globalContext().setAllowTF32CuBLAS(true);", FlagKind.precision),
    ("cublasGemmEx(h, a, b, CUBLAS_COMPUTE_32F_FAST_TF32, algo);", FlagKind.precision),
    ("import time\ntime.perf_counter = lambda: 0", FlagKind.suspicious),
    ("torch.allclose = lambda *a, **k: True", FlagKind.suspicious),
    ("import threading\nthreading.Thread(target=f).start()", FlagKind.suspicious),
    ("torch.manual_seed(0)", FlagKind.suspicious),
    ("from hardware import clock\nclock._elapsed_time = lambda a, b: 0.001", FlagKind.suspicious),
    ("class ModelNew:\n    def forward(self, x):\n        try:\n            return k(x)\n        except Exception:\n            return x",
     FlagKind.fallback),
    ("m = Model(3)", FlagKind.fallback),
])
def test_static_scan_flags(snippet, kind):
    assert kind in {f.kind for f in anticheat.scan(snippet)}


def test_precision_notes_read_what_the_code_does_not_what_its_comments_say():
    """The builtin's C++ mentions ``-ffast-math`` in a comment: every builtin CPU candidate was noted
    as compiled with fast-math. Comments (Python's, and C++'s inside the sources) say nothing; a flag
    in a list load_inline gets still counts, a ``//`` division before it on the line included."""
    said = ('src = r"""\n// glibc declares its vector expf only under -ffast-math\n__global__ void k(float* p) {}\n"""\n'
            "# a note: no --use_fast_math, no x.half()\n")
    assert not [f for f in anticheat.scan(said) if f.kind == FlagKind.precision]
    done = 'n = 7 // 2; m = load_inline(name="x", cpp_sources=[""], extra_cuda_cflags=["-O3", "--use_fast_math"])\n'
    assert [f.reason for f in anticheat.scan(done) if f.kind == FlagKind.precision] == ["compiles with fast-math"]
    from agent.builtin import generate
    from sandbox.tasks import read_spec

    builtin = generate(read_spec(ADV.parents[1] / "tasks/seeds/conv2d_bias_scale_sigmoid_groupnorm.py"), "cpu").source
    assert "-ffast-math" in builtin and not [f for f in anticheat.scan(builtin) if f.kind == FlagKind.precision]


def test_static_scan_is_quiet_on_an_honest_candidate():
    assert anticheat.scan((ADV / "cpu" / "honest.py").read_text()) == []


def test_static_scan_tells_a_joined_side_stream_from_an_unjoined_one():
    """A side stream joined back to the caller's stream (PyTorch's CUDA-graph recipe) is no flag;
    one the caller's stream never waits for is (the side-stream exploits, cuda and triton)."""
    for legit in ("legit_cuda_graph", "legit_joined_side_stream", "graph_of_torch"):
        assert not [f for f in anticheat.scan((ADV / "cuda" / f"{legit}.py").read_text())
                    if f.kind == FlagKind.suspicious], legit
    for exploit in (ADV / "cuda" / "side_stream.py", ADV / "triton" / "side_stream.py"):
        reasons = [f.reason for f in anticheat.scan(exploit.read_text()) if f.kind == FlagKind.suspicious]
        assert any("never joins back" in r for r in reasons), exploit
    # the side stream waiting for the caller's stream (a fork) is not a join
    fork = "s = torch.cuda.Stream()\ns.wait_stream(torch.cuda.current_stream())\nwith torch.cuda.stream(s):\n    y = f(x)"
    assert any("never joins back" in f.reason for f in anticheat.scan(fork))
    join = fork + "\ntorch.cuda.current_stream().wait_stream(s)"
    assert not anticheat.scan(join)


# ------------------------------------------------------------------ timing and build helpers
def test_summarize_median_and_iqr():
    t = summarize([1.0, 2.0, 3.0, 4.0, 100.0], "perf_counter")
    assert t.median_ms == 3.0 and t.min_ms == 1.0 and t.max_ms == 100.0 and t.runs == 5
    assert t.iqr_ms == pytest.approx(2.0)


def test_kernel_names_with_launch_bounds_before_or_after_the_return_type():
    """The builtin generator writes ``__global__ void __launch_bounds__(256) name(``: the name
    was missed, and every builtin candidate on the H200 was flagged as running no kernel of its own."""
    from sandbox.build import kernel_names
    from sandbox.profiling import _is_own

    sources = ["__global__ __launch_bounds__(256, 2) void a(int x) {}",
               "template <typename I>\n__global__ void __launch_bounds__(256) kl_g0_kernel4(const float* in, I n) {}",
               "__global__ static void c(float* p) {}\nextern \"C\" __global__ void d() {}"]
    names = kernel_names(sources)
    assert names == ["a", "c", "d", "kl_g0_kernel4"]
    assert _is_own("void kl_g0_kernel4<int>(float const*, float*, int)", names)
    assert not _is_own("void at::native::elementwise_kernel<128, 2>(int)", names)


def test_extension_key_depends_on_sources_and_flags_only():
    a = {"cpp_sources": ["int f();"], "extra_cflags": ["-O3"]}
    assert extension_key(a, "2.13", None) == extension_key(dict(a), "2.13", None)
    assert extension_key(a, "2.13", None) != extension_key({**a, "extra_cflags": ["-O2"]}, "2.13", None)
    assert extension_key(a, "2.13", None) != extension_key(a, "2.14", None)


def test_first_compiler_error_maps_to_the_candidate_line(tmp_path):
    (tmp_path / "main.cpp").write_text("#include <x>\nint a;\n  for (j = 0; j < n; ++j) q[j] = 0.f;\n")
    source = "import torch\nCPP = '''\nint a;\n  for (j = 0; j < n; ++j) q[j] = 0.f;\n'''\n"
    log = f"{tmp_path}/main.cpp:3:8: error: 'j' was not declared in this scope\n"
    text, line = first_compiler_error(log, source, [str(tmp_path)])
    assert "'j' was not declared" in text and line == 4


# ------------------------------------------------------------------ real builds and runs
def test_a_cached_build_keeps_how_it_was_built(tmp_path, monkeypatch):
    """A cache hit reports the first build's notes (lighter headers, the split, the binding), so a
    stored evaluation says how its extension was built whichever evaluation built it."""
    from sandbox.evaluate import evaluate

    monkeypatch.setenv("KERNELLOOP_CACHE", str(tmp_path))       # a cold cache: the first build is real
    spec = read_spec(TASK, name="adversarial/task_small")
    src = (ADV / "cpu" / "honest.py").read_text()
    cfg = EvalConfig(trials=1, warmup_runs=1, timed_runs=2, time_compile=False)
    first, second = evaluate(spec, src, "cpu", cfg), evaluate(spec, src, "cpu", cfg)
    assert not first.build.cached and first.build.notes, first.build
    assert second.build.cached and second.build.notes == first.build.notes


def test_the_candidates_profile_is_taken_with_the_device_held_as_for_its_timing(sandbox, monkeypatch):
    """Beside background work (another candidate loading or warming up, a footprint measured beside)
    12 of session ad's 388 profiles summed to 1.3-2x their timed forward: the candidate's profile
    request goes out with the slot's gate held for timing, as its timed runs do."""
    from sandbox.pool import DeviceGate
    from sandbox.process import WorkerProcess

    asked: list[tuple[str, bool, WorkerProcess]] = []
    real_ask = WorkerProcess.ask

    def ask(self, payload, *args, **kwargs):
        gates = sandbox._gates
        asked.append((payload.get("op"), any(g._timing for g in gates), self))
        return real_ask(self, payload, *args, **kwargs)

    monkeypatch.setattr(WorkerProcess, "ask", ask)
    assert sandbox._gates and all(isinstance(g, DeviceGate) for g in sandbox._gates)
    result = sandbox.evaluate(read_spec(TASK, name="adversarial/task_small"), (ADV / "cpu" / "honest.py").read_text())
    assert result.status is Status.correct and result.profile, (result.status, result.error_message)
    references = {id(ref.proc) for ref in sandbox._refs.values()}
    mine = [(op, held) for op, held, proc in asked if id(proc) not in references]
    assert [held for op, held in mine if op == "profile"] == [True], mine
    assert any(op == "time" and held for op, held in mine) and not any(op == "trial" and held for op, held in mine)
    # the reference's profile, taken once per task under its lock, is not (see CandidateChecks.run)
    assert not any(held for op, held, proc in asked if op == "profile" and id(proc) in references)


def test_workers_end_with_the_slots_gate_held_for_background_work(monkeypatch):
    """A worker's exit (the driver tearing its CUDA context down) is device work: the candidate used
    to be killed after its slot was let go, so the next timing on the slot could begin beside it
    (session ag's H100: 22 of 400 evaluations flagged for the SM use of a worker of their own run).
    The candidate is now killed while its evaluation still holds the slot (a timing there waits for
    it; whatever it left running ends before), and a finished task's reference closes holding the
    slot's gate as background work: never inside another evaluation's timing window."""
    from sandbox.evaluate import Sandbox
    from sandbox.process import WorkerProcess
    from sandbox.reference import ReferenceWorker
    from sandbox.result import EvalConfig

    seen: list[tuple[str, bool]] = []
    real_kill, real_close = WorkerProcess.kill, ReferenceWorker.close

    def held(sb):
        return any(g._background for g in sb._gates) or any(lock.locked() for lock in sb._slot_locks)

    cfg = EvalConfig(trials=1, timed_runs=2, warmup_runs=1, time_compile=False, run_timeout_s=60.0)
    with Sandbox("cpu", cfg, build_slots=1, warm_workers=0) as sb:
        monkeypatch.setattr(WorkerProcess, "kill", lambda self: (seen.append((self.role, held(sb))), real_kill(self))[1])
        monkeypatch.setattr(ReferenceWorker, "close", lambda self, *a, **k: (seen.append(("reference close", held(sb))),
                                                                             real_close(self, *a, **k))[1])
        spec = read_spec(TASK, name="adversarial/task_small")
        result = sb.evaluate(spec, (ADV / "cpu" / "honest.py").read_text())
        assert result.status is Status.correct, (result.status, result.error_message)
        sb.release(spec)
        assert ("candidate", True) in seen and ("reference close", True) in seen, seen
        assert sb.gate_account.get("reference exit", {}).get("n", 0) >= 1
        assert not any(lock.locked() for lock in sb._slot_locks)


def test_the_harness_notes_made_during_the_checks_reach_the_result(sandbox, monkeypatch):
    """A note the checks append to the result's stderr (a window timed again, the float64 check
    skipped, torch.compile failing) is kept after the candidate's own stderr, which was written over
    it: no such note was in any of session af's 300 stored results."""
    from sandbox.checks import CandidateChecks

    real_floor = CandidateChecks._floor

    def floor(self, ref, result):
        result.stderr += "\n[kernelloop] a note from the checks"
        return real_floor(self, ref, result)

    monkeypatch.setattr(CandidateChecks, "_floor", floor)
    result = sandbox.evaluate(read_spec(TASK, name="adversarial/task_small"), (ADV / "cpu" / "honest.py").read_text())
    assert result.status is Status.correct, (result.status, result.error_message)
    assert result.stderr.endswith("\n[kernelloop] a note from the checks"), result.stderr[-300:]


def test_identical_candidate_is_a_cache_hit(sandbox):
    spec = read_spec(TASK, name="adversarial/task_small")
    src = (ADV / "cpu" / "honest.py").read_text()
    first = sandbox.evaluate(spec, src)
    second = sandbox.evaluate(spec, src)
    assert first.status is Status.correct and second.status is Status.correct
    assert second.build.cached and second.build.extensions == first.build.extensions
    assert second.build.extensions[0].startswith("kl_")
    # where the time went, stage by stage, adding up to no more than the whole
    assert {"build", "reference", "load_wait", "load", "trials", "timing", "spot_checks", "profile", "floor"} <= set(first.phases)
    assert 0 < sum(first.phases.values()) <= first.seconds + 0.01


def test_a_stale_build_lock_never_hangs_a_later_build(sandbox, tmp_path, monkeypatch):
    spec = read_spec(TASK, name="adversarial/task_small")
    src = (ADV / "cpu" / "honest.py").read_text()
    done = sandbox.evaluate(spec, src)
    build_dir = HookedBuilder().cache_root / done.build.extensions[0]
    (build_dir / "lock").write_text("left by a killed build")       # torch's FileBaton
    (build_dir / ".built").unlink()
    again = sandbox.evaluate(spec, src)
    assert again.status is Status.correct and not (build_dir / "lock").exists()


def test_trials_and_timed_runs_see_the_same_precision_switches(sandbox):
    """Timed runs ran under PyTorch's defaults (cuDNN TF32 on) while trials ran at full fp32:
    on a GPU an honest conv -> kernel candidate then failed the spot check of its timed runs
    (errors near 1e-3), and any candidate could tell a trial from a timed run by reading the
    switch. This one returns a visibly different answer whenever TF32 is on."""
    spec = read_spec(TASK, name="adversarial/task_small")
    src = (ADV / "cpu" / "honest.py").read_text().replace(
        "        return ext.relu_scale(self.linear(x).contiguous(), self.scale)",
        "        y = ext.relu_scale(self.linear(x).contiguous(), self.scale)\n"
        "        return y + 1e-3 if (torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32) else y")
    assert "allow_tf32 or" in src
    r = sandbox.evaluate(spec, src)
    assert r.status is Status.correct, [t.reason for t in r.trials]
    assert len(r.trials) > sandbox.config.trials and all(t.passed for t in r.trials)   # spot checks included


def test_compile_error_names_the_first_error_and_its_candidate_line(sandbox):
    spec = read_spec(TASK, name="adversarial/task_small")
    path = ADV / "cpu" / "compile_error.py"
    src = path.read_text()
    r = sandbox.evaluate(spec, src)
    assert r.status is Status.compile_error
    assert "was not declared" in r.build.first_error
    expected = next(i for i, l in enumerate(src.splitlines(), 1) if re.search(r"for \(j = 0", l))
    assert r.build.first_error_line == expected


def test_eval_command_prints_the_verdict(tmp_path):
    from typer.testing import CliRunner

    from kernelloop.cli import app

    res = CliRunner().invoke(app, ["eval", str(TASK), str(ADV / "cpu" / "honest.py"), "--device", "cpu",
                                   "--no-compile", "--trials", "2", "--timed-runs", "3", "--json"])
    assert res.exit_code == 0, res.output
    import json

    data = json.loads(res.output[res.output.index("{"):])
    assert data["status"] == "correct" and data["candidate_time"]["runs"] == 3


def test_eval_build_only_runs_nothing_and_names_the_first_error(tmp_path):
    import json

    from typer.testing import CliRunner

    from kernelloop.cli import app

    ok = CliRunner().invoke(app, ["eval", str(TASK), str(ADV / "cpu" / "honest.py"), "--device", "cpu",
                                  "--build-only", "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.output[ok.output.index("{"):])
    assert data["ok"] and data["build"]["ok"] and data["build"]["extensions"] and data["status"] is None
    assert "trials" not in data and "candidate_time" not in data     # a BuildCheck, nothing was run
    bad = CliRunner().invoke(app, ["eval", str(TASK), str(ADV / "cpu" / "compile_error.py"), "--device", "cpu",
                                   "--build-only"])
    assert bad.exit_code == 1, bad.output
    assert "compile_error" in bad.output and "first error (candidate line" in bad.output
    # --arch names a CUDA build: it is refused with --device cpu rather than silently ignored
    mixed = CliRunner().invoke(app, ["eval", str(TASK), str(ADV / "cpu" / "honest.py"), "--device", "cpu",
                                     "--arch", "9.0a", "--build-only"])
    assert mixed.exit_code != 0 and "--arch" in mixed.output


def test_candidates_spread_over_gpu_slots_and_workers_see_only_theirs(monkeypatch):
    import sandbox.evaluate as ev

    monkeypatch.setattr(ev, "_device_name", lambda device: "fake GPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    sb = Sandbox("cuda", EvalConfig(), arch="9.0a")
    assert sb.slots == ["2", "5"]
    first, second = sb._pick_slot(), sb._pick_slot()
    assert {first, second} == {0, 1}                      # the least-loaded slot is taken
    assert sb._slot_env(first) != sb._slot_env(second)
    assert {sb._slot_env(i)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)} == {"2", "5"}
    sb._release_slot(first)
    assert sb._pick_slot() == first
    spec = read_spec(TASK, name="adversarial/task_small")
    assert sb.reference(spec, 0) is not sb.reference(spec, 1)   # one trusted reference per GPU
    assert Sandbox("cpu", EvalConfig()).slots == [None]
    # a task's candidates stay where its reference runs until that slot has REFERENCE_AFFINITY more
    # candidates in flight than the least-loaded one (a reference start costs a GPU 10-19 s)
    sb2 = Sandbox("cuda", EvalConfig(), arch="9.0a")
    sb2.reference(spec, 1)
    picks = [sb2._pick_slot(spec) for _ in range(REFERENCE_AFFINITY + 2)]
    assert picks == [1] * (REFERENCE_AFFINITY + 1) + [0], picks
    assert sb2._pick_slot() == 0                            # a call without a task: the least loaded
    sb2.release(spec)
    assert sb2._refs == {}


def test_references_of_new_tasks_spread_over_slots(monkeypatch):
    """At a run's start every slot's load is 0: each new task's reference goes to the slot with the
    fewest tasks' references (started or starting), not all to the first."""
    import sandbox.evaluate as ev

    monkeypatch.setattr(ev, "_device_name", lambda device: "fake GPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    sb = Sandbox("cuda", EvalConfig(), arch="9.0a")
    started = []
    monkeypatch.setattr(sb, "_prepare", lambda spec, slot: started.append(slot))   # the slot chosen, nothing started
    monkeypatch.setattr(ev.threading, "Thread", lambda target, args, **kw: types.SimpleNamespace(
        start=lambda: target(*args)))
    specs = [read_spec(TASK, {"batch_size": 2 + i}, name=f"adversarial/task_{i}") for i in range(6)]   # six tasks
    sb._prepared_on["another task"] = 0           # one reference starting on slot 0 already
    for spec in specs:
        sb.prepare(spec)
    assert started == [1, 2, 0, 1, 2, 0], started
    # a candidate of a task whose reference is still starting goes where it starts
    assert sb._pick_slot(specs[1]) == 2 and sb._pick_slot(specs[1]) == 2


def test_release_stops_a_finished_tasks_reference_worker(sandbox):
    spec = read_spec(TASK, name="adversarial/task_small")
    assert sandbox.evaluate(spec, (ADV / "cpu" / "honest.py").read_text()).status is Status.correct
    ref = sandbox.reference(spec)
    proc = ref.proc.proc
    assert proc.poll() is None
    sandbox.release(spec)
    assert proc.wait(10) is not None and ref.proc is None
    assert sandbox.reference(spec) is not ref                   # a later evaluation starts afresh


# ---- which CUDA architecture builds target (no GPU needed to check the choice) ----------------
class _FakeCuda:
    def __init__(self, caps):
        self.caps = caps

    def is_available(self):
        return bool(self.caps)

    def device_count(self):
        return len(self.caps)

    def get_device_capability(self, i):
        return self.caps[i]


@pytest.mark.parametrize("caps, env, expected", [
    ([(9, 0)], {}, "9.0a"),                                                    # H100/H200: sm_90a
    ([(9, 0), (9, 0)], {}, "9.0a"),                                            # each arch once
    ([(9, 0), (8, 0)], {}, "8.0;9.0a"),
    ([(9, 0)], {"TORCH_CUDA_ARCH_LIST": "7.5;8.0;8.6;9.0;10.0;12.0+PTX"}, "9.0a"),  # a container's long list loses
    ([(9, 0)], {"KERNELLOOP_CUDA_ARCH": "8.0"}, "8.0"),                         # the explicit choice wins
    ([], {"TORCH_CUDA_ARCH_LIST": "9.0"}, "9.0"),                               # no GPU: torch's variable
    ([], {}, None),
])
def test_cuda_arch_choice(monkeypatch, caps, env, expected):
    import torch

    from sandbox.build import cuda_arch_list

    for name in ("KERNELLOOP_CUDA_ARCH", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    fake = _FakeCuda(caps)
    for attr in ("is_available", "device_count", "get_device_capability"):
        monkeypatch.setattr(torch.cuda, attr, getattr(fake, attr))
    assert cuda_arch_list() == expected


def test_cuda_sandbox_without_gpu_or_arch_refuses_and_hands_its_arch_to_workers(monkeypatch):
    import torch

    from sandbox.evaluate import Sandbox

    for name in ("KERNELLOOP_CUDA_ARCH", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"--arch 9\.0a"):
        Sandbox("cuda")
    sandbox = Sandbox("cuda", arch="9.0a")
    assert sandbox.arch == "9.0a" and sandbox.device_name == "no GPU visible"
    # build workers run with the GPU hidden: the choice travels in their environment
    assert sandbox._build_env()["KERNELLOOP_CUDA_ARCH"] == "9.0a"
    assert "KERNELLOOP_CUDA_ARCH" not in Sandbox("cpu")._build_env()


def test_header_tries_go_from_minimal_headers_to_the_candidates_own():
    from sandbox.header_tries import MINIMAL_NOTE, MINIMAL_TORCH_PRELUDE, TYPES_NOTE, header_tries, next_try

    src = '#include <torch/extension.h>\n#include <ATen/cuda/CUDAContext.h>\n__global__ void k() {}\n'
    tries = header_tries([src], no_implicit_headers=False)
    assert [t.note for t in tries] == [MINIMAL_NOTE, TYPES_NOTE, ""]
    minimal, types, own = tries
    assert MINIMAL_TORCH_PRELUDE in minimal.cuda and minimal.no_implicit_headers      # no torch/types.h added
    assert minimal.cpp_prefix == ("#include <torch/extension.h>",)    # ... but the C++ side keeps its header
    assert header_tries([src], no_implicit_headers=True)[0].cpp_prefix == ()      # the candidate includes its own
    assert not any("torch/extension.h" in s for s in minimal.cuda) and "<ATen/cuda/CUDAContext.h>" in minimal.cuda[-1]
    assert types.cuda == [src.replace("torch/extension.h", "torch/types.h")] and not types.no_implicit_headers
    assert own.cuda == [src] and not own.no_implicit_headers                       # exactly what the candidate wrote
    # torch used through the implicit torch/types.h only: no types.h step
    assert [t.note for t in header_tries(["torch::Tensor f(torch::Tensor x);"], False)] == [MINIMAL_NOTE, ""]
    # sources that bind to Python themselves are built as written
    assert [t.note for t in header_tries([src + "PYBIND11_MODULE(m, mod) {}\n"], False)] == [""]
    assert [t.note for t in header_tries([src + "py::object o;\n"], False)] == [""]
    # after the minimal headers fail: fuller headers only for a missing torch name
    assert next_try(tries, 0, 'x.cu(9): error: namespace "torch" has no member "matmul"') == 1
    assert next_try(tries, 0, 'x.cu(9): error: no operator "+" matches these operands') == 1   # tensor + tensor
    assert next_try(tries, 0, 'x.cu(9): error: name followed by "::" must be a class or namespace name') == 1
    assert next_try(tries, 0, 'x.cu(9): error: identifier "i" is undefined') == 2
    assert next_try(tries, 1, "anything") == 2 and next_try(tries, 2, "anything") is None


def test_cpu_workers_time_with_one_thread_each_unless_told(tmp_path, monkeypatch):
    """On ``cpu`` the reference and the candidate run with the same intra-op thread count: one by
    default (torch's one-per-core waited on every other process of a small host: a 0.12 ms forward
    timed at 5-24 ms medians and builtin candidates at 31x), or KERNELLOOP_CPU_THREADS. The
    reference scales its output by its own thread count and the candidate by the count it expects,
    answering wrong if its own differs: correct only where both workers had that count."""
    from sandbox.slots import cpu_timing_threads

    task = tmp_path / "task_threads.py"
    task.write_text(TASK.read_text().replace("return torch.relu(self.linear(x)) * self.scale",
                                             "return torch.relu(self.linear(x)) * self.scale * torch.get_num_threads()"))
    honest = (ADV / "cpu" / "honest.py").read_text()
    old = "        return ext.relu_scale(self.linear(x).contiguous(), self.scale)"
    assert old in honest and "torch.get_num_threads()" in task.read_text()
    cfg = EvalConfig(trials=2, timed_runs=3, warmup_runs=1, time_compile=False, run_timeout_s=60.0)
    spec = read_spec(task, name="threads/task")
    for expected in (1, 2):
        if expected == 1:
            monkeypatch.delenv("KERNELLOOP_CPU_THREADS", raising=False)
        else:
            monkeypatch.setenv("KERNELLOOP_CPU_THREADS", str(expected))
        assert cpu_timing_threads() == expected
        src = honest.replace(old, f"        y = ext.relu_scale(self.linear(x).contiguous(), self.scale) * {expected}\n"
                                  f"        return y if torch.get_num_threads() == {expected} else y + 1")
        with Sandbox("cpu", cfg, build_slots=1, warm_workers=0) as sb:
            r = sb.evaluate(spec, src)
        assert r.status is Status.correct, (expected, r.error_message, [t.reason for t in r.trials])


@pytest.mark.parametrize("raw", ["two", "0"])
def test_a_bad_cpu_thread_count_names_the_setting(monkeypatch, raw):
    from sandbox.slots import cpu_timing_threads

    monkeypatch.setenv("KERNELLOOP_CPU_THREADS", raw)
    with pytest.raises(ValueError, match="KERNELLOOP_CPU_THREADS"):
        cpu_timing_threads()


def test_own_kernels_replayed_from_a_graph_lift_only_the_no_call_flag():
    """No call into the extension during a forward, but the profile shows the candidate's own
    kernels: a CUDA graph it captured replays them, so the no-call flag goes (the reason is kept
    in stderr); any other flag stays."""
    from sandbox.backends import backend_for
    from sandbox.checks import CandidateChecks
    from sandbox.result import EvalConfig, EvalResult, Status

    checks = CandidateChecks(EvalConfig(), "cuda")
    no_call = backend_for(checks.config.backend, "cuda").no_call_reason
    result = EvalResult(task="t", device="cuda", status=Status.correct)
    result.add_flag(FlagKind.no_custom_kernel, no_call)
    result.add_flag(FlagKind.suspicious, "assigns to torch.allclose (monkey-patching)")
    checks._graph_replay(result, ["relu_scale_kernel(float const*, float*, float, long)"])
    assert not result.has_flag("no_custom_kernel") and result.has_flag("suspicious")
    assert "CUDA graph" in result.stderr and "relu_scale_kernel" in result.stderr
    # the profiler's own verdict (no declared kernel ran) is not lifted
    other = EvalResult(task="t", device="cuda", status=Status.correct)
    other.add_flag(FlagKind.no_custom_kernel, "the profiler shows no kernel declared in the candidate's source")
    checks._graph_replay(other, ["k"])
    assert other.has_flag("no_custom_kernel")
