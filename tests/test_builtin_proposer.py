"""The builtin proposer: planning, feedback from history, the backend, and generated sources.

Everything here runs without a compiler except ``test_seed_end_to_end_on_cpu`` (one
load_inline build) and the ``gpu`` test (skipped without a CUDA device).
"""
from __future__ import annotations

import ast
import copy
import re
import types
from pathlib import Path

import pytest
import torch

from agent.builtin import Knobs, generate, parse_header, propose
from agent.builtin.codegen import body_hash
from agent.builtin.feedback import read_history
from agent.types import AttemptView, DeviceFacts, ProposalRequest
from sandbox.result import BuildInfo, EvalResult, Status, Timing
from sandbox.tasks import TaskSpec, load_task, read_spec, with_device_sizes

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "builtin"
SEED_NAMES = ["gemm_sigmoid_gemm_logsumexp", "gemm_logsumexp_leakyrelu_gelu",
              "conv2d_bias_scale_sigmoid_groupnorm", "gemm_groupnorm_leakyrelu_sum", "conv2d_divide_leakyrelu"]
GN_TASK = ROOT / "tasks" / "seeds" / "conv2d_bias_scale_sigmoid_groupnorm.py"


def _task_files() -> list[Path]:
    files = []
    extra = [ROOT / "tasks" / "level1", ROOT / "tasks" / "level3"]
    for folder in sorted((ROOT / "tasks").glob("seeds*")) + [ROOT / "tasks" / "level2"] + extra:
        if folder.is_dir():
            files += sorted(f for f in folder.glob("*.py") if not f.name.startswith("_"))
    return files + [FIXTURES / "all_ops.py", FIXTURES / "residual_mix.py", FIXTURES / "untraceable.py"]


def _spec(path: Path) -> TaskSpec:
    try:
        return read_spec(path)
    except Exception:  # noqa: BLE001 - fixtures live outside tasks/
        return read_spec(path, name=f"fixtures/{path.stem}")


def _gn_spec() -> TaskSpec:
    if not GN_TASK.is_file():
        pytest.skip("tasks/seeds is not in this checkout")
    return read_spec(GN_TASK)


def _result(status: Status, ms: float | None = None, **kw) -> EvalResult:
    timing = Timing(median_ms=ms, iqr_ms=0.0, mean_ms=ms, min_ms=ms, max_ms=ms, runs=5,
                    clock="perf_counter") if ms is not None else None
    return EvalResult(status=status, task="t", device="cpu", candidate_time=timing, **kw)


def _attempt(i: int, source: str, result: EvalResult, rnd: int = 0) -> AttemptView:
    return AttemptView(attempt_id=i, round=rnd, sample=i, parse_status="ok", source=source, result=result)


def _stub_load_inline(monkeypatch):
    """Exec candidates without compiling: load_inline returns a stub extension."""
    import torch.utils.cpp_extension as ext

    def fake(name, cpp_sources, cuda_sources=None, functions=None, **kw):
        assert functions, "load_inline without functions"
        assert name.startswith("kl_builtin_")
        return types.SimpleNamespace(**{f: (lambda *a, **k: None) for f in functions})

    monkeypatch.setattr(ext, "load_inline", fake)


def _model_new_refs(source: str) -> set[str]:
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelNew")
    return {n.id for n in ast.walk(cls) if isinstance(n, ast.Name)}


def _calls_model(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name == "Model":
                return True
    return False


# --------------------------------------------------------------------------------------
# generated sources for the bundled tasks
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_generated_sources_compile_and_define_model_new(device, monkeypatch):
    files = _task_files()
    names = {f.stem for f in files}
    if (ROOT / "tasks" / "seeds").is_dir():
        assert set(SEED_NAMES) <= names
    _stub_load_inline(monkeypatch)
    for path in files:
        spec = _spec(path)
        cand = propose(spec, device, 0, 0, [])
        src = cand.source
        compile(src, str(path), "exec")
        assert re.search(r"^class ModelNew\b", src, re.MULTILINE), path
        assert parse_header(src) == cand.choices
        assert not _calls_model(src) and "Model(" not in src, f"{path}: the candidate instantiates Model"
        assert "Model" not in _model_new_refs(src)
        if cand.choices.get("groups"):
            assert "load_inline" in src and ("cuda_sources" in src) == (device == "cuda")
        # constructing ModelNew draws the same parameters as the reference (no build: stubbed)
        ns: dict = {"__name__": "kl_candidate"}
        exec(compile(src, str(path), "exec"), ns)
        task = load_task(with_device_sizes(spec, "cpu"))
        init = task.get_init_inputs()
        torch.manual_seed(7)
        ref = task.Model(*init)
        torch.manual_seed(7)
        new = ns["ModelNew"](*init)
        a, b = ref.state_dict(), new.state_dict()
        assert list(a) == list(b), path
        assert all(torch.equal(a[k], b[k]) for k in a), f"{path}: parameters differ"
        assert not hasattr(ns["_Layers"], "forward") or ns["_Layers"].forward is torch.nn.Module.forward
        if cand.choices.get("tc3"):
            assert "load_inline" in src and device == "cuda"
        if not cand.choices.get("groups") and not cand.choices.get("tc3"):
            # no kernel to build: the candidate runs as it is, and must match the reference
            torch.manual_seed(3)
            inputs = task.get_inputs()
            with torch.no_grad():
                torch.testing.assert_close(new(*inputs), ref(*inputs))


def test_seed_groups_fuse_the_chains_between_library_ops():
    if not (ROOT / "tasks" / "seeds").is_dir():
        pytest.skip("tasks/seeds is not in this checkout")
    expect = {
        "gemm_sigmoid_gemm_logsumexp": [["sigmoid"], ["logsumexp"]],
        "gemm_logsumexp_leakyrelu_gelu": [["logsumexp", "leaky_relu", "leaky_relu", "gelu", "gelu"]],
        # the convolution's own bias is the first add (see test_conv_bias_joins_the_next_kernel)
        "conv2d_bias_scale_sigmoid_groupnorm": [["add", "add", "mul", "sigmoid", "group_norm"]],
        "gemm_groupnorm_leakyrelu_sum": [["group_norm", "leaky_relu", "add"]],
        "conv2d_divide_leakyrelu": [["add", "div", "leaky_relu"]],
    }
    for name, groups in expect.items():
        cand = propose(read_spec(ROOT / "tasks" / "seeds" / f"{name}.py"), "cuda", 0, 0, [])
        assert [g["ops"] for g in cand.choices["groups"]] == groups, name
        assert cand.uncovered_ops == []
        src = cand.source
        # library operators stay on PyTorch (the reference's modules, or the convolution without its
        # bias), or a large GEMM runs as split-TF32 GEMMs on the module's own parameters
        # (a convolution in channels-last reads its input's channels-last copy, layout.py)
        assert re.search(r"self\.(linear1|linear|fc)\(|torch\.conv2d\((x|v_to_channels_last), v_conv_weight, None,|"
                         r"_ext\.kl_tc_linear\(x, self\.(linear1|linear|fc)\.weight, self\.\w+\.bias, (True|False)\)", src)
        # CUDA: kernels without torch headers, wrappers on the current stream, float4 path
        cuda = src[src.index('_CUDA_SOURCE = r"""'):]
        assert "#include <torch" not in cuda and "__global__" in cuda
        # float4 loads, but in the column kernels of a norm of the channels-last view (norm_nhwc.py)
        assert "float4" in cuda or "_cols<int><<<" in cuda, name
        assert "getCurrentCUDAStream" in src and "__shfl_xor_sync" in src


def test_fusion_modes_move_group_boundaries():
    spec = _gn_spec()
    # on cuda, where the conv bias joins the next kernel (on the CPU it stays in the convolution)
    plans = {m: [g["ops"] for g in generate(spec, "cuda", Knobs(fusion=m)).choices["groups"]]
             for m in ("max", "no_prologue", "split", "elementwise")}
    assert plans["max"] == [["add", "add", "mul", "sigmoid", "group_norm"]]
    assert plans["no_prologue"] == [["add", "add", "mul", "sigmoid"], ["group_norm"]]
    assert plans["split"] == [["add", "add", "mul", "sigmoid"], ["group_norm"]]
    assert plans["elementwise"] == [["add", "add", "mul", "sigmoid"]]       # the norm stays on PyTorch
    src = generate(spec, "cpu", Knobs(fusion="elementwise")).source
    assert "kept on PyTorch in this variant (elementwise fusion)" in src
    gemm = read_spec(ROOT / "tasks" / "seeds" / "gemm_groupnorm_leakyrelu_sum.py")
    assert [g["ops"] for g in generate(gemm, "cpu", Knobs(fusion="split")).choices["groups"]] == \
        [["group_norm"], ["leaky_relu", "add"]]


def test_corner_cases_residual_inplace_identity_view():
    cand = propose(_spec(FIXTURES / "residual_mix.py"), "cpu", 0, 0, [])
    ops = [g["ops"] for g in cand.choices["groups"]]
    # b = sigmoid(a) is returned, so a's group ends there; the in-place ReLU after an identity is fused
    assert ["mul", "relu"] in ops
    assert ["mean"] in ops and ["sub"] in ops
    assert "v_act.view(" in cand.source      # views stay on PyTorch


CONV_POOL = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.convt = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.last = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        x = self.pool(self.conv(x))          # its user is a library op (ceil_mode: pool.py's exception): the bias stays inside
        x = torch.tanh(self.convt(x))       # transposed: the bias joins the tanh kernel
        return self.last(x)                 # returned as it is: nothing to fuse


def get_inputs():
    return [torch.randn(2, 3, 13, 11)]


def get_init_inputs():
    return []
"""


def test_conv_bias_joins_the_next_kernel(tmp_path):
    """PyTorch adds a convolution's bias in a kernel of its own; where the convolution feeds a
    generated kernel, the builtin calls it without the bias and adds the bias in that kernel
    (on cuda; on the CPU oneDNN adds the bias inside the convolution, so it stays there)."""
    gn = propose(_gn_spec(), "cuda", 0, 0, [])      # (channels-last: the input's copy is the convolution's)
    assert re.search(r"torch\.conv2d\((x|v_to_channels_last), v_conv_weight, None, \(1, 1\), \(0, 0\), \(1, 1\), 1\)",
                     gn.source)
    assert "v_conv_bias.view(-1, 1, 1)" in gn.source and "self.conv(" not in gn.source
    on_cpu = propose(_gn_spec(), "cpu", 0, 0, [])
    assert "self.conv(x)" in on_cpu.source and "v_conv_bias" not in on_cpu.source
    assert [g["ops"] for g in on_cpu.choices["groups"]] == [["add", "mul", "sigmoid", "group_norm"]]
    path = tmp_path / "conv_pool.py"
    path.write_text(CONV_POOL)
    spec = read_spec(path, name="fixtures/conv_pool")
    cand = propose(spec, "cuda", 0, 0, [])
    src = cand.source
    assert [g["ops"] for g in cand.choices["groups"]] == [["add", "tanh"]]
    assert "self.conv(" in src and "self.last(" in src and "self.convt(" not in src
    assert "torch.conv_transpose2d(" in src and "v_convt_bias.view(-1, 1, 1)" in src
    # the split graph computes what the reference computes (the kernels stubbed by PyTorch here)
    from agent.builtin.trace import trace_task
    traced = trace_task(spec, "cuda")
    task = load_task(spec)
    torch.manual_seed(0)
    ref = task.Model()
    gm = copy.deepcopy(traced.gm)            # the trace is cached, and built on the meta device
    gm.load_state_dict(ref.state_dict(), assign=True)
    x = torch.randn(2, 3, 13, 11)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), ref(x))


# --------------------------------------------------------------------------------------
# rounds, history and feedback
# --------------------------------------------------------------------------------------
def test_distinct_candidates_within_a_round():
    spec = _gn_spec()
    cands = [propose(spec, "cuda", 0, s, []) for s in range(4)]
    assert len({body_hash(c.source) for c in cands}) == 4
    assert len({tuple(sorted(c.choices["knobs"].items())) for c in cands}) == 4
    # no GEMM, attention or recurrent layer here: those knobs are normalised to their defaults;
    # a conv feeding a norm stays NCHW (layout.py), so the layout knob is normalised too; the direct
    # convolution is off on cuda by default (conv.direct_on): conv and conv_tile are their defaults
    assert cands[0].choices["knobs"] == {"fusion": "max", "vec": True, "block": 256, "reduce": "onepass",
                                         "matmul": "tc3", "layout": "nhwc", "attention": "fused",
                                         "recurrent": "fused", "conv": "library", "conv_tile": "c8x8",
                                         "graph": "off"}


def test_variants_without_any_kernel_are_not_proposed_while_others_remain():
    path = ROOT / "tasks" / "level1" / "batchnorm.py"
    if not path.is_file():
        pytest.skip("tasks/level1 is not in this checkout")
    spec = read_spec(path)
    # the elementwise-only variant would leave the lone BatchNorm to PyTorch: no kernel at all
    assert generate(spec, "cuda", Knobs(fusion="elementwise")).choices["groups"] == []
    cands = [propose(spec, "cuda", 0, s, []) for s in range(6)]
    assert all(c.choices["groups"] for c in cands)
    assert len({body_hash(c.source) for c in cands}) == 6


def test_never_repeats_a_source_from_history():
    spec = _gn_spec()
    history = [_attempt(i, propose(spec, "cpu", 0, i, []).source, _result(Status.correct, 2.0 + i))
               for i in range(4)]
    seen = {body_hash(a.source) for a in history}
    nxt = [propose(spec, "cpu", 1, s, history) for s in range(4)]
    hashes = [body_hash(c.source) for c in nxt]
    assert not (set(hashes) & seen)
    assert len(set(hashes)) == 4
    # a foreign (model-written) attempt in the history is ignored except for de-duplication
    foreign = _attempt(99, "class ModelNew:\n    pass\n", _result(Status.incorrect))
    assert body_hash(propose(spec, "cpu", 1, 0, history + [foreign]).source) == hashes[0]


def test_exploration_continues_around_the_fastest_correct():
    spec = _gn_spec()
    srcs = [propose(spec, "cuda", 0, s, []).source for s in range(3)]
    times = [3.0, 1.0, 2.0]       # sample 1 is the fastest
    history = [_attempt(i, s, _result(Status.correct, t)) for i, (s, t) in enumerate(zip(srcs, times))]
    best = parse_header(srcs[1])["knobs"]
    fb = read_history(history, "cuda")
    assert fb.best["knobs"] == best and fb.best_ms == 1.0
    for s in range(3):
        k = propose(spec, "cuda", 1, s, history).choices["knobs"]
        assert sum(k[n] != best[n] for n in k) == 1, (k, best)


def _rewritten_graph_computes_the_reference(spec) -> None:
    """The task's graph as traced for cuda (its rewrites applied), run on the CPU with the reference's
    weights, against the reference."""
    from agent.builtin.trace import trace_task

    traced = trace_task(spec, "cuda")
    torch.manual_seed(0)
    ref = load_task(spec).Model()
    gm = copy.deepcopy(traced.gm)
    gm.load_state_dict(ref.state_dict(), assign=True)
    x = torch.randn(2, 3, 10, 9)
    with torch.no_grad():
        for got, want in zip(gm(x), ref(x)):
            torch.testing.assert_close(got, want)


CONV_USERS = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3)
        self.b = nn.Conv2d(3, 8, 3)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))

    def forward(self, x):
        y = self.a(x)
        y = torch.tanh(F.softplus(y)) * y                  # level2/52: two elementwise users
        z = self.b(x)
        s = z.sum(dim=1, keepdim=True) + z.amax(dim=1, keepdim=True)   # two reductions
        g = F.adaptive_avg_pool2d(F.gelu(y), 1)            # level2/67: a global average pool
        w = F.adaptive_avg_pool2d(s, (2, 2))                # not global: stays the library's
        return g.flatten(1), self.pool(torch.relu(z)).flatten(1), w


def get_inputs():
    return [torch.randn(2, 3, 10, 9)]


def get_init_inputs():
    return []
"""


def test_conv_bias_and_global_pools_become_parts_of_the_generated_kernels(tmp_path):
    """On cuda a convolution whose users are all elementwise gives its bias to their one kernel (two
    users here, level2/52's pattern); before reductions the bias stays cuDNN's (the add would be a
    kernel of its own). A global average pool (function or module) is traced as the mean ATen
    computes, fused after the operators before it; a pool to 2 x 2 stays the library's. The rewritten
    graph computes the reference."""
    path = tmp_path / "conv_users.py"
    path.write_text(CONV_USERS)
    spec = read_spec(path, name="fixtures/conv_users")
    cand = generate(spec, "cuda", Knobs(layout="nchw"))
    ops = [g["ops"] for g in cand.choices["groups"]]
    # the bias's add, both users and the pool's mean: one kernel; the module pool after the ReLU too
    assert ["add", "softplus", "tanh", "mul", "gelu", "mean"] in ops and ["relu", "mean"] in ops, ops
    src = cand.source
    assert "torch.conv2d(x, v_a_weight, None," in src and "self.b(x)" in src
    assert "adaptive_avg_pool2d(" in src and "self.pool(" not in src
    _rewritten_graph_computes_the_reference(spec)


CONV_NORM_RESIDUAL = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3)
        self.b = nn.Conv2d(3, 8, 3)
        self.norm = nn.GroupNorm(4, 8)

    def forward(self, x):
        y = self.a(x)
        r = y + torch.tanh(self.norm(y))                    # level2/92: the norm and the residual read y
        z = self.b(x)
        s = self.norm(z).sum(dim=1, keepdim=True) + z.amax(dim=1, keepdim=True)   # a norm and a reduction
        return torch.logsumexp(r, dim=1), s


def get_inputs():
    return [torch.randn(2, 3, 10, 9)]


def get_init_inputs():
    return []
"""


def test_a_convolution_read_by_a_norm_and_its_residual_gives_its_bias_to_the_norms_kernel(tmp_path):
    """level2/92 (session af, H100): the convolution's output feeds a group norm and, after it, a
    residual add; its bias stayed cuDNN's, PyTorch's add a pass of its own (448 us of 1,988). Now the
    bias is the norm's prologue and the residual reads that value in the same kernel; where a norm and a
    reduction both read the output, the bias stays the library's. The rewritten graph computes the
    reference."""
    path = tmp_path / "conv_norm_residual.py"
    path.write_text(CONV_NORM_RESIDUAL)
    spec = read_spec(path, name="fixtures/conv_norm_residual")
    cand = generate(spec, "cuda", Knobs(layout="nchw"))
    ops = [g["ops"] for g in cand.choices["groups"]]
    assert ["add", "group_norm", "tanh", "add"] in ops, ops
    assert "torch.conv2d(x, v_a_weight, None," in cand.source and "self.b(x)" in cand.source
    _rewritten_graph_computes_the_reference(spec)


def test_incorrect_group_is_narrowed_then_left_to_pytorch():
    spec = _gn_spec()       # on the CPU the conv keeps its bias: the first add is the task's own
    first = propose(spec, "cpu", 0, 0, [])
    assert [g["ops"] for g in first.choices["groups"]] == [["add", "mul", "sigmoid", "group_norm"]]
    h1 = [_attempt(1, first.source, _result(Status.incorrect))]
    second = propose(spec, "cpu", 1, 0, h1)
    # (the next variant may compute the convolution itself: conv=direct, the first group's core)
    groups2 = [[op for op in g["ops"] if op != "conv2d"] for g in second.choices["groups"]]
    assert groups2 == [["add", "mul", "sigmoid"], ["group_norm"]], groups2
    assert second.choices["knobs"] != first.choices["knobs"]      # the failing knob setting is not reused
    # the lone group_norm kernel now fails at run time, naming itself: it is left to PyTorch
    err = _result(Status.runtime_error, error_message="RuntimeError: kl_g1 (group_norm): illegal memory access")
    h2 = h1 + [_attempt(2, second.source, err, rnd=1)]
    third = propose(spec, "cpu", 2, 0, h2)
    assert [[op for op in g["ops"] if op != "conv2d"] for g in third.choices["groups"]] == [["add", "mul", "sigmoid"]]
    assert "group_norm" in third.uncovered_ops
    assert "left to PyTorch after an earlier failure" in third.source
    assert re.search(r"= self\.group_norm\(v_", third.source)
    assert "group_norm" in third.choices["excluded"]
    assert not _calls_model(third.source)


def test_compile_error_blames_only_the_named_group():
    spec = read_spec(ROOT / "tasks" / "seeds" / "gemm_sigmoid_gemm_logsumexp.py") \
        if (ROOT / "tasks" / "seeds").is_dir() else pytest.skip("no seeds")
    first = propose(spec, "cuda", 0, 0, [])
    assert [g["name"] for g in first.choices["groups"]] == ["kl_g0", "kl_g1"]
    res = _result(Status.compile_error,
                  build=BuildInfo(ok=False, first_error="cuda.cu(210): error: identifier 'kl_g1_row' is undefined"))
    fb = read_history([_attempt(1, first.source, res)], "cuda")
    assert fb.excluded == {"logsumexp"} and fb.cuts == set()
    nxt = propose(spec, "cuda", 1, 0, [_attempt(1, first.source, res)])
    assert [g["ops"] for g in nxt.choices["groups"]] == [["sigmoid"]]


def test_failure_of_proven_groups_blames_the_knobs():
    spec = _gn_spec()
    a = propose(spec, "cuda", 0, 0, [])             # vec on, onepass
    b = propose(spec, "cuda", 0, 1, [])             # vec off, twopass; same groups
    assert [g["nodes"] for g in a.choices["groups"]] == [g["nodes"] for g in b.choices["groups"]]
    history = [_attempt(1, b.source, _result(Status.correct, 1.0)), _attempt(2, a.source, _result(Status.incorrect))]
    fb = read_history(history, "cuda")
    assert fb.cuts == set() and fb.excluded == set()
    assert ("vec", True) in fb.bad_knobs and ("reduce", "onepass") in fb.bad_knobs
    for s in range(3):
        k = propose(spec, "cuda", 1, s, history).choices["knobs"]
        assert k["vec"] is False or k["reduce"] != "onepass"


def test_histories_of_other_devices_are_not_blamed():
    spec = _gn_spec()
    cpu = propose(spec, "cpu", 0, 0, [])
    fb = read_history([_attempt(1, cpu.source, _result(Status.incorrect))], "cuda")
    assert not fb.cuts and not fb.excluded


# --------------------------------------------------------------------------------------
# what stays on PyTorch
# --------------------------------------------------------------------------------------
def test_nothing_fusible_still_answers_a_valid_candidate(monkeypatch):
    path = ROOT / "tasks" / "level1" / "matmul_square.py"
    if not path.is_file():
        pytest.skip("tasks/level1 is not in this checkout")
    # on cpu (and on cuda with the GEMM left to PyTorch's float32 call) there is no code of its own
    for cand in (propose(read_spec(path), "cpu", 0, 0, []), generate(read_spec(path), "cuda", Knobs(matmul="ieee"))):
        assert cand.choices["groups"] == [] and cand.choices["tc3"] == []
        assert "load_inline(" not in cand.source
        assert "No operator of this model could be fused" in cand.source
        ns: dict = {"__name__": "kl_candidate"}
        exec(compile(cand.source, "c.py", "exec"), ns)
        assert "ModelNew" in ns
    # on cuda the 4096^3 GEMM runs as split-TF32 GEMMs: a candidate with an extension of its own
    cand = propose(read_spec(path), "cuda", 0, 0, [])
    assert cand.choices["groups"] == [] and cand.choices["tc3"] == ["matmul"]
    assert "load_inline(" in cand.source and "functions=['kl_tc_matmul']" in cand.source


def test_unknown_operator_stays_on_pytorch_with_a_comment():
    path = ROOT / "tasks" / "level1" / "cumsum.py"
    if not path.is_file():
        pytest.skip("tasks/level1 is not in this checkout")
    cand = propose(read_spec(path), "cpu", 0, 0, [])
    assert "cumsum" in cand.uncovered_ops
    assert re.search(r"# not covered by builtin: cumsum .*stays on PyTorch", cand.source)
    assert ".cumsum(" in cand.source or "torch.cumsum(" in cand.source


def test_untraceable_model_gets_its_forward_on_pytorch():
    cand = propose(_spec(FIXTURES / "untraceable.py"), "cpu", 0, 0, [])
    assert cand.choices["fallback"] == "untraceable"
    assert not _calls_model(cand.source)
    ns: dict = {"__name__": "kl_candidate"}
    exec(compile(cand.source, "c.py", "exec"), ns)
    task = load_task(_spec(FIXTURES / "untraceable.py"))
    torch.manual_seed(0)
    ref = task.Model(*task.get_init_inputs())
    torch.manual_seed(0)
    new = ns["ModelNew"](*task.get_init_inputs())
    x = torch.randn(5, 17)
    assert torch.equal(ref(x), new(x))


# --------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------
def test_backend_answers_like_a_model():
    from agent.backends.base import get_backend
    from agent.parse import parse_answer

    backend = get_backend("builtin")
    assert backend.name == "builtin" and backend.default_critic == "grounded" and backend.max_concurrency == 4
    spec = _gn_spec()
    req = ProposalRequest(task=spec, device=DeviceFacts(device="cuda", name="test", torch_version=torch.__version__),
                          round=0, samples=2, messages=[], template="builtin", prompt_sha256="0")
    c0, c1 = backend.complete(req, 0), backend.complete(req, 1)
    for c in (c0, c1):
        assert c.model == "builtin" and c.error is None
        assert c.prompt_tokens is None and c.completion_tokens is None and c.latency_s > 0
        first_line = c.text.split("\n", 1)[0]
        assert first_line.endswith(".") and "```" not in first_line
        parsed = parse_answer(c.text, c.finish_reason)
        assert parsed.ok, parsed.error
        assert parse_header(parsed.source)["device"] == "cuda"
    assert body_hash(parse_answer(c0.text).source) != body_hash(parse_answer(c1.text).source)


# --------------------------------------------------------------------------------------
# builds
# --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_seed_end_to_end_on_cpu():
    """One real build: the group-norm seed's proposal, checked against the reference at CPU sizes."""
    spec = _gn_spec()
    cand = propose(spec, "cpu", 0, 0, [])
    ns: dict = {"__name__": "kl_candidate"}
    exec(compile(cand.source, "c.py", "exec"), ns)
    task = load_task(with_device_sizes(spec, "cpu"))
    init = task.get_init_inputs()
    torch.manual_seed(11)
    ref = task.Model(*init)
    torch.manual_seed(11)
    new = ns["ModelNew"](*init)
    for seed in (1, 2):
        torch.manual_seed(seed)
        inputs = task.get_inputs()
        with torch.no_grad():
            r, n = ref(*inputs), new(*inputs)
        assert r.shape == n.shape
        torch.testing.assert_close(n, r, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", SEED_NAMES)
def test_seeds_build_and_match_on_cuda(name):
    from agent.builtin.selfcheck import check_source

    path = ROOT / "tasks" / "seeds" / f"{name}.py"
    if not path.is_file():
        pytest.skip("tasks/seeds is not in this checkout")
    for sample in (0, 1):
        cand = propose(read_spec(path), "cuda", 0, sample, [])
        report = check_source(str(path), "cuda", cand.source)
        assert report["ok"], report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batchnorm_over_columns_matches_on_cuda(tmp_path):
    """BatchNorm of a (N, C) input runs the column kernel (rows are adjacent columns of single
    elements): both reduction variants, and odd sizes with a partial 32-column tile."""
    from agent.builtin.selfcheck import check_source

    text = (ROOT / "tasks" / "level2" / "gemm_batchnorm_gelu.py").read_text()
    for name, value in (("batch_size", 1000), ("in_features", 96), ("out_features", 75)):
        text, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", text, flags=re.M)
        assert n == 1, name
    path = tmp_path / "gemm_batchnorm_gelu_odd.py"
    path.write_text(text)
    spec = read_spec(path, name="fixtures/gemm_batchnorm_gelu_odd")
    for sample in (0, 1):                    # onepass and twopass statistics
        cand = propose(spec, "cuda", 0, sample, [])
        assert "_cols<int><<<" in cand.source
        report = check_source(str(path), "cuda", cand.source)
        assert report["ok"], report


def test_an_unrolled_loop_of_lone_small_elementwise_ops_stays_on_pytorch():
    """level3/34_VanillaRNNHidden on an H200: 256 lone tanh kernels (one per unrolled step, 8x256
    each) made the candidate 0.82x eager; such a kernel fuses nothing and only adds host glue.
    From LONE_MIN_CALLS of them on, they stay on PyTorch (where the loop is not one recurrent
    layer: its ``recurrent=library`` variant here, unrolled_rnn.py otherwise); a short loop keeps
    its kernels."""
    from agent.builtin import LONE_MIN_CALLS, generate
    from agent.builtin.codegen import Knobs
    from agent.builtin.unrolled_rnn import MIN_STEPS

    assert MIN_STEPS == LONE_MIN_CALLS
    path = Path(__file__).parent / "fixtures" / "builtin" / "rnn_loop.py"
    for device in ("cuda", "cpu"):
        many = generate(read_spec(path, {"sequence_length": 20}, name="fixtures/rnn_loop"), device,
                        Knobs(recurrent="library"))
        assert many.choices["groups"] == [] and "_ext." not in many.source
        assert {f"tanh_{i}" for i in range(1, 20)} <= set(many.choices["excluded"])
        few = generate(read_spec(path, {"sequence_length": LONE_MIN_CALLS - 1}, name="fixtures/rnn_loop"), device)
        assert [g["ops"] for g in few.choices["groups"]][:1] == [["tanh"]]
