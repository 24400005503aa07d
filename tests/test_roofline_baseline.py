"""Roofline counts and floors, device probes and their caches, reference baselines."""
from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
import typer
from typer.testing import CliRunner

from evals.device_cli import app as device_app
from hardware import probe as probe_mod
from evals.baseline import baseline_command, input_factory, measure_baseline, store_baseline
from hardware.probe import Probe
from hardware.floors import CEILING_SLACK as SLACK
from hardware.floors import floor_breakdown, floor_ms
from sandbox.tasks import count_task
from store.probes import get_probe, load_cached
from kernelloop.paths import tasks_dir
from sandbox.harness import make_inputs
from sandbox.numerics import Numerics
from sandbox.tasks import TaskSpec, load_task, read_spec, with_device_sizes
from store.models import Baseline, DeviceProbe, Task

TASKS = tasks_dir()
runner = CliRunner()


def _tf32(probe) -> set[str]:
    """What PyTorch's default math mode runs in TF32 on the probe's device."""
    return Numerics().tf32_classes(probe.device)


def _task_file(tmp_path: Path, name: str, body: str) -> TaskSpec:
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return read_spec(path)


def _probe(bw=1000.0, **tflops) -> Probe:
    return Probe(device="cuda", device_name="test gpu", torch_version=torch.__version__,
                 bandwidth_gbps=bw, tflops=tflops or {"fp32": 10.0})


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("KERNELLOOP_CACHE", str(path))
    return path


LINEAR_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.fc = nn.Linear(i, o)

    def forward(self, x):
        return torch.relu(self.fc(x))


B = 64
I = 48
O = 32


def get_inputs():
    return [torch.randn(B, I)]


def get_init_inputs():
    return [I, O]
"""


# --------------------------------------------------------------------------- counting

def test_linear_counts_are_exact(tmp_path):
    spec = _task_file(tmp_path, "linear", LINEAR_TASK)
    c = count_task(spec, "cuda")
    B, I, O = 64, 48, 32
    assert c.flops == 2 * B * I * O
    assert c.flops_by_dtype == {"fp32": 2 * B * I * O}
    assert c.bytes_by_kind == {"inputs": 4 * B * I, "parameters": 4 * (O * I + O), "buffers": 0, "outputs": 4 * B * O}
    assert c.min_bytes == sum(c.bytes_by_kind.values())
    assert c.input_shapes == [[B, I]] and c.output_shapes == [[B, O]]
    assert c.dtype == "fp32" and c.method == "meta"


def test_counting_leaves_the_rng_alone(tmp_path):
    spec = _task_file(tmp_path, "linear", LINEAR_TASK)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    count_task(spec, "cuda")
    assert torch.equal(torch.rand(4), expected)


def test_conv_flops_and_buffers_follow_the_sizes():
    spec = read_spec(TASKS / "level2" / "conv_batchnorm_relu.py")
    c = count_task(spec, "cpu")           # CPU_SIZES: N=2, Cin=8, Cout=16, 24x24, k=3, padding 1
    assert c.flops == 2 * 2 * 16 * 8 * 9 * 24 * 24
    # BatchNorm2d buffers: running mean and var (fp32) and num_batches_tracked (int64).
    assert c.bytes_by_kind["buffers"] == 16 * 4 * 2 + 8
    assert c.output_shapes == [[2, 16, 24, 24]]
    gpu = count_task(spec, "cuda")
    assert gpu.flops == 2 * 128 * 128 * 64 * 9 * 128 * 128


def test_huge_sizes_are_counted_without_allocating():
    # 3 x 200000^2 fp32 matrices = 480 GB: only meta tensors make this possible.
    spec = read_spec(TASKS / "level1" / "matmul_square.py", {"N": 200_000})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    c = count_task(spec, "cuda")
    assert time.perf_counter() - t0 < 30
    assert c.flops == 2 * 200_000 ** 3
    assert c.min_bytes == 3 * 200_000 ** 2 * 4
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 1 << 20    # less than 1 GiB more resident memory


def test_flops_are_split_by_dtype_and_each_gets_its_rate(tmp_path):
    spec = _task_file(tmp_path, "mixed", """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.half_fc = nn.Linear(64, 64, bias=False).half()
        self.fc = nn.Linear(64, 16, bias=False)

    def forward(self, x):
        return self.fc(self.half_fc(x.half()).float())


def get_inputs():
    return [torch.randn(128, 64)]


def get_init_inputs():
    return []
""")
    c = count_task(spec, "cuda")
    assert c.flops_by_dtype == {"fp16": 2 * 128 * 64 * 64, "fp32": 2 * 128 * 64 * 16}
    assert c.dtype == "fp16"
    assert c.bytes_by_dtype["fp16"] == 64 * 64 * 2
    p = _probe(bw=1e6, fp32=1.0, fp16=8.0)
    fb = floor_breakdown(c, p, _tf32(p))
    # fp16 at its rate; the fp32 GEMM as three passes of fp16-rate tensor-core arithmetic (8/3 > 1)
    expected = (2 * 128 * 64 * 64 / 8e12 + 3 * 2 * 128 * 64 * 16 / 8e12) * 1e3 / SLACK
    assert fb["compute_ms"] == pytest.approx(expected)
    assert fb["floor_ms"] == fb["compute_ms"] > fb["memory_ms"]


def test_model_that_fails_on_meta_is_counted_with_fake_tensors(tmp_path):
    spec = _task_file(tmp_path, "to_cpu", """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a.cpu(), b.cpu())


def get_inputs():
    return [torch.randn(32, 16), torch.randn(16, 8)]


def get_init_inputs():
    return []
""")
    c = count_task(spec, "cuda")
    assert c.method == "fake"
    assert c.flops == 2 * 32 * 16 * 8
    assert c.min_bytes == 4 * (32 * 16 + 16 * 8 + 32 * 8)


# --------------------------------------------------------------------------- floors

def test_floor_is_the_slower_of_memory_and_compute(tmp_path):
    spec = _task_file(tmp_path, "linear", LINEAR_TASK)
    c = count_task(spec, "cuda")
    memory_bound = _probe(bw=1.0, fp32=1000.0)       # 1 GB/s
    assert floor_ms(c, memory_bound, _tf32(memory_bound)) == pytest.approx(c.min_bytes / 1e9 * 1e3 / SLACK)
    compute_bound = _probe(bw=1e9, fp32=1e-6)        # 1 MFLOP/s
    assert floor_ms(c, compute_bound, _tf32(compute_bound)) == pytest.approx(c.flops / 1e6 * 1e3 / SLACK)


def test_the_floor_charges_the_arithmetic_a_candidate_is_allowed():
    """One TF32 pass for the op classes the math mode runs in TF32; other fp32 FLOPs as 3xTF32
    at the fastest 10-bit-mantissa tensor-core rate (TF32 or fp16) when that beats fp32; ceilings
    raised by their slack; the assumptions named."""
    conv = count_task(read_spec(TASKS / "level1" / "conv2d.py"), "cuda")
    mm = count_task(read_spec(TASKS / "level1" / "matmul_square.py"), "cuda")
    assert conv.tf32_eligible == {"conv": conv.flops}
    assert mm.tf32_eligible == {"matmul": mm.flops}
    p = _probe(bw=1e9, fp32=50.0, tf32=400.0)
    one_pass = floor_breakdown(conv, p, tf32={"conv"})
    assert one_pass["compute_ms"] == pytest.approx(conv.flops / 400e12 * 1e3 / SLACK)
    assert "one TF32 pass" in one_pass["arithmetic"]
    # convolutions: one pass under any math mode (FFT and Winograd do a fraction of the direct FLOPs)
    assert floor_breakdown(conv, p, tf32=set())["compute_ms"] == pytest.approx(conv.flops / 400e12 * 1e3 / SLACK)
    split = floor_breakdown(mm, p, tf32=set())
    assert "3xTF32" in split["arithmetic"]
    assert floor_breakdown(mm, p, tf32={"conv"})["compute_ms"] == pytest.approx(3 * mm.flops / 400e12 * 1e3 / SLACK)
    # fp16 operands carry TF32's mantissa: a faster fp16 rate is the one no kernel beats
    fast16 = _probe(bw=1e9, fp32=50.0, tf32=400.0, fp16=800.0)
    assert floor_ms(conv, fast16, {"conv"}) == pytest.approx(conv.flops / 800e12 * 1e3 / SLACK)
    # where three tensor-core passes are slower than plain fp32, fp32 it is
    slow_tc = _probe(bw=1e9, fp32=50.0, tf32=100.0)
    assert floor_ms(mm, slow_tc, set()) == pytest.approx(mm.flops / 50e12 * 1e3 / SLACK)
    # A cpu probe never uses a tensor-core rate.
    cpu = Probe(device="cpu", device_name="c", torch_version="t", bandwidth_gbps=1e9, tflops={"fp32": 1.0, "tf32": 8.0})
    assert floor_ms(conv, cpu, _tf32(cpu)) == pytest.approx(conv.flops / 1e12 * 1e3 / SLACK)


def test_missing_dtype_rate_falls_back_to_the_fastest(tmp_path):
    spec = _task_file(tmp_path, "linear", LINEAR_TASK)
    c = count_task(spec, "cuda")
    p = _probe(bw=1e9, fp16=2e-6, bf16=4e-6)         # no fp32 rate: the fastest (bf16) is used
    assert floor_ms(c, p, _tf32(p)) == pytest.approx(c.flops / 4e6 * 1e3 / SLACK)


def test_count_task_applies_device_sizes():
    spec = read_spec(TASKS / "level1" / "relu.py")
    counts_cpu = count_task(spec, "cpu")
    assert counts_cpu.min_bytes == 2 * 64 * 4096 * 4
    counts_gpu = count_task(spec, "cuda")
    assert counts_gpu.min_bytes == 2 * 16384 * 32768 * 4
    p = _probe(bw=2000.0)
    assert floor_ms(counts_gpu, p, _tf32(p)) == pytest.approx(counts_gpu.min_bytes / 2e12 * 1e3 / SLACK)


# --------------------------------------------------------------------------- probes

@pytest.fixture(scope="module")
def measured_cpu_probe():
    t0 = time.perf_counter()
    p = probe_mod.measure_probe("cpu")
    return p, time.perf_counter() - t0


def test_cpu_probe_measures_plausible_ceilings_quickly(measured_cpu_probe):
    p, seconds = measured_cpu_probe
    assert seconds < 10
    assert p.device == "cpu" and p.torch_version == torch.__version__
    assert set(p.tflops) == {"fp32"}
    assert 0.1 < p.bandwidth_gbps < 10_000
    assert p.bandwidth_gbps == max(p.details["copy_gbps"], p.details["read_gbps"])
    assert 1e-4 < p.tflops["fp32"] < 100


def test_get_probe_measures_once_then_reads_the_caches(tmp_store, cache_dir, monkeypatch):
    calls = []

    def fake_measure(device):
        calls.append(device)
        return Probe(device=device, device_name=probe_mod.device_name(device), torch_version=torch.__version__,
                     bandwidth_gbps=12.5, tflops={"fp32": 0.25})

    monkeypatch.setattr(probe_mod, "measure_probe", fake_measure)
    assert get_probe("cpu", tmp_store, measure=False) is None
    first = get_probe("cpu", tmp_store)
    assert calls == ["cpu"] and first.bandwidth_gbps == 12.5
    again = get_probe("cpu", tmp_store)
    assert calls == ["cpu"] and again.tflops == {"fp32": 0.25}
    with tmp_store.reader() as s:
        rows = list(s.scalars(sa.select(DeviceProbe)))
    assert len(rows) == 1 and rows[0].device_name == probe_mod.device_name("cpu")
    assert (cache_dir / probe_mod.PROBE_FILE).is_file()
    # Without a store the JSON file answers; a new store is filled from it.
    assert get_probe("cpu", None, measure=False).bandwidth_gbps == 12.5
    from store import Store
    other = Store(cache_dir.parent / "other.db")
    try:
        assert load_cached("cpu", other).tflops == {"fp32": 0.25}
        with other.reader() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(DeviceProbe)) == 1
    finally:
        other.close()
    # A probe only the store holds (a store carried to a fresh machine) fills the file again,
    # which the sandbox reads for its floor.
    (cache_dir / probe_mod.PROBE_FILE).unlink()
    assert get_probe("cpu", None, measure=False) is None
    assert get_probe("cpu", tmp_store, measure=False).bandwidth_gbps == 12.5
    assert get_probe("cpu", None, measure=False).bandwidth_gbps == 12.5
    # refresh measures again; a different torch version is a different cache entry.
    get_probe("cpu", tmp_store, refresh=True)
    assert calls == ["cpu", "cpu"]
    assert load_cached("cpu", tmp_store, version="0.0.0") is None


def test_device_probe_and_show_commands(tmp_path, cache_dir):
    db = str(tmp_path / "probe.db")
    env = {"KERNELLOOP_CACHE": str(cache_dir), "COLUMNS": "200"}
    shown = runner.invoke(device_app, ["show", "--device", "cpu", "--db", db], env=env)
    assert shown.exit_code == 1 and "kernelloop device probe" in shown.output
    probed = runner.invoke(device_app, ["probe", "--device", "cpu", "--db", db], env=env)
    assert probed.exit_code == 0, probed.output
    assert "GB/s" in probed.output and "matmul fp32" in probed.output
    shown = runner.invoke(device_app, ["show", "--device", "cpu", "--db", db], env=env)
    assert shown.exit_code == 0 and "cached" in shown.output
    listed = runner.invoke(device_app, ["show", "--all", "--db", db], env=env)
    assert listed.exit_code == 0 and "cpu" in listed.output


@pytest.mark.gpu
def test_cuda_probe_has_every_dtype():
    p = probe_mod.measure_probe("cuda")
    assert set(p.tflops) == {"fp32", "tf32", "fp16", "bf16"}
    assert p.tflops["fp16"] > p.tflops["fp32"] and p.bandwidth_gbps > 100


# --------------------------------------------------------------------------- baselines

def test_inputs_are_fresh_per_run_and_reproducible():
    task = load_task(with_device_sizes(read_spec(TASKS / "level1" / "relu.py"), "cpu"))
    make_args = input_factory(task, "cpu", seed=5)
    a0, a1, a0_again = make_args(0)[0], make_args(1)[0], make_args(0)[0]
    assert not torch.equal(a0, a1)
    assert torch.equal(a0, a0_again)
    assert torch.equal(a0, make_inputs(task, 6, "cpu")[0])


def test_measure_baseline_eager_only():
    spec = read_spec(TASKS / "level2" / "gemm_swish_scale.py")
    p = _probe(bw=20.0, fp32=0.1)
    r = measure_baseline(spec, "cpu", runs=3, warmup=1, compile=False, probe=p)
    counts = count_task(spec, "cpu")
    assert r["eager_ms"] > 0 and r["eager"]["runs"] == 3
    assert r["compile_ms"] is None and r["compile"] is None
    assert r["flops"] == counts.flops == 2 * 64 * 256 * 256
    assert r["floor_ms"] == pytest.approx(floor_ms(counts, p, _tf32(p)))
    assert r["overrides"] == with_device_sizes(spec, "cpu").overrides
    assert r["task_key"] == with_device_sizes(spec, "cpu").key
    assert r["device"] == "cpu" and r["torch_version"] == torch.__version__


def test_cpu_baselines_time_with_the_workers_thread_count_and_put_it_back(tmp_path, monkeypatch):
    """`baseline` times in its own process: on cpu it takes the sandbox's workers' intra-op
    thread count (KERNELLOOP_CPU_THREADS, default 1) while timing, so its eager and `eval`'s
    are one convention, and leaves the process's own count as it was."""
    seen = tmp_path / "threads"
    task = tmp_path / "threads_task.py"
    task.write_text("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n"
                    "    def forward(self, x):\n"
                    f"        open({str(seen)!r}, 'a').write(f'{{torch.get_num_threads()}}\\n')\n"
                    "        return x * 2\n\n\n"
                    "def get_inputs():\n    return [torch.randn(64)]\n\n\n"
                    "def get_init_inputs():\n    return []\n")
    before = torch.get_num_threads()
    for wanted in ("", "2"):
        monkeypatch.setenv("KERNELLOOP_CPU_THREADS", wanted)
        seen.unlink(missing_ok=True)
        r = measure_baseline(read_spec(task), "cpu", runs=3, warmup=1, compile=False)
        expected = int(wanted or 1)
        assert r["cpu_threads"] == expected
        assert set(seen.read_text().split()) == {str(expected)}
        assert torch.get_num_threads() == before


def test_measure_baseline_with_torch_compile():
    spec = read_spec(TASKS / "level1" / "relu.py", {"batch_size": 8, "dim": 256})
    r = measure_baseline(spec, "cpu", runs=3, warmup=1, compile=True)
    assert r["compile_error"] is None, r["compile_error"]
    assert r["compile_ms"] > 0 and r["compile"]["runs"] == 3
    assert r["floor_ms"] is None


def _baseline_app() -> typer.Typer:
    app = typer.Typer()
    app.command()(baseline_command)
    return app


def test_baseline_command_stores_rows_and_prints_a_table(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(probe_mod, "measure_probe", lambda device: Probe(
        device=device, device_name=probe_mod.device_name(device), torch_version=torch.__version__,
        bandwidth_gbps=10.0, tflops={"fp32": 0.05}))
    db = tmp_path / "bl.db"
    result = runner.invoke(_baseline_app(), ["level1/relu", "seeds/gemm_sigmoid_gemm_logsumexp", "--device", "cpu",
                                             "--no-compile", "--runs", "3", "--db", str(db)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "level1/relu" in result.output and "seeds/gemm_sigmoid_gemm_logsumexp" in result.output
    assert "skipped" in result.output
    from store import Store
    store = Store(db)
    try:
        with store.reader() as s:
            rows = list(s.scalars(sa.select(Baseline).order_by(Baseline.id)))
            assert [r.task.name for r in rows] == ["level1/relu", "seeds/gemm_sigmoid_gemm_logsumexp"]
            relu = rows[0]
            spec = with_device_sizes(read_spec(TASKS / "level1" / "relu.py"), "cpu")
            assert relu.task.sha256 == spec.sha256 and relu.task_key == spec.key
            assert relu.device == "cpu" and relu.torch_version == torch.__version__
            assert relu.eager_ms > 0 and relu.compile_ms is None
            assert relu.floor_ms == pytest.approx(2 * 64 * 4096 * 4 / (10e9 * SLACK) * 1e3)
            assert relu.details["eager"]["runs"] == 3 and relu.created_at is not None
            assert s.scalar(sa.select(sa.func.count()).select_from(Task)) == 2
    finally:
        store.close()
    # A second baseline of the same task adds a row but not a second task.
    again = runner.invoke(_baseline_app(), ["level1/relu", "--device", "cpu", "--no-compile", "--runs", "3",
                                            "--db", str(db)])
    assert again.exit_code == 0, again.output
    store = Store(db)
    try:
        with store.reader() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(Baseline)) == 3
            assert s.scalar(sa.select(sa.func.count()).select_from(Task)) == 2
    finally:
        store.close()


def test_baseline_command_reports_a_broken_task_and_goes_on(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(probe_mod, "measure_probe", lambda device: Probe(
        device=device, device_name="x", torch_version=torch.__version__, bandwidth_gbps=10.0, tflops={"fp32": 0.05}))
    broken = tmp_path / "broken.py"
    broken.write_text((Path(__file__).parent / "fixtures" / "degenerate" / "runtime_error.py").read_text())
    db = tmp_path / "bl.db"
    result = runner.invoke(_baseline_app(), [str(broken), "level1/relu", "--device", "cpu", "--no-compile",
                                             "--runs", "2", "--db", str(db)])
    assert result.exit_code == 1
    assert "level1/relu" in result.output
    from store import Store
    store = Store(db)
    try:
        with store.reader() as s:
            assert [r.task.name for r in s.scalars(sa.select(Baseline))] == ["level1/relu"]
    finally:
        store.close()


def test_store_baseline_upserts_the_task(tmp_store):
    spec = with_device_sizes(read_spec(TASKS / "level1" / "tanh.py"), "cpu")
    result = {"task_key": spec.key, "overrides": spec.overrides, "device": "cpu", "device_name": "n",
              "torch_version": "t", "eager_ms": 1.0, "compile_ms": None, "floor_ms": 0.5,
              "flops": 0, "min_bytes": 8, "numerics": "bf16/strict"}
    first = store_baseline(tmp_store, spec, result)
    second = store_baseline(tmp_store, spec, result)
    assert second != first
    with tmp_store.reader() as s:
        rows = list(s.scalars(sa.select(Baseline)))
        assert {r.task_id for r in rows} == {rows[0].task.id}
        assert rows[0].task.source == spec.source
        assert {r.numerics for r in rows} == {"bf16/strict"}      # the convention it was measured under


@pytest.mark.parametrize("math", ["default", "strict"])
def test_the_sandbox_floor_follows_the_math_mode_and_impossible_is_crossing_it(monkeypatch, math):
    """The sandbox's one floor charges fp32 FLOPs one TF32 pass for convolutions and the op classes
    the run's math mode runs in TF32 (whatever the parent process's switches say), three (3xTF32)
    for the rest; a median below it is `impossible`, one at or above it is not, and the result
    names the arithmetic."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from sandbox.checks import CandidateChecks
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig, EvalResult, Status, Timing

    p = _probe(bw=1e9, fp32=50.0, tf32=400.0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", math == "strict")     # not what decides
    monkeypatch.setattr(probe_mod, "get_probe", lambda device, measure=False: p)
    import threading

    def sandbox_floor(task: str, median_ms: float = 100.0) -> tuple[EvalResult, object]:
        counts = count_task(read_spec(TASKS / f"{task}.py"), "cuda")
        ref = SimpleNamespace(lock=threading.Lock(), counts={"counts": asdict(counts)})
        checks = CandidateChecks(EvalConfig(numerics=Numerics(math=math)), "cuda")
        result = EvalResult(task=task, device="cuda", status=Status.correct)
        result.candidate_time = Timing(median_ms=median_ms, iqr_ms=0.0, mean_ms=median_ms, min_ms=median_ms,
                                       max_ms=median_ms, runs=1, clock="cuda_event")
        checks._floor(ref, result)
        return result, counts

    def mem_ms(c) -> float:
        return c.min_bytes / (p.bandwidth_gbps * SLACK * 1e9) * 1e3

    conv_result, conv = sandbox_floor("level1/conv2d")
    assert conv.tf32_eligible.get("conv")
    # one pass for convolutions whatever the math mode; GEMMs below: three
    assert conv_result.floor_ms == pytest.approx(max(mem_ms(conv), conv.flops / (400e12 * SLACK) * 1e3))
    assert "one TF32 pass" in conv_result.floor_basis
    gemm_result, gemm = sandbox_floor("level2/gemm_swish_scale")
    assert gemm.tf32_eligible.get("matmul")
    fp32_flops = gemm.flops_by_dtype["fp32"]
    floor = max(mem_ms(gemm), 3 * fp32_flops / (400e12 * SLACK) * 1e3)
    assert gemm_result.floor_ms == pytest.approx(floor)
    at, _ = sandbox_floor("level2/gemm_swish_scale", median_ms=1.001 * floor)
    assert not at.has_flag("impossible") and at.floor_fraction <= 1
    below, _ = sandbox_floor("level2/gemm_swish_scale", median_ms=0.99 * floor)
    assert below.has_flag("impossible") and below.floor_fraction > 1
