"""Reference baselines: eager and torch.compile times of each task, next to its roofline floor.

``kernelloop baseline TASK...`` times the task's ``Model`` as PyTorch runs it (eager) and
under ``torch.compile`` with ``sandbox.timing.time_runs`` (the routine every timing in
kernelloop uses: warm-up, fresh inputs per run, cache flush, device-wide sync, median),
computes the roofline floor from a device probe (``hardware.probe``), and stores one
``Baseline`` row per task (device name, torch version, date) with the task upserted.

Conventions (``sandbox.harness``): ``torch.manual_seed(seed)`` before ``Model(*get_init_inputs())``;
run ``i`` gets inputs from ``get_inputs()`` under seed ``seed + 1 + i``, made on the device;
the model stays in training mode. Every figure is taken under the run's numerics
(``sandbox.numerics``: precision and math mode, the same switches the sandbox sets) and
stored with its label.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Optional

import typer

from kernelloop.cli_common import (DbOption, DeviceOption, MathOption, PrecisionOption, SetOption, console, err_console,
                                   fail, open_store, resolve_device, resolve_numerics)
from sandbox.numerics import Numerics
from sandbox.tasks import LoadedTask, TaskError, TaskSpec, discover, load_task, parse_overrides, read_spec, with_device_sizes


def input_factory(task: LoadedTask, device: str, seed: int = 0,
                  numerics: Optional[Numerics] = None) -> Callable[[int], list[Any]]:
    """``make_args(i)`` for ``time_runs``: fresh inputs for run ``i`` (seed ``seed + 1 + i``)."""
    from sandbox.harness import make_inputs

    def make_args(i: int) -> list[Any]:
        return make_inputs(task, seed + 1 + i, device, numerics)

    return make_args


def _timing_dict(t: Any) -> dict[str, Any]:
    return t.model_dump() if hasattr(t, "model_dump") else dict(t)


def measure_baseline(spec: TaskSpec, device: str, runs: int = 20, warmup: int = 3, compile: bool = True,
                     seed: int = 0, probe: Any = None, flush_l2: bool = True,
                     numerics: Optional[Numerics] = None) -> dict[str, Any]:
    """Eager (and torch.compile) timings, roofline counts and floor of one task.

    ``spec`` is taken at ``device`` sizes (CPU_SIZES apply on cpu). Returns a JSON-able dict:
    ``eager_ms``/``compile_ms`` (medians), ``eager``/``compile`` (full ``Timing`` dumps),
    ``compile_error`` (when torch.compile failed), ``floor_ms`` (``None`` without ``probe``),
    ``flops``, ``min_bytes``, ``dtype``, ``tf32`` (op classes the reference runs in TF32 under
    ``numerics``, which the floor charges at the TF32 rate), ``numerics`` (its label) and
    ``numerics_config``, ``runs``, ``cpu_threads`` (on cpu: the intra-op threads it timed with, the
    sandbox workers' count) and identity fields.
    """
    import contextlib

    from sandbox.slots import cpu_timing_threads_here

    numerics = numerics or Numerics()
    # on cpu with the sandbox's workers' thread count, so `baseline` and `eval` time one convention
    threads = cpu_timing_threads_here() if device == "cpu" else contextlib.nullcontext()
    with numerics.enforced(), threads as n:
        result = _measure(spec, device, runs, warmup, compile, seed, probe, flush_l2, numerics)
    result["cpu_threads"] = n
    return result


def _measure(spec: TaskSpec, device: str, runs: int, warmup: int, compile: bool, seed: int, probe: Any,
             flush_l2: bool, numerics: Numerics) -> dict[str, Any]:
    import torch

    from hardware.counts import count_loaded
    from hardware.floors import floor_breakdown
    from hardware.probe import device_name
    from sandbox.harness import make_model
    from sandbox.timing import time_runs

    spec = with_device_sizes(spec, device)
    task = load_task(spec)
    counts = count_loaded(task, numerics)
    tf32 = numerics.tf32_classes(device)
    result: dict[str, Any] = {
        "task": spec.name, "task_key": spec.key, "overrides": dict(spec.overrides), "device": device,
        "device_name": device_name(device), "torch_version": torch.__version__, "seed": seed,
        "runs": runs, "warmup": warmup,
        "numerics": numerics.label, "numerics_config": numerics.model_dump(mode="json"),
        "flops": counts.flops, "min_bytes": counts.min_bytes, "dtype": counts.dtype,
        "flops_by_dtype": counts.flops_by_dtype, "bytes_by_kind": counts.bytes_by_kind,
        "tf32_eligible": counts.tf32_eligible, "tf32": sorted(tf32),
        "eager": None, "eager_ms": None, "compile": None, "compile_ms": None, "compile_error": None,
        "floor_ms": None, "memory_ms": None, "compute_ms": None,
    }
    if probe is not None:
        fb = floor_breakdown(counts, probe, tf32)
        result.update(floor_ms=fb["floor_ms"], memory_ms=fb["memory_ms"], compute_ms=fb["compute_ms"],
                      floor_basis=fb["arithmetic"])

    make_args = input_factory(task, device, seed, numerics)
    model = make_model(task.Model, task, seed, device, numerics)
    eager = time_runs(model, make_args, device, warmup=warmup, runs=runs, flush_l2=flush_l2)
    result["eager"] = _timing_dict(eager)
    result["eager_ms"] = eager.median_ms

    if compile:
        try:
            compiled = torch.compile(make_model(task.Model, task, seed, device, numerics))
            timing = time_runs(compiled, make_args, device, warmup=max(warmup, 1), runs=runs,
                               flush_l2=flush_l2)
            result["compile"] = _timing_dict(timing)
            result["compile_ms"] = timing.median_ms
        except Exception as exc:  # noqa: BLE001 - a compile failure is recorded, eager still counts
            result["compile_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            torch._dynamo.reset()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def store_baseline(store: Any, spec: TaskSpec, result: dict[str, Any]) -> int:
    """Upsert the task and add a ``Baseline`` row for ``result``; returns the row id."""
    from store.models import Baseline
    from store.repo import upsert_task

    with store.session() as session:
        task = upsert_task(session, spec)
        row = Baseline(task_id=task.id, task_key=result["task_key"], overrides=result["overrides"],
                       device=result["device"], device_name=result["device_name"],
                       torch_version=result["torch_version"], eager_ms=result["eager_ms"],
                       compile_ms=result["compile_ms"], floor_ms=result["floor_ms"],
                       flops=float(result["flops"]), min_bytes=float(result["min_bytes"]), details=result,
                       numerics=result["numerics"])
        session.add(row)
        session.flush()
        return row.id


def _fmt_ms(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.3f}"


def published_for(spec: TaskSpec, result: dict[str, Any]) -> dict[str, Any]:
    """KernelBench's published figures for a measured baseline (``evals.published``), with
    the comparisons: what ``details["published"]`` stores. Only for the task's own sizes."""
    from evals.published import lookup_published, published_record

    if spec.overrides:
        sizes = ", ".join(f"{k}={v!r}" for k, v in sorted(spec.overrides.items()))
        return {"available": False,
                "reason": f"sizes overridden ({sizes}): the published figures are for the task's own sizes"}
    lookup = lookup_published(spec.path, result.get("device_name"))
    return published_record(lookup, {"eager": result.get("eager_ms"), "compile": result.get("compile_ms")},
                            result.get("numerics"))


def baseline_table(rows: list[tuple[str, Optional[dict[str, Any]]]], title: str,
                   no_compile: bool = False) -> tuple[Any, list[str]]:
    """The table ``kernelloop baseline`` prints and the lines to print below it.

    ``rows`` are ``(task, result)``, ``result`` ``None`` for a task that failed. Where any
    result has published figures (``result["published"]``), columns "published eager",
    "eager/published", "published compile" and "compile/published" are added; a ratio more
    than 10% off is marked, and a line below the table names the likely cause."""
    from rich.table import Table

    from evals.published import (FLAG_MARK, OTHER_CONVENTION_MARK, PUBLISHED_NUMERICS, published_ms_cell,
                                 ratio_cell, record_notes)

    def pub(result: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        rec = (result or {}).get("published")
        return rec if isinstance(rec, dict) and rec.get("available") else None

    show_published = any(pub(r) for _, r in rows)
    cols = ["task", "eager ms", "compile ms", "floor ms", "eager/floor"]
    if show_published:
        cols += ["published eager", "eager/published", "published compile", "compile/published"]
    table = Table(title=title)
    for col in cols:
        table.add_column(col, justify="left" if col == "task" else "right")
    notes: list[str] = []
    other_convention: set[str] = set()
    sources: set[str] = set()
    for task, result in rows:
        if result is None:
            table.add_row(task, "error", *[""] * (len(cols) - 2))
            continue
        compile_cell = _fmt_ms(result["compile_ms"]) if result.get("compile_error") is None else "failed"
        ratio = f"{result['eager_ms'] / result['floor_ms']:.2f}" if result.get("floor_ms") else "—"
        cells = [task, _fmt_ms(result["eager_ms"]), "skipped" if no_compile else compile_cell,
                 _fmt_ms(result.get("floor_ms")), ratio]
        if show_published:
            rec = pub(result)
            comp = (rec or {}).get("comparison") or {}
            cells += [published_ms_cell(rec, "eager"), ratio_cell(comp.get("eager")),
                      published_ms_cell(rec, "compile"), ratio_cell(comp.get("compile"))]
            if rec:
                notes += record_notes(task, rec)
                sources.add(f"{rec['timing_dir']} ({rec['hardware']}; {rec['match_note']})")
                if not rec.get("same_convention"):
                    other_convention.add(str(rec.get("measured_numerics")))
        table.add_row(*cells)
    if show_published:
        notes.insert(0, f"published: KernelBench results/timing/{', '.join(sorted(sources))}, "
                        f"measured under {PUBLISHED_NUMERICS}; ratio = measured / published, "
                        f"{FLAG_MARK} more than 10% off")
        if other_convention:
            notes.append(f"{OTHER_CONVENTION_MARK} measured under {', '.join(sorted(other_convention))}, published "
                         f"under {PUBLISHED_NUMERICS}: a different convention, shown but not compared")
    return table, notes


def baseline_command(
    tasks: list[str] = typer.Argument(..., help="task files, directories or bundled names (seeds, level1/relu)"),
    device: Optional[str] = DeviceOption,
    set_: Optional[list[str]] = SetOption,
    no_compile: bool = typer.Option(False, "--no-compile", help="skip torch.compile (slow on cpu)"),
    runs: int = typer.Option(20, "--runs", min=1, help="timed runs per measurement"),
    precision: Optional[str] = PrecisionOption,
    math: Optional[str] = MathOption,
    db: Optional[str] = DbOption,
) -> None:
    """Time tasks' eager and torch.compile references; show roofline floors; store Baseline rows."""
    from store.probes import get_probe

    dev = resolve_device(device)
    numerics = resolve_numerics(precision, math)
    try:
        overrides = parse_overrides(set_)
        paths = discover(tasks)
    except TaskError as exc:
        fail(str(exc))
    store = open_store(db)
    failures = 0
    probe = None
    rows: list[tuple[str, Optional[dict[str, Any]]]] = []
    if dev == "cpu":
        from sandbox.slots import cpu_timing_note

        try:
            console.print(cpu_timing_note("eager and torch.compile", " (the sandbox's thread count; each in one block of its own runs)", blocks=False), highlight=False)
        except ValueError as exc:
            fail(str(exc))
    try:
        probe = get_probe(dev, store, measure=True)
        for path in paths:
            try:
                spec = with_device_sizes(read_spec(path, overrides), dev)
                console.print(f"[dim]timing {spec.name} ...[/]", highlight=False)
                result = measure_baseline(spec, dev, runs=runs, compile=not no_compile, probe=probe,
                                          numerics=numerics)
                published = published_for(spec, result)
                if published.get("available"):
                    result["published"] = published
                else:
                    result["published_missing"] = published.get("reason")
                store_baseline(store, spec, result)
            except Exception as exc:  # noqa: BLE001 - one broken task must not stop the others
                failures += 1
                detail = str(exc) if isinstance(exc, TaskError) else traceback.format_exc(limit=3)
                err_console.print(f"[red]{path}: {type(exc).__name__}: {detail}[/]", highlight=False)
                rows.append((str(path), None))
                continue
            rows.append((spec.name, result))
            if result["compile_error"]:
                err_console.print(f"[yellow]{spec.name}: torch.compile failed: {result['compile_error']}[/]",
                                  highlight=False)
    finally:
        store.close()
    table, notes = baseline_table(rows, f"baselines on {dev} · {numerics.describe()}", no_compile=no_compile)
    console.print(table)
    for line in notes:
        console.print(line, style="yellow" if "(!)" in line else "dim", highlight=False, markup=False)
    if probe is not None:
        rates = ", ".join(f"{k} {v:.2f}" for k, v in sorted(probe.tflops.items()))
        console.print(f"[dim]floor from probe of {probe.device_name}: {probe.bandwidth_gbps:.1f} GB/s; "
                      f"TFLOP/s {rates}[/]", highlight=False)
    if failures:
        raise typer.Exit(1)
