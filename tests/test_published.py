"""KernelBench's published timings: lookup, the 10% flag, conventions, and ``kernelloop baseline``."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
import typer
from typer.testing import CliRunner

from hardware import probe as probe_mod
from evals.baseline import baseline_command, baseline_table, published_for
from hardware.probe import Probe
from evals.published import (COMPILE_FILE, EAGER_FILE, PUBLISHED_NUMERICS, compare, find_checkout, find_published,
                             gpu_model, lookup_published, published_record)
from sandbox.tasks import read_spec

REPO = Path(__file__).resolve().parents[1]
# kernelloop's own logic runs on a KernelBench-shaped folder of made-up tasks and timings (every
# clone has it); the tests marked `kernelbench` read the real checkout (tests/conftest.py finds it).
FAKE = REPO / "tests" / "fixtures" / "kernelbench"
CONV = FAKE / "level2" / "1_Tiny_Conv2D_ReLU_BiasAdd.py"
MATMUL = FAKE / "level1" / "1_Tiny_Matmul.py"
H100 = "NVIDIA H100 80GB HBM3"
runner = CliRunner()


def _published_json(root: Path, name: str) -> dict:
    return json.loads((root / "results" / "timing" / "H100_Modal" / name).read_text())


def _check_lookup(root: Path, conv: Path, matmul: Path) -> None:
    eager = _published_json(root, EAGER_FILE)["level2"][conv.name]
    comp = _published_json(root, COMPILE_FILE)["level2"][conv.name]
    found = lookup_published(conv, H100)
    assert found.reason is None and found.published is not None
    p = found.published
    assert p.task == f"level2/{conv.name}" and p.timing_dir == "H100_Modal"
    assert p.match == "exact" and "exact" in p.match_note and p.hardware == H100
    assert p.eager.mean_ms == eager["mean"] and p.eager.std_ms == eager["std"]
    assert p.eager.num_trials == eager["num_trials"] == 100
    assert p.compile.mean_ms == comp["mean"] and p.compile.mean_ms != p.eager.mean_ms
    assert p.eager.source.endswith("H100_Modal/" + EAGER_FILE)
    assert p.compile.source.endswith("H100_Modal/" + COMPILE_FILE)
    assert p.numerics == PUBLISHED_NUMERICS == "fp32/default"
    assert Path(p.root).resolve() == root.resolve()
    # a path written relative to the repository (through .. for a checkout beside it) works as well
    rel = Path(os.path.relpath(matmul, REPO))
    assert not rel.is_absolute() and (REPO / rel).is_file()
    p1 = find_published(REPO / rel, H100)
    assert p1 is not None and p1.eager.mean_ms == _published_json(root, EAGER_FILE)["level1"][matmul.name]["mean"]


def _check_gpu_model_and_others(conv: Path) -> None:
    p = find_published(conv, "NVIDIA H100 PCIe")
    assert p is not None and p.match == "gpu model"
    assert "H100" in p.match_note and "NVIDIA H100 PCIe" in p.match_note and p.hardware == H100
    found = lookup_published(conv, "NVIDIA A100-SXM4-80GB")
    assert found.published is None and not found
    assert "A100-SXM4-80GB" in found.reason and f"published for: {H100}" in found.reason
    cpu = lookup_published(conv, "AMD EPYC 7763 64-Core Processor (2 threads)")
    assert cpu.published is None and "no published timings" in cpu.reason


# --------------------------------------------------------------------------- lookups (made-up checkout)

def test_lookup_on_the_published_gpu():
    _check_lookup(FAKE, CONV, MATMUL)


def test_lookup_by_gpu_model_or_on_another_gpu_says_so():
    _check_gpu_model_and_others(CONV)


def test_tasks_outside_a_checkout_or_unknown_have_none():
    bundled = REPO / "tasks" / "level1" / "relu.py"
    assert bundled.is_file()
    found = lookup_published(bundled, H100)
    assert found.published is None and "not a levelN task of a KernelBench checkout" in found.reason
    assert find_checkout(bundled)[0] is None
    assert find_published(REPO / "README.md", H100) is None
    unknown = lookup_published(FAKE / "level2" / "999_No_Such_Task.py", H100)
    assert unknown.published is None and "no entry for level2/999_No_Such_Task.py" in unknown.reason
    assert lookup_published(None, H100).reason == "no task path"
    assert lookup_published(CONV, "").reason == "no device name"


# --------------------------------------------------------------------------- the real checkout

@pytest.mark.kernelbench
def test_real_lookup_on_the_published_gpu(real_kernelbench):
    _check_lookup(real_kernelbench, real_kernelbench / "level2" / "1_Conv2D_ReLU_BiasAdd.py",
                  real_kernelbench / "level1" / "1_Square_matrix_multiplication_.py")


@pytest.mark.kernelbench
def test_real_lookup_by_gpu_model_or_on_another_gpu_says_so(real_kernelbench):
    _check_gpu_model_and_others(real_kernelbench / "level2" / "1_Conv2D_ReLU_BiasAdd.py")
    unknown = lookup_published(real_kernelbench / "level2" / "999_No_Such_Task.py", H100)
    assert unknown.published is None and "no entry for level2/999_No_Such_Task.py" in unknown.reason


@pytest.mark.parametrize("name, model", [
    (H100, "H100"), ("NVIDIA H100 PCIe", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA B200", "B200"), ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ("AMD EPYC 7763 64-Core Processor (2 threads)", None), ("", None)])
def test_gpu_model_tokens(name, model):
    assert gpu_model(name) == model


# --------------------------------------------------------------------------- comparing

def test_ten_percent_flag_both_ways():
    pub = find_published(CONV, H100).eager
    m = pub.mean_ms
    above = compare(m * 1.25, pub, "fp32/default")
    assert above.flagged and above.same_convention and above.ratio == pytest.approx(1.25)
    assert "25% above" in above.message and "the machine or the numerics convention differs" in above.message
    below = compare(m * 0.8, pub, "fp32/default")
    assert below.flagged and below.ratio == pytest.approx(0.8) and "20% below" in below.message
    for ratio in (1.05, 0.95, 1.0, 1.1, 0.9):          # within 10% (the edge included) is not flagged
        c = compare(m * ratio, pub, "fp32/default")
        assert not c.flagged and c.ratio == pytest.approx(ratio), ratio
        assert "within 10%" in c.message
    comp = compare(find_published(CONV, H100).compile.mean_ms * 1.5, find_published(CONV, H100).compile,
                   "fp32/default", kind="compile")
    assert comp.flagged and "torch version" in comp.message
    assert compare(1.0, None, "fp32/default") is None
    missing = compare(None, pub, "fp32/default")
    assert missing.ratio is None and not missing.flagged


def test_another_convention_is_shown_not_flagged():
    pub = find_published(CONV, H100).eager
    c = compare(pub.mean_ms * 2.0, pub, "fp32/strict")
    assert c.ratio == pytest.approx(2.0) and not c.flagged and not c.same_convention
    assert "fp32/strict" in c.message and "different convention" in c.message
    rec = published_record(lookup_published(CONV, H100), {"eager": pub.mean_ms * 2.0, "compile": None}, "bf16/default")
    assert rec["available"] and rec["same_convention"] is False and rec["flagged"] is False
    assert rec["eager"]["mean_ms"] == pub.mean_ms and rec["numerics"] == "fp32/default"
    assert rec["comparison"]["eager"]["numerics"] == "bf16/default"
    json.dumps(rec)                                     # storable as JSON


# --------------------------------------------------------------------------- a synthetic checkout

TINY_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(8, 16)]


def get_init_inputs():
    return []
"""


def _entry(mean, hardware=H100):
    e = {"mean": mean, "std": 0.01, "min": mean, "max": mean, "num_trials": 100, "device": "cuda:0"}
    if hardware is not None:
        e["hardware"] = hardware
    return e


def _checkout(tmp_path: Path, eager=None, compile_=None, dir_name="H100_Modal", task="1_Tiny.py") -> Path:
    """A KernelBench-shaped tree: level1/<task> and results/timing/<dir>/ with the given JSON texts."""
    root = tmp_path / "KernelBench"
    (root / "level1").mkdir(parents=True)
    (root / "level1" / task).write_text(TINY_TASK)
    timing = root / "results" / "timing" / dir_name
    timing.mkdir(parents=True)
    if eager is not None:
        (timing / EAGER_FILE).write_text(eager if isinstance(eager, str) else json.dumps(eager))
    if compile_ is not None:
        (timing / COMPILE_FILE).write_text(compile_ if isinstance(compile_, str) else json.dumps(compile_))
    return root / "level1" / task


def test_malformed_json_gives_a_reason(tmp_path):
    task = _checkout(tmp_path, eager='{"level1": {"1_Tiny.py": {"mean": 1.0,')
    found = lookup_published(task, H100)
    assert found.published is None and "not valid JSON" in found.reason and EAGER_FILE in found.reason


def test_malformed_compile_file_keeps_the_eager_figure(tmp_path):
    task = _checkout(tmp_path, eager={"level1": {"1_Tiny.py": _entry(0.5)}}, compile_="[1, 2")
    p = find_published(task, H100)
    assert p is not None and p.eager.mean_ms == 0.5 and p.compile is None
    assert any("not valid JSON" in n for n in p.notes)


@pytest.mark.parametrize("eager, words", [
    ([1, 2, 3], "not a JSON object"),
    ({"level1": {"1_Tiny.py": {"mean": "fast", "hardware": H100}}}, "no valid mean"),
    ({"level1": {"1_Tiny.py": {"mean": -1.0, "hardware": H100}}}, "no valid mean"),
    ({"level1": {"1_Tiny.py": "4.2"}, "level2": {"x.py": _entry(1.0)}}, "no valid mean"),
    ({"level1": "oops", "level2": {"x.py": _entry(1.0)}}, "has no level1"),
    ({"level2": {"x.py": _entry(1.0)}}, "has no level1"),
])
def test_malformed_entries_give_a_reason(tmp_path, eager, words):
    found = lookup_published(_checkout(tmp_path, eager=eager), H100)
    assert found.published is None and words in found.reason


def test_missing_files_and_hardware_fallbacks(tmp_path):
    found = lookup_published(_checkout(tmp_path / "a"), H100)            # a timing dir without files
    assert found.published is None and "does not exist" in found.reason
    # entries without a "hardware" field: the directory's name tells the GPU model
    task = _checkout(tmp_path / "b", eager={"level1": {"1_Tiny.py": _entry(0.5, hardware=None)}})
    p = find_published(task, H100)
    assert p is not None and p.match == "gpu model" and "directory name" in p.match_note
    assert find_published(task, "NVIDIA A100-SXM4-80GB") is None
    # an exact match wins over a same-model one
    root = tmp_path / "c" / "KernelBench"
    task = _checkout(tmp_path / "c", eager={"level1": {"1_Tiny.py": _entry(2.0, "NVIDIA H100 PCIe")}},
                     dir_name="A_H100_PCIe")
    exact = root / "results" / "timing" / "Z_H100_SXM"
    exact.mkdir()
    (exact / EAGER_FILE).write_text(json.dumps({"level1": {"1_Tiny.py": _entry(1.0)}}))
    p = find_published(task, H100)
    assert p.timing_dir == "Z_H100_SXM" and p.eager.mean_ms == 1.0 and p.match == "exact"
    p = find_published(task, "NVIDIA H100 NVL")
    assert p.timing_dir == "A_H100_PCIe" and p.match == "gpu model"


# --------------------------------------------------------------------------- kernelloop baseline

def _result(eager_ms, compile_ms=None, numerics="fp32/default", device_name=H100):
    return {"eager_ms": eager_ms, "compile_ms": compile_ms, "compile_error": None, "floor_ms": 1.0,
            "numerics": numerics, "device_name": device_name}


def _render(table) -> str:
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(table)
    return console.export_text()


def test_baseline_table_shows_published_columns_and_flags():
    spec = read_spec(CONV)
    pub = find_published(CONV, H100)
    flagged = _result(pub.eager.mean_ms * 1.3, pub.compile.mean_ms)
    flagged["published"] = published_for(spec, flagged)
    ok = _result(pub.eager.mean_ms * 1.02, pub.compile.mean_ms * 0.99)
    ok["published"] = published_for(spec, ok)
    plain = _result(0.5)                               # a task with no published figures
    table, notes = baseline_table([("kb/flagged", flagged), ("kb/ok", ok), ("mine", plain), ("broken", None)],
                                  "t")
    text = _render(table)
    for col in ("published eager", "eager/published", "published compile", "compile/published"):
        assert col in text
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 3}
    assert "1.30 (!)" in lines["kb/flagged"] and f"{pub.eager.mean_ms:.3f}" in lines["kb/flagged"]
    assert "1.02" in lines["kb/ok"] and "(!)" not in lines["kb/ok"] and "0.99" in lines["kb/ok"]
    assert "(!)" not in lines["mine"] and "error" in lines["broken"]
    assert len([n for n in notes if n.startswith("(!) kb/flagged")]) == 1
    assert not any(n.startswith("(!) kb/ok") for n in notes)
    flagged_note = next(n for n in notes if n.startswith("(!) kb/flagged"))
    assert "30% above" in flagged_note and "the machine or the numerics convention differs" in flagged_note
    assert "H100_Modal" in notes[0] and "fp32/default" in notes[0]
    # no published figures anywhere: the table keeps its five columns
    table, notes = baseline_table([("mine", plain)], "t")
    assert "published" not in _render(table) and notes == []


def test_baseline_table_marks_another_convention():
    spec = read_spec(CONV)
    pub = find_published(CONV, H100)
    strict = _result(pub.eager.mean_ms * 1.5, numerics="fp32/strict")
    strict["published"] = published_for(spec, strict)
    assert strict["published"]["available"] and not strict["published"]["flagged"]
    table, notes = baseline_table([("kb/strict", strict)], "t")
    text = _render(table)
    assert "1.50 (≠)" in text and "(!)" not in text
    assert any("fp32/strict" in n and "different convention" in n for n in notes)


def test_published_for_skips_overridden_sizes():
    spec = read_spec(CONV, {"batch_size": 2})
    rec = published_for(spec, _result(1.0))
    assert rec["available"] is False and "sizes overridden" in rec["reason"]
    cpu = published_for(read_spec(CONV), _result(1.0, device_name="some cpu"))
    assert cpu["available"] is False and "no published timings" in cpu["reason"]


def _baseline_app() -> typer.Typer:
    app = typer.Typer()
    app.command()(baseline_command)
    return app


@pytest.fixture
def fake_h100(tmp_path, monkeypatch):
    """A CPU run that reports an H100's name, with a probe that needs no measuring."""
    monkeypatch.setenv("KERNELLOOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(probe_mod, "device_name", lambda device: H100)
    monkeypatch.setattr(probe_mod, "measure_probe", lambda device: Probe(
        device=device, device_name=H100, torch_version=torch.__version__, bandwidth_gbps=10.0,
        tflops={"fp32": 0.05}))


def test_baseline_command_shows_and_stores_published_figures(tmp_path, fake_h100):
    # published 1e-6 ms: any measured time is far more than 10% off, so the run is flagged
    task = _checkout(tmp_path, eager={"level1": {"1_Tiny.py": _entry(1e-6)}},
                     compile_={"level1": {"1_Tiny.py": _entry(2e-6)}})
    db = tmp_path / "bl.db"
    result = runner.invoke(_baseline_app(), [str(task), "--device", "cpu", "--no-compile", "--runs", "2",
                                             "--db", str(db)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    out = result.output
    for col in ("published eager", "eager/published", "published compile", "compile/published"):
        assert col in out
    assert "(!)" in out and "the machine or the numerics convention differs" in out
    assert "times the published" in out
    assert "H100_Modal" in out and "exact match" in out
    from store import Store
    from store.models import Baseline
    store = Store(db)
    try:
        with store.reader() as s:
            row = s.scalars(sa.select(Baseline)).one()
            pub = row.details["published"]
            assert pub["available"] and pub["eager"]["mean_ms"] == 1e-6 and pub["compile"]["mean_ms"] == 2e-6
            assert pub["hardware"] == H100 and pub["numerics"] == "fp32/default" and pub["match"] == "exact"
            assert pub["comparison"]["eager"]["flagged"] and pub["comparison"]["eager"]["ratio"] > 1.1
            assert pub["comparison"]["compile"]["measured_ms"] is None       # --no-compile
            assert row.details["numerics"] == "fp32/default" and row.device_name == H100
    finally:
        store.close()


def test_baseline_command_without_published_figures_keeps_its_table(tmp_path, fake_h100):
    task = _checkout(tmp_path, eager={"level1": {"1_Tiny.py": _entry(1.0, "NVIDIA A100-SXM4-80GB")}})
    db = tmp_path / "bl.db"
    result = runner.invoke(_baseline_app(), [str(task), "--device", "cpu", "--no-compile", "--runs", "2",
                                             "--db", str(db)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "published" not in result.output and "eager/floor" in result.output
    from store import Store
    from store.models import Baseline
    store = Store(db)
    try:
        with store.reader() as s:
            row = s.scalars(sa.select(Baseline)).one()
            assert "published" not in row.details
            assert "no published timings" in row.details["published_missing"]
    finally:
        store.close()
