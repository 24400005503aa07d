"""``kernelloop eval TASK CANDIDATE.py``: one evaluation, printed."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from kernelloop.cli_common import (BackendOption, DeviceOption, MathOption, PrecisionOption, SetOption, console, fail,
                                   resolve_device, resolve_kernel_backend, resolve_numerics)


def _ms(t) -> str:
    return f"{t.median_ms:.4g} ms (IQR {t.iqr_ms:.3g}, n={t.runs})" if t else "-"


def print_result(r) -> None:
    console.print(f"[bold]{r.task}[/] on {r.device} ({r.device_name}), torch {r.torch_version}: "
                  f"[bold]{r.status.value}[/] in {r.seconds:.1f} s", highlight=False)
    console.print(f"numerics {r.config.numerics.describe()}", highlight=False)
    if r.build:
        b = r.build
        console.print(f"build: {'ok' if b.ok else 'failed'} in {b.seconds:.1f} s{' (cached)' if b.cached else ''}"
                      + (f"; first error (candidate line {b.first_error_line}): {b.first_error}" if b.first_error else ""),
                      highlight=False)
    if r.error_message:
        console.print(f"error: {r.error_type}: {r.error_message}", highlight=False)
    if r.infra:
        console.print("the harness failed, not the candidate: no verdict (left out of every rate; "
                      "optimize --resume evaluates it again)", highlight=False)
    for i, cause in enumerate(r.infra_retries, 1):
        console.print(f"harness failure {i}, retried: {cause}", highlight=False)
    failed = r.first_failed_trial()
    if failed is not None:
        console.print(f"trial {failed.index}: {failed.reason}", highlight=False)
    elif r.trials:
        console.print(f"{len(r.trials)} trial(s) passed", highlight=False)
        rescued = max((o.outside_tolerance for t in r.trials for o in t.outputs), default=0)
        if rescued:
            console.print(f"float64 rule: up to {rescued} element(s) of an output were outside the tolerance of the "
                          f"reference but no farther from its float64 run than {r.config.numerics.elem_factor:g}x "
                          f"the reference's own largest error (KernelBench's check alone would fail them)",
                          highlight=False)
    if r.candidate_time:
        console.print(f"[{r.config.numerics.label}] candidate {_ms(r.candidate_time)} · eager {_ms(r.eager_time)} · torch.compile "
                      f"{_ms(r.compile_time)}", highlight=False)
        if r.speedup_eager is not None:     # none where a timed run failed its check
            console.print(f"speedup vs eager {r.speedup_eager:.3f}x"
                          + (f", vs torch.compile {r.speedup_compile:.3f}x" if r.speedup_compile else "")
                          + (f"; roofline floor {r.floor_ms:.4g} ms ({r.floor_fraction:.1%} of it reached)"
                             if r.floor_ms else ""), highlight=False)
    if r.compile_within_tolerance is False:
        err = f" (largest difference {r.compile_max_abs_error:.2g})" if r.compile_max_abs_error is not None else ""
        console.print(f"torch.compile's own output is outside the tolerance of eager's{err}: the speedup vs "
                      f"torch.compile is quoted against a baseline KernelBench's check would refuse", highlight=False)
    if r.compile_fp64_note:
        console.print(f"torch.compile's own output fails the float64 rule applied to candidates ({r.compile_fp64_note}): "
                      f"a candidate computing so would be flagged inaccurate", highlight=False)
    if r.timed_runs_checked:
        console.print(f"timed runs checked: {r.timed_runs_checked} of {r.config.timed_runs} (a secret sample of "
                      f"each output against the reference)"
                      + (f"; reference timed again {r.reference_retimed}x (its time jumped)" if r.reference_retimed else ""),
                      highlight=False)
    if r.containment:
        console.print(f"containment: {r.containment}; processes it left running, killed: {r.stray_processes_killed}"
                      + (f" ({'; '.join(r.stray_processes[:3])})" if r.stray_processes else ""), highlight=False)
    for f in r.flags:
        console.print(f"[yellow]flag {f.kind.value}[/]: {f.reason}", highlight=False)
    if r.profile:
        table = Table(title="candidate profile")
        for col in ("kernel / op", "count", "us", "share", "own"):
            table.add_column(col)
        for k in r.profile[:12]:
            table.add_row(k.name[:90], str(k.count), f"{k.total_us:.1f}", f"{k.share:.1%}", "yes" if k.own else "")
        console.print(table)


def print_build_check(c) -> None:
    console.print(f"[bold]{c.task}[/] on {c.device}" + (f" (arch {c.arch})" if c.arch else "")
                  + f", torch {c.torch_version}: [bold]{'built' if c.ok else c.status.value}[/] in {c.seconds:.1f} s",
                  highlight=False)
    b = c.build
    if b and b.first_error:
        console.print(f"first error (candidate line {b.first_error_line}): {b.first_error}", highlight=False)
    elif c.error_message:
        console.print(f"error: {c.error_type}: {c.error_message}", highlight=False)
    if b and b.extensions:
        console.print(f"extensions: {', '.join(b.extensions)}{' (cached)' if b.cached else ''}", highlight=False)
    for note in (b.notes if b else []):
        console.print(f"note: {note}", highlight=False)
    for f in c.flags:
        console.print(f"[yellow]flag {f.kind.value}[/]: {f.reason}", highlight=False)


def eval_spec(task: str, set_: Optional[list[str]], device: str):
    """The one task ``task`` names, at ``device``'s sizes under the ``--set`` overrides, loaded once
    to check it (raises ``sandbox.tasks.TaskError`` naming the cause); ``eval`` and ``kernelloop
    mcp``'s evaluate judge this spec."""
    from sandbox.tasks import TaskError, discover, load_task, parse_overrides, read_spec, with_device_sizes

    paths = discover([task])
    if len(paths) != 1:
        raise TaskError(f"{task!r} names {len(paths)} task files; name one")
    spec = with_device_sizes(read_spec(paths[0], parse_overrides(set_)), device)
    load_task(spec)
    return spec


def eval_command(task: str = typer.Argument(..., help="task file or bundled name (e.g. seeds/conv2d_divide_leakyrelu)"),
                 candidate: Path = typer.Argument(..., exists=True, dir_okay=False, help="candidate module defining ModelNew"),
                 device: Optional[str] = DeviceOption,
                 set_: Optional[list[str]] = SetOption,
                 trials: int = typer.Option(5, "--trials", min=1),
                 timed_runs: int = typer.Option(20, "--timed-runs", min=1),
                 no_compile: bool = typer.Option(False, "--no-compile", help="skip timing the reference under torch.compile"),
                 build_only: bool = typer.Option(False, "--build-only",
                                                 help="scan and build the candidate, run nothing (needs no GPU for "
                                                      "--device cuda: nvcc and a CUDA build of torch suffice)"),
                 arch: Optional[str] = typer.Option(None, "--arch", help="CUDA architecture to build for (e.g. 9.0a); "
                                                    "default: KERNELLOOP_CUDA_ARCH, else the visible GPU's"),
                 precision: Optional[str] = PrecisionOption,
                 math: Optional[str] = MathOption,
                 kernel_backend: Optional[str] = BackendOption,
                 as_json: bool = typer.Option(False, "--json", help="print the EvalResult (BuildCheck) as JSON")) -> None:
    """Build, check and time one candidate against its task (in isolated worker processes)."""
    from sandbox.evaluate import Sandbox, evaluate
    from sandbox.result import EvalConfig
    from sandbox.tasks import TaskError

    if arch and device is None:
        device = "cuda"                 # an architecture names a CUDA build
    if arch and device == "cpu":
        fail("--arch names a CUDA architecture; it does not apply to --device cpu")
    dev = resolve_device(device, gpu_needed=not build_only)
    numerics = resolve_numerics(precision, math)
    try:
        spec = eval_spec(task, set_, dev)
    except TaskError as exc:
        fail(str(exc))
    config = EvalConfig(trials=trials, timed_runs=timed_runs, time_compile=not no_compile, numerics=numerics,
                        backend=resolve_kernel_backend(kernel_backend, dev))
    if build_only:
        try:
            sandbox = Sandbox(dev, config, arch=arch)
        except ValueError as exc:
            fail(str(exc))
        with sandbox:
            check = sandbox.build_only(spec, candidate.read_text())
        if as_json:
            print(json.dumps(check.model_dump(mode="json"), indent=2))
        else:
            print_build_check(check)
        raise typer.Exit(0 if check.ok else 1)
    result = evaluate(spec, candidate.read_text(), dev, config, arch=arch)
    if as_json:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        print_result(result)
    raise typer.Exit(0 if result.correct else 1)
