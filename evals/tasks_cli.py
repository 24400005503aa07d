"""``kernelloop tasks``: list, show and check task files.

TASK and PATHS arguments take files, directories or bundled names (``seeds``,
``level1/relu``), as ``sandbox.tasks.discover`` expands them.
"""
from __future__ import annotations

import ast
import time
from pathlib import Path
from typing import Any, Optional

import typer

from kernelloop import pyast
from kernelloop.cli_common import (DbOption, DeviceOption, MathOption, PrecisionOption, SetOption, console, fail,
                                   resolve_device, resolve_numerics)
from sandbox.tasks import (CPU_PRESET_NAME, TaskError, TaskSpec, discover, load_task, parse_overrides,
                           read_spec, with_device_sizes)

app = typer.Typer(no_args_is_help=True, add_completion=False, help="List, show and check task files.")


@app.callback()
def _group(db: Optional[str] = DbOption) -> None:
    """``--db`` here holds for every tasks subcommand."""


PathsArgument = typer.Argument(None, help="task files, directories or bundled names [default: every bundled task]")

# Tensor methods that only reshape or move data; left out of the ops summary.
_SHAPE_METHODS = {"view", "reshape", "permute", "transpose", "contiguous", "clone", "detach", "size",
                  "t", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "chunk", "split",
                  "to", "float", "half", "type", "dim", "numel", "item", "unbind", "view_as"}
_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.MatMult: "matmul",
           ast.Pow: "pow", ast.FloorDiv: "floordiv"}
_FUNCTION_ROOTS = ({"torch"}, {"F"}, {"torch", "nn", "functional"}, {"nn", "functional"})


# --------------------------------------------------------------------------- static summary

def _dotted(node: ast.AST) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return list(reversed(parts))


def _model_class(tree: ast.Module) -> Optional[ast.ClassDef]:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)


def _submodule_types(cls: ast.ClassDef) -> dict[str, str]:
    """``self.conv = nn.Conv2d(...)`` -> {"conv": "Conv2d"}; parameters -> "param"."""
    types: dict[str, str] = {}
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return types
    for node in ast.walk(init):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
            continue
        for target in node.targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                name = _dotted(node.value.func)
                if name:
                    types[target.attr] = "param" if name[-1] == "Parameter" else name[-1]
    return types


class _OpCollector(ast.NodeVisitor):
    """Operations of ``forward`` in evaluation order (arguments before the call)."""

    def __init__(self, submodules: dict[str, str]):
        self.submodules = submodules
        self.ops: list[str] = []

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            self.visit(func.value)
        for arg in node.args:
            self.visit(arg)
        for kw in node.keywords:
            self.visit(kw.value)
        parts = _dotted(func)
        if len(parts) == 2 and parts[0] == "self":
            kind = self.submodules.get(parts[1], parts[1])
            if kind != "param":
                self.ops.append(kind)
        elif parts and set(parts[:-1]) in _FUNCTION_ROOTS:
            if parts[-1] not in _SHAPE_METHODS:
                self.ops.append(parts[-1])
        elif isinstance(func, ast.Attribute) and func.attr not in _SHAPE_METHODS:
            self.ops.append(func.attr)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        self.visit(node.left)
        self.visit(node.right)
        name = _BINOPS.get(type(node.op))
        if name:
            self.ops.append(name)


def ops_summary(source: str) -> str:
    """A one-line, statically read summary of ``Model.forward``: ``Conv2d → add → sigmoid → GroupNorm``."""
    try:
        tree = pyast.parse(source)
    except SyntaxError:
        return "?"
    cls = _model_class(tree)
    if cls is None:
        return "?"
    forward = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    if forward is None:
        return "?"
    collector = _OpCollector(_submodule_types(cls))
    for stmt in forward.body:
        collector.visit(stmt)
    runs: list[list[Any]] = []
    for op in collector.ops:
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " → ".join(op if n == 1 else f"{op}×{n}" for op, n in runs) or "—"


def module_sizes(source: str) -> dict[str, Any]:
    """Module-level constants with literal values (the task's sizes), in file order."""
    sizes: dict[str, Any] = {}
    try:
        tree = pyast.parse(source)
    except SyntaxError:
        return sizes
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        try:
            value = ast.literal_eval(node.value)
        except (ValueError, SyntaxError, TypeError):
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id != CPU_PRESET_NAME and not isinstance(value, dict):
                sizes[target.id] = value
    return sizes


def _sizes_cell(spec: TaskSpec) -> str:
    sizes = module_sizes(spec.source)
    cpu = with_device_sizes(TaskSpec(spec.name, spec.path, spec.source), "cpu").overrides
    cells = []
    for k, v in sizes.items():
        v = spec.overrides.get(k, v)
        cells.append(f"{k}={v}" + (f"→{cpu[k]}" if k in cpu and cpu[k] != v else ""))
    return ", ".join(cells)


# --------------------------------------------------------------------------- helpers

def _specs(paths: Optional[list[str]], overrides: Optional[dict[str, Any]] = None) -> list[TaskSpec]:
    try:
        return [read_spec(p, overrides) for p in discover(paths)]
    except TaskError as exc:
        fail(str(exc))


def _maybe_store(db: Optional[str]):
    """The store when one was named (``--db``/KERNELLOOP_DB) or the default file exists; else None."""
    from store.db import DEFAULT_DB

    if not db and not Path(DEFAULT_DB).is_file():
        return None
    from kernelloop.cli_common import open_store

    return open_store(db or None)


def _human(n: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def _memory_gate(dev: str, numerics: Any, store: Any) -> Any:
    """The sandbox's admission figures for ``dev`` (budgets, footprints), reading and writing ``store``."""
    import torch

    from sandbox.admission import MemoryGate
    from sandbox.evaluate import _device_name
    from sandbox.footprint import FootprintBook
    from sandbox.slots import visible_gpus

    book = FootprintBook()
    if store is not None:
        from store.repo import footprint_book

        book = footprint_book(store, _device_name(dev), torch.__version__)
    slots = max(1, len(visible_gpus())) if dev == "cuda" else 1
    return MemoryGate(dev, 1 if dev == "cpu" else slots, numerics, book)


def _reference_peak(fp: Any) -> str:
    """The reference trial's peak, and without the float64 run where that was measured apart."""
    from sandbox.footprint import human_bytes

    lean = fp.reference_peak_no_fp64_bytes
    return human_bytes(fp.reference_peak_bytes) + (
        f" ({human_bytes(lean)} without float64)" if lean is not None and lean != fp.reference_peak_bytes else "")


def _fits_how(gate: Any, spec: Any, fp: Any) -> str:
    """``yes``, and what its runs leave out or move to fit this device (``MemoryGate.plan``)."""
    planned, fp64 = gate.plan(spec, fp)
    how = []
    if getattr(gate.numerics, "fp64_check", False) and not fp64:
        how.append("without the float64 check")
    if planned.inputs_copy_on_host:
        how.append("the inputs' copy for the mutation check in host memory")
    return "yes" + (f", {' and '.join(how)}" if how else "")


def footprint_table(rows: list[tuple[str, Any, Optional[str]]], title: str) -> Any:
    """One row per task: its footprint's figures and whether it fits (``too_large`` and the bytes)."""
    from rich.table import Table

    from sandbox.footprint import human_bytes

    table = Table(title=title)
    for col in ("task", "inputs", "outputs", "params", "float64 copy", "forward peak", "reference peak",
                "candidate (est.)", "host / shm in transit", "fits"):
        table.add_column(col, justify="left" if col in ("task", "fits") else "right", overflow="fold")
    for name, fp, verdict in rows:
        table.add_row(name, human_bytes(fp.inputs_bytes), human_bytes(fp.outputs_bytes), human_bytes(fp.params_bytes),
                      human_bytes(fp.fp64_bytes), human_bytes(fp.forward_peak_bytes),
                      _reference_peak(fp), human_bytes(fp.candidate_peak_bytes),
                      f"{human_bytes(fp.host_transit_bytes)} / {human_bytes(fp.shm_bytes)}", verdict or "yes")
    return table


# --------------------------------------------------------------------------- commands

@app.command("list")
def list_command(paths: Optional[list[str]] = PathsArgument) -> None:
    """List tasks: name, the operations of forward, sizes (a→b: b on cpu)."""
    from rich.table import Table

    specs = _specs(paths)
    table = Table(title=f"{len(specs)} tasks", show_lines=False)
    table.add_column("task", no_wrap=True)
    table.add_column("ops")
    table.add_column("sizes (→ cpu)")
    for spec in specs:
        table.add_row(spec.name, ops_summary(spec.source), _sizes_cell(spec))
    console.print(table)


@app.command("show")
def show_command(task: str = typer.Argument(..., help="a task file or bundled name (level1/relu)"),
                 device: Optional[str] = DeviceOption, set_: Optional[list[str]] = SetOption,
                 db: Optional[str] = DbOption,
                 source: bool = typer.Option(True, "--source/--no-source", help="print the task's source")) -> None:
    """Show a task: source, sizes, input and output shapes, FLOPs, minimum bytes, roofline floor."""
    from rich.syntax import Syntax
    from rich.table import Table

    from hardware.counts import count_loaded
    from hardware.floors import floor_breakdown
    from sandbox.numerics import Numerics
    from store.probes import get_probe

    dev = resolve_device(device)
    try:
        overrides = parse_overrides(set_)
    except TaskError as exc:
        fail(str(exc))
    specs = _specs([task], overrides)
    if len(specs) != 1:
        fail(f"{task!r} names {len(specs)} tasks; show takes one (kernelloop tasks list {task})")
    spec = with_device_sizes(specs[0], dev)
    try:
        loaded = load_task(spec)
        counts = count_loaded(loaded, Numerics())
    except (TaskError, RuntimeError) as exc:
        fail(str(exc))

    console.print(f"[bold]{spec.name}[/]  {spec.path}", highlight=False)
    console.print(f"ops: {ops_summary(spec.source)}", highlight=False)
    console.print(f"sha256 {spec.sha256[:16]}  key {spec.key}  device {dev}", highlight=False)
    if source:
        console.print(Syntax(spec.source, "python", line_numbers=True))

    file_sizes = module_sizes(spec.source)
    explicit = set(overrides)
    sizes = Table(title="sizes")
    for col in ("name", "value", "from"):
        sizes.add_column(col)
    for k, v in file_sizes.items():
        if k in explicit:
            origin = "--set"
        elif k in spec.overrides and spec.overrides[k] != v:
            origin = f"{CPU_PRESET_NAME} (file: {v!r})"
        else:
            origin = "file"
        sizes.add_row(k, repr(spec.overrides.get(k, v)), origin)
    console.print(sizes)

    shapes = Table(title="tensors")
    for col in ("", "shape", "bytes"):
        shapes.add_column(col)
    for i, s in enumerate(counts.input_shapes):
        shapes.add_row(f"input {i}", str(s), "")
    for i, s in enumerate(counts.output_shapes):
        shapes.add_row(f"output {i}", str(s), "")
    for kind, n in counts.bytes_by_kind.items():
        shapes.add_row(kind, "", _human(n, "B"))
    console.print(shapes)
    by_dtype = ", ".join(f"{k} {_human(v, 'FLOP')}" for k, v in counts.flops_by_dtype.items()) or "none counted"
    console.print(f"FLOPs: {_human(counts.flops, 'FLOP')} ({by_dtype}); minimum bytes: "
                  f"{_human(counts.min_bytes, 'B')}; intensity {counts.arithmetic_intensity:.2f} FLOP/B; "
                  f"dtype {counts.dtype}", highlight=False)

    store = _maybe_store(db)
    try:
        probe = get_probe(dev, store, measure=False)
        footprint = None
        if store is not None:
            from store.repo import latest_footprint

            with store.reader() as s:
                footprint = latest_footprint(s, spec.key, dev, resolve_numerics(None, None).label)
    finally:
        if store is not None:
            store.close()
    if footprint is None:
        console.print(f"memory: not measured on {dev} (kernelloop tasks check --device {dev} {task})", highlight=False)
    else:
        from sandbox.footprint import human_bytes

        fp = footprint
        console.print(
            f"memory on {fp.device_name or dev} ({fp.numerics}): inputs {human_bytes(fp.inputs_bytes)}, outputs "
            f"{human_bytes(fp.outputs_bytes)}, params {human_bytes(fp.params_bytes)}, float64 copy "
            f"{human_bytes(fp.fp64_bytes)}, forward peak {human_bytes(fp.forward_peak_bytes)}, reference peak "
            f"{_reference_peak(fp)}, resident {human_bytes(fp.reference_resident_bytes)}, "
            f"candidate est. {human_bytes(fp.candidate_peak_bytes)}, host in transit "
            f"{human_bytes(fp.host_transit_bytes)}, shm {human_bytes(fp.shm_bytes)}; by {fp.measured_by}"
            + (f"; ran out of memory: {fp.oom}" if fp.oom else ""), highlight=False)
    if probe is None:
        console.print(f"floor: no probe cached for this device (kernelloop device probe --device {dev})",
                      highlight=False)
    else:
        fb = floor_breakdown(counts, probe, Numerics().tf32_classes(dev))
        bound = "memory" if fb["memory_ms"] >= fb["compute_ms"] else "compute"
        console.print(f"floor: {fb['floor_ms']:.4f} ms ({bound}-bound; memory {fb['memory_ms']:.4f} ms, "
                      f"compute {fb['compute_ms']:.4f} ms; probe of {probe.device_name}; {fb['arithmetic']})",
                      highlight=False)


@app.command("check")
def check_command(paths: Optional[list[str]] = PathsArgument, device: Optional[str] = DeviceOption,
                  set_: Optional[list[str]] = SetOption, precision: Optional[str] = PrecisionOption,
                  math: Optional[str] = MathOption, db: Optional[str] = DbOption,
                  memory: bool = typer.Option(True, "--memory/--no-memory",
                                              help="measure each task's memory needs (stored) and say whether it fits"),
                  remeasure: bool = typer.Option(False, "--remeasure",
                                                 help="measure every task's memory needs again, even where the store "
                                                      "has them for this device, torch and numerics"),
                  recheck: bool = typer.Option(False, "--recheck",
                                               help="run the degeneracy checks again, even where the store has "
                                                    "their verdict for this device, torch, numerics and checks"),
                  jobs: Optional[int] = typer.Option(None, "--jobs", min=1,
                                                     help="memory needs measured this many at a time, before the "
                                                          "checks (default 4 on cuda, 1 on cpu); one that runs out "
                                                          "of memory beside others is measured again alone")) -> None:
    """Flag degenerate tasks (constant, near-zero, insensitive outputs...) and tasks too large for
    the device's memory budget; exit code 1 when any is flagged. Memory needs and verdicts already
    in the store for this device, torch version and numerics are read, not measured or checked
    again (``--remeasure``, ``--recheck``): a check of KernelBench's 250 tasks stopped part way goes
    on where it stopped."""
    from rich.table import Table

    import evals.taskcheck as taskcheck
    from evals.taskcheck import FLAGS, CheckIssue
    from sandbox.failures import InfraFailure
    from sandbox.footprint import human_bytes

    dev = resolve_device(device)
    numerics = resolve_numerics(precision, math)
    try:
        overrides = parse_overrides(set_)
    except TaskError as exc:
        fail(str(exc))
    specs = _specs(paths, overrides)
    table = Table(title=f"task check on {dev} · {numerics.describe()}")
    for col in ("task", "flag", "detail"):
        table.add_column(col, no_wrap=col != "detail")
    flagged = 0
    seen_flags: set[str] = set()
    store = _maybe_store(db)
    gate = _memory_gate(dev, numerics, store) if memory else None
    footprints: list[tuple[str, Any, Optional[str]]] = []
    reused = done = checks_read = checks_run = 0
    interrupted = False
    where = None
    if store is not None:
        import torch

        from sandbox.evaluate import _device_name

        where = {"device": dev, "device_name": _device_name(dev), "torch_version": torch.__version__,
                 "numerics": numerics.label, "checker": taskcheck.checker_version()}

    def memory_issues(spec: Any) -> list[CheckIssue]:
        """The task's memory needs (read from the store, else measured and stored) and whether it fits."""
        nonlocal reused
        sized = with_device_sizes(spec, dev)
        fp = None if remeasure and sized.key not in ahead else gate.book.known(sized, dev, numerics)
        stored = fp is not None
        reused += stored and sized.key not in ahead
        try:
            fp = fp or gate.book.measure(sized, dev, numerics, env=gate.slot_env(0))
        except InfraFailure as exc:     # the harness's own failure: said, and the next task goes on
            return [CheckIssue(spec.name, "unchecked", f"its memory needs were not measured: {exc}")]
        except RuntimeError as exc:
            return [CheckIssue(spec.name, "runtime_error", str(exc))]
        if not stored:
            gate.book.remember(sized, dev, numerics, fp)       # stored through the book's store
        big = gate.too_large(sized, fp)
        footprints.append((spec.name, fp, big.reason if big else _fits_how(gate, sized, fp)))
        return [CheckIssue(spec.name, "too_large", big.reason)] if big is not None else []

    def measure_ahead(todo: list[Any], at_once: int) -> None:
        """Measure ``todo``'s unknown needs ``at_once`` at a time and store those that did not run
        out of memory (beside the others they may have: the task's own loop measures those again,
        alone). Each measuring worker reads its own allocator, so the others leave its figures be."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        sized = [with_device_sizes(spec, dev) for spec in todo]
        unknown = [sp for sp in sized if remeasure or gate.book.known(sp, dev, numerics) is None]
        if at_once < 2 or len(unknown) < 2:
            return
        console.print(f"measuring {len(unknown)} tasks' memory needs, {at_once} at a time", highlight=False)
        pool = ThreadPoolExecutor(at_once, thread_name_prefix="measure")
        try:
            futures = {pool.submit(gate.book.measure, sp, dev, numerics, env=gate.slot_env(0)): sp for sp in unknown}
            for n, future in enumerate(as_completed(futures), 1):
                sp = futures[future]
                try:
                    fp = future.result()
                except Exception:  # noqa: BLE001 - the task's own loop measures it again and says why
                    continue
                if fp.oom is None:
                    ahead.add(sp.key)
                    gate.book.remember(sp, dev, numerics, fp)   # stored through the book's store
                if n % 25 == 0:
                    console.print(f"  measured {n} of {len(unknown)}", highlight=False)
        except KeyboardInterrupt:
            from sandbox.process import kill_all_workers

            pool.shutdown(wait=False, cancel_futures=True)
            kill_all_workers()
            raise
        pool.shutdown()

    def degeneracy_issues(spec: Any) -> list[CheckIssue]:
        """The degeneracy checks' verdict: read from the store, else run and stored (an
        ``unchecked`` one, the harness's failure, is not stored)."""
        nonlocal checks_read, checks_run
        sized = with_device_sizes(spec, dev)
        if store is not None and not recheck:
            with store.reader() as s:
                stored = latest_task_check(s, sized.key, where)
            if stored is not None:
                checks_read += 1
                return [CheckIssue(**row) for row in stored]
        t0 = time.monotonic()
        issues = taskcheck.check_task(spec, dev, numerics=numerics)
        checks_run += 1
        if store is not None and not any(i.flag == "unchecked" for i in issues):
            with store.session() as s:
                save_task_check(s, sized, where, [i.to_dict() for i in issues], time.monotonic() - t0)
        return issues

    if store is not None:
        from store.repo import latest_task_check, save_task_check
    ahead: set[str] = set()         # task keys measured (and stored) by measure_ahead
    try:
        if gate is not None:
            measure_ahead(specs, jobs or (4 if dev == "cuda" else 1))
        for spec in specs:
            t0, read_before = time.monotonic(), checks_read
            issues = memory_issues(spec) if gate is not None else []
            if not issues:
                issues = degeneracy_issues(spec)
            done += 1
            if issues:
                flagged += 1
            for issue in issues:
                seen_flags.add(issue.flag)
                table.add_row(spec.name, issue.flag, issue.message.splitlines()[0] if issue.message else "")
            if len(specs) > 1:      # a line per task as it ends: KernelBench's 250 take about half an hour on a GPU
                verdict = ", ".join(sorted({i.flag for i in issues})) or "ok"
                how = ", verdict read from the store" if checks_read > read_before else ""
                console.print(f"[{done}/{len(specs)}] {spec.name}: {verdict} ({time.monotonic() - t0:.1f} s{how})",
                              highlight=False)
    except KeyboardInterrupt:
        interrupted = True
    if store is not None:
        store.close()
    if footprints:
        budgets = ", ".join(f"{k} {human_bytes(v)}" for k, v in gate.admission.budgets.items())
        console.print(footprint_table(footprints, f"memory on {dev} · {numerics.label} · budgets: {budgets}"))
        console.print(f"memory needs: {len(footprints) - reused} measured now, {reused} read from the store "
                      f"(--remeasure measures them again)", highlight=False)
    if store is not None and checks_read + checks_run:
        console.print(f"degeneracy checks: {checks_run} run now, {checks_read} verdicts read from the store "
                      f"(--recheck runs them again)", highlight=False)
    if flagged:
        console.print(table)
        for flag in sorted(seen_flags):
            console.print(f"  {flag}: {FLAGS.get(flag, '')}", highlight=False)
    if interrupted:
        console.print(f"[bold yellow]interrupted after {done} of {len(specs)} tasks ({flagged} flagged); run it again: "
                      f"the memory needs and verdicts found so far are read from the store, not found again[/]",
                      highlight=False)
        raise typer.Exit(130)
    if flagged:
        console.print(f"[bold red]{flagged} of {len(specs)} tasks flagged[/]", highlight=False)
        raise typer.Exit(1)
    console.print(f"[green]{len(specs)} tasks checked on {dev} ({numerics.label}): none flagged[/]", highlight=False)
