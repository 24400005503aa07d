"""The bundled task suite, the degenerate-task check and the ``tasks`` commands."""
from __future__ import annotations

import ast
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from evals import taskcheck
from hardware.floors import floor_breakdown
from sandbox.tasks import count_task
from evals.taskcheck import check_task, value_issues
from evals.tasks_cli import app as tasks_app
from evals.tasks_cli import module_sizes, ops_summary
from kernelloop.paths import tasks_dir
from sandbox.harness import make_inputs, make_model
from sandbox.tasks import CPU_PRESET_NAME, discover, load_task, read_spec, with_device_sizes

TASKS = tasks_dir()
ALL_TASKS = discover(None)
DEGENERATE = Path(__file__).parent / "fixtures" / "degenerate"
SEEDS = {"gemm_sigmoid_gemm_logsumexp", "gemm_logsumexp_leakyrelu_gelu", "conv2d_bias_scale_sigmoid_groupnorm",
         "gemm_groupnorm_leakyrelu_sum", "conv2d_divide_leakyrelu"}
# Nominal H100 ceilings (fp32 with TF32 off, HBM3): used to judge the GPU sizes statically.
H100 = SimpleNamespace(device_name="nominal H100", bandwidth_gbps=3000.0,
                       tflops={"fp32": 50.0, "tf32": 400.0, "fp16": 800.0, "bf16": 800.0})
runner = CliRunner()


def _ids(paths):
    return [p.relative_to(TASKS).with_suffix("").as_posix() for p in paths]


# --------------------------------------------------------------------------- the suite

def test_seed_suite_is_exactly_the_five_seeds():
    assert {p.stem for p in (TASKS / "seeds").glob("*.py")} == SEEDS


@pytest.mark.parametrize("level,minimum", [("level1", 20), ("level2", 20), ("level3", 5)])
def test_levels_have_enough_tasks(level, minimum):
    assert len(discover([level])) >= minimum


def test_bundled_names_resolve_like_paths():
    assert discover(["level1/relu"]) == [TASKS / "level1" / "relu.py"]
    assert {p.stem for p in discover(["seeds"])} == SEEDS


@pytest.mark.parametrize("path", ALL_TASKS, ids=_ids(ALL_TASKS))
def test_bundled_task_contract(path):
    spec = read_spec(path)
    tree = ast.parse(spec.source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"torch", "math"}, f"{spec.name} imports {imported}"

    preset = with_device_sizes(spec, "cpu").overrides
    assert preset, f"{spec.name} has no {CPU_PRESET_NAME}"
    sizes = module_sizes(spec.source)
    assert set(preset) <= set(sizes), f"{spec.name}: CPU_SIZES names {set(preset) - set(sizes)}"

    # CPU sizes: a forward is well under a second, and its output matches the meta-tensor count.
    task = load_task(with_device_sizes(spec, "cpu"))
    model = make_model(task.Model, task, 0, "cpu")
    inputs = make_inputs(task, 1, "cpu")
    times = []
    with torch.no_grad():
        for _ in range(3):
            t0 = time.perf_counter()
            out = model(*inputs)
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 1.0, f"{spec.name}: cpu forward takes {statistics.median(times):.2f} s"
    counts = count_task(spec, "cpu")
    assert counts.output_shapes == [list(out.shape)]

    # GPU sizes: a sizeable job for an H100 (at fp32 rates) that still fits comfortably in memory.
    gpu = count_task(spec, "cuda")
    assert gpu.min_bytes < 8 * 2 ** 30, f"{spec.name}: inputs+weights+outputs are {gpu.min_bytes / 2**30:.1f} GiB"
    fp32_only = SimpleNamespace(device_name="H100 without tensor cores", bandwidth_gbps=3000.0, tflops={"fp32": 50.0})
    floor = floor_breakdown(gpu, fp32_only, tf32=set())["floor_ms"]
    assert floor >= 0.5, f"{spec.name}: H100 floor only {floor:.3f} ms at GPU sizes"


@pytest.mark.parametrize("path", ALL_TASKS, ids=_ids(ALL_TASKS))
def test_bundled_task_is_not_degenerate_on_cpu(path):
    issues = check_task(read_spec(path), "cpu")
    assert issues == [], [f"{i.flag}: {i.message}" for i in issues]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seed_task_is_not_degenerate_at_gpu_sizes(name):
    issues = check_task(read_spec(TASKS / "seeds" / f"{name}.py"), "cuda")
    assert issues == [], [f"{i.flag}: {i.message}" for i in issues]


# --------------------------------------------------------------------------- degenerate tasks

@pytest.mark.parametrize("fixture,expected", [
    ("constant", {"constant", "input_insensitive", "weight_insensitive"}),
    ("near_zero", {"near_zero"}),
    ("tiny_spread", {"tiny_spread"}),
    ("input_insensitive", {"input_insensitive"}),
    ("weight_insensitive", {"weight_insensitive"}),
    ("nonfinite", {"nonfinite"}),
    ("nondeterministic", {"nondeterministic"}),
    ("runtime_error", {"runtime_error"}),
])
def test_each_degenerate_fixture_raises_its_flag(fixture, expected):
    issues = check_task(read_spec(DEGENERATE / f"{fixture}.py"), "cpu")
    assert {i.flag for i in issues} == expected
    assert all(i.flag in taskcheck.FLAGS and i.message for i in issues)


def test_unloadable_task_is_a_load_error(tmp_path):
    bad = tmp_path / "no_model.py"
    bad.write_text("import torch\n\ndef get_inputs():\n    return [torch.randn(2)]\n")
    issues = check_task(read_spec(bad), "cpu")
    assert [i.flag for i in issues] == ["load_error"]
    assert "Model" in issues[0].message


def test_equal_weights_are_not_called_weight_insensitive(tmp_path):
    # LayerNorm starts at ones/zeros under every seed: the weight check must not run.
    f = tmp_path / "ln.py"
    f.write_text("import torch\nimport torch.nn as nn\n\n"
                 "class Model(nn.Module):\n"
                 "    def __init__(self, n):\n        super().__init__()\n        self.ln = nn.LayerNorm(n)\n"
                 "    def forward(self, x):\n        return self.ln(x)\n\n"
                 "n = 32\n\ndef get_inputs():\n    return [torch.randn(8, n)]\n\n"
                 "def get_init_inputs():\n    return [n]\n")
    assert check_task(read_spec(f), "cpu") == []


def test_value_checks_on_plain_tensors():
    torch.manual_seed(0)
    flags = lambda y: {i.flag for i in value_issues("t", 0, y)}  # noqa: E731
    assert flags(torch.randn(100)) == set()
    assert flags(torch.full((10, 10), 3.0)) == {"constant"}
    assert flags(torch.full((10, 10), 3.0) + 1e-5 * torch.randn(10, 10)) == {"constant"}
    assert flags(1e-3 * torch.randn(100)) == {"near_zero"}
    assert flags(50.0 + 0.01 * torch.randn(1000)) == {"tiny_spread"}
    assert flags(50.0 + 0.5 * torch.randn(1000)) == set()
    assert flags(torch.tensor([1.0, float("nan"), 2.0])) == {"nonfinite"}
    assert flags(torch.tensor([1.0, float("inf")])) == {"nonfinite"}
    # One element is not "constant across its elements"; only its size is judged.
    assert flags(torch.tensor([7.0])) == set()


def test_value_checks_in_small_chunks_and_a_sampled_median_flag_the_same(monkeypatch):
    """The statistics run chunk by chunk (KernelBench's 6 GiB outputs): with chunks of 7
    elements and a median of 16 sampled ones, every case gives the flags of the whole tensor."""
    from evals import taskcheck

    torch.manual_seed(0)
    cases = [torch.randn(100), torch.full((10, 10), 3.0), torch.full((10, 10), 3.0) + 1e-5 * torch.randn(10, 10),
             1e-3 * torch.randn(100), 50.0 + 0.01 * torch.randn(1000), 50.0 + 0.5 * torch.randn(1000),
             torch.tensor([1.0, float("nan"), 2.0]), torch.randn(50).bfloat16(),
             torch.cat([torch.full((90,), 2.0), torch.tensor([9.0] * 10)])]
    whole = [sorted((i.flag, i.message) for i in value_issues("t", 0, y)) for y in cases]
    monkeypatch.setattr(taskcheck, "CHUNK", 7)
    monkeypatch.setattr(taskcheck, "MEDIAN_SAMPLE", 16)
    chunked = [sorted(i.flag for i in value_issues("t", 0, y)) for y in cases]
    assert chunked == [sorted(f for f, _ in w) for w in whole]
    assert [f for w in whole for f, _ in w].count("constant") == 2
    a, b = torch.randn(1000), torch.randn(1000)
    b[:30] = a[:30]
    b[100:110] = float("nan")
    assert abs(taskcheck._changed_fraction(a, b, 1e-4, 1e-4) - 970 / 1000) < 1e-12


def test_a_check_that_runs_out_of_device_memory_says_unchecked_not_a_traceback(tmp_path):
    f = tmp_path / "huge.py"
    f.write_text("import torch\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n"
                 "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 18.05 GiB')\n\n"
                 "def get_inputs():\n    return [torch.randn(4)]\n\ndef get_init_inputs():\n    return []\n")
    issues = check_task(read_spec(f), "cpu")
    assert [i.flag for i in issues] == ["unchecked"]
    assert "18.05 GiB" in issues[0].message and "out of cpu memory" in issues[0].message


# --------------------------------------------------------------------------- static summaries

def test_ops_summary_reads_forward_in_evaluation_order():
    src = (TASKS / "seeds" / "gemm_logsumexp_leakyrelu_gelu.py").read_text()
    assert ops_summary(src) == "Linear → logsumexp → leaky_relu×2 → gelu×2"
    src = (TASKS / "seeds" / "conv2d_bias_scale_sigmoid_groupnorm.py").read_text()
    assert ops_summary(src) == "Conv2d → add → mul → sigmoid → GroupNorm"
    nested = ("import torch\nclass Model(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              "        self.fc = torch.nn.Linear(2, 2)\n"
              "    def forward(self, x):\n        return torch.relu(self.fc(x)).view(-1).sum(dim=0)\n")
    assert ops_summary(nested) == "Linear → relu → sum"


def test_module_sizes_takes_literals_and_chained_names():
    src = ("import torch\nbatch = 4\nheight = width = 32\nshape = (3, 4)\ndepth: int = 2\n"
           "CPU_SIZES = {'batch': 1}\nx = torch.ones(2)\n")
    assert module_sizes(src) == {"batch": 4, "height": 32, "width": 32, "shape": (3, 4), "depth": 2}


@pytest.mark.parametrize("preset,expected", [
    ("CPU_SIZES = {'n': 1}", {"n": 1}),
    ("CPU_SIZES: dict[str, int] = {'n': 1}", {"n": 1}),     # annotated: was silently ignored
    ("CPU_SIZES = dict(n=1)", {"n": 1}),
    ("CPU_SIZES = dict(n=SMALL)", {}),                       # not a literal: no preset, no crash
])
def test_cpu_preset_forms(preset, expected):
    from sandbox.tasks import TaskSpec
    source = f"n = 4\nm = 5\nSMALL = 1\n{preset}\n"
    assert with_device_sizes(TaskSpec("t", "t.py", source), "cpu").overrides == expected
    assert with_device_sizes(TaskSpec("t", "t.py", source), "cuda").overrides == {}
    # An explicit override wins over the preset.
    explicit = TaskSpec("t", "t.py", source, {"n": 2, "m": 7})
    assert with_device_sizes(explicit, "cpu").overrides == {"n": 2, "m": 7}


# --------------------------------------------------------------------------- commands

def test_tasks_list_shows_names_ops_and_sizes():
    result = runner.invoke(tasks_app, ["list", "seeds"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    for name in SEEDS:
        assert f"seeds/{name}" in result.output
    assert "Linear → sigmoid → Linear → logsumexp" in result.output
    assert "batch_size=16384→128" in result.output
    assert "level1/" not in result.output


def test_tasks_show_reports_sizes_shapes_counts_and_floor(tmp_path, monkeypatch):
    from hardware.probe import Probe, device_name, write_cache_file as save

    monkeypatch.chdir(tmp_path)                      # no ./kernelloop.db here: no store is opened
    monkeypatch.delenv("KERNELLOOP_DB", raising=False)
    monkeypatch.setenv("KERNELLOOP_CACHE", str(tmp_path / "cache"))
    args = ["show", "level1/conv2d", "--device", "cpu", "--set", "batch_size=3"]
    result = runner.invoke(tasks_app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "[3, 16, 32, 32]" in result.output        # output shape at cpu sizes with --set
    assert "--set" in result.output and "CPU_SIZES (file: 128)" in result.output
    expected_flops = 2 * 3 * 16 * 8 * 9 * 32 * 32
    assert f"{expected_flops / 1e6:.2f} MFLOP" in result.output
    assert "class Model" in result.output            # the source
    assert "no probe cached" in result.output
    assert not (tmp_path / "kernelloop.db").exists()

    # Once a probe is cached, the floor is shown: here memory-bound at 1 GB/s.
    save(Probe(device="cpu", device_name=device_name("cpu"), torch_version=torch.__version__,
               bandwidth_gbps=1.0, tflops={"fp32": 1.0}))
    result = runner.invoke(tasks_app, args + ["--no-source"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    min_bytes = 4 * (3 * 8 * 32 * 32 + 16 * 8 * 9 + 16 + 3 * 16 * 32 * 32)
    from hardware.floors import CEILING_SLACK

    assert f"floor: {min_bytes / (1e9 * CEILING_SLACK) * 1e3:.4f} ms (memory-bound" in result.output
    assert "bytes at the probed bandwidth" in result.output          # the arithmetic the floor assumed
    assert "class Model" not in result.output


def test_tasks_show_rejects_a_directory():
    result = runner.invoke(tasks_app, ["show", "seeds", "--device", "cpu"])
    assert result.exit_code == 2
    assert "names 5 tasks" in result.output


def test_tasks_check_exit_codes():
    bad = runner.invoke(tasks_app, ["check", str(DEGENERATE), "--device", "cpu"], env={"COLUMNS": "250"})
    assert bad.exit_code == 1, bad.output
    for flag in ("constant", "near_zero", "tiny_spread", "input_insensitive", "weight_insensitive",
                 "nonfinite", "nondeterministic", "runtime_error"):
        assert flag in bad.output
    assert f"{len(list(DEGENERATE.glob('*.py')))} of {len(list(DEGENERATE.glob('*.py')))} tasks flagged" in bad.output
    good = runner.invoke(tasks_app, ["check", "seeds", "level1/relu", "--device", "cpu"])
    assert good.exit_code == 0, good.output
    assert "6 tasks checked" in good.output


def test_tasks_check_unknown_task_is_a_usage_error():
    result = runner.invoke(tasks_app, ["check", "level1/no_such_task", "--device", "cpu"])
    assert result.exit_code == 2
    assert "no_such_task" in result.output


def test_tasks_check_stores_its_verdicts_and_a_second_check_reads_them(tmp_path, monkeypatch):
    # KernelBench's 250 tasks take about half an hour of one GPU: a check stopped part way goes on
    # where it stopped, reading the verdicts already found instead of running every check again.
    db = str(tmp_path / "k.db")
    args = ["check", str(DEGENERATE / "constant.py"), "level1/relu", "--device", "cpu", "--db", db]
    wide = {"COLUMNS": "250"}
    first = runner.invoke(tasks_app, args, env=wide)
    assert first.exit_code == 1 and "constant" in first.output, first.output
    assert "degeneracy checks: 2 run now, 0 verdicts read from the store" in first.output
    real, ran = taskcheck.check_task, []
    monkeypatch.setattr(taskcheck, "check_task", lambda spec, *a, **k: ran.append(spec.name) or real(spec, *a, **k))
    again = runner.invoke(tasks_app, args, env=wide)
    assert again.exit_code == 1 and ran == [], again.output
    assert "constant" in again.output and "1 of 2 tasks flagged" in again.output
    assert "0 run now, 2 verdicts read from the store" in again.output
    assert "level1/relu: ok" in again.output and "verdict read from the store" in again.output
    forced = runner.invoke(tasks_app, args + ["--recheck"], env=wide)
    assert forced.exit_code == 1 and len(ran) == 2, forced.output
    # checks whose source changed do not take the old verdicts as theirs
    monkeypatch.setattr(taskcheck, "checker_version", lambda: "changed")
    runner.invoke(tasks_app, args, env=wide)
    assert len(ran) == 4


def test_an_unchecked_verdict_is_not_stored(tmp_path, monkeypatch):
    from evals.taskcheck import CheckIssue

    db = str(tmp_path / "k.db")
    args = ["check", "level1/relu", "--device", "cpu", "--db", db]
    monkeypatch.setattr(taskcheck, "check_task",
                        lambda spec, *a, **k: [CheckIssue(spec.name, "unchecked", "the checks ran out of cpu memory")])
    out = runner.invoke(tasks_app, args)
    assert out.exit_code == 1 and "unchecked" in out.output, out.output
    monkeypatch.undo()
    again = runner.invoke(tasks_app, args)
    assert again.exit_code == 0 and "1 run now, 0 verdicts read" in " ".join(again.output.split()), again.output
