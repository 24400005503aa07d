"""Loading KernelBench-format task files.

A task file is an unchanged KernelBench module: ``class Model``, ``get_inputs()``,
``get_init_inputs()`` and module-level size constants. kernelloop adds one optional
constant, ``CPU_SIZES`` (a dict of size overrides that make the task run in seconds
on the ``cpu`` target). Size overrides are written into the module's globals before
``get_inputs``/``get_init_inputs`` are called, so unchanged files can be shrunk.

Every file is executed in a namespace of its own (never imported into ``sys.modules``),
so two tasks that share a module name never collide.
"""
from __future__ import annotations

import ast
import hashlib
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kernelloop import pyast
REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")
CPU_PRESET_NAME = "CPU_SIZES"


class TaskError(Exception):
    """A task file that cannot be used; the message names the file and the cause."""


@dataclass(frozen=True)
class TaskSpec:
    """A task as data: what travels between processes and into the store."""

    name: str                      # e.g. "seeds/gemm_sigmoid_gemm_logsumexp"
    path: str
    source: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def key(self) -> str:
        """Identifies the task *and* its sizes (source hash plus overrides)."""
        ov = ",".join(f"{k}={self.overrides[k]!r}" for k in sorted(self.overrides))
        return hashlib.sha256(f"{self.sha256}|{ov}".encode()).hexdigest()[:16]


@dataclass
class LoadedTask:
    spec: TaskSpec
    namespace: dict[str, Any]

    @property
    def Model(self) -> type:
        return self.namespace["Model"]

    def get_inputs(self) -> list:
        return list(self.namespace["get_inputs"]())

    def get_init_inputs(self) -> list:
        return list(self.namespace["get_init_inputs"]())

    @property
    def cpu_sizes(self) -> dict[str, Any]:
        return dict(self.namespace.get(CPU_PRESET_NAME) or {})


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """Parse ``--set name=value`` items; values are Python literals (``16``, ``1e-3``, ``(3, 3)``)."""
    result: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise TaskError(f"size override {item!r} is not of the form name=value")
        name, raw = item.split("=", 1)
        name = name.strip()
        if not name.isidentifier():
            raise TaskError(f"size override {item!r}: {name!r} is not a Python name")
        try:
            result[name] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError) as exc:
            raise TaskError(f"size override {item!r}: value is not a Python literal ({exc})") from None
    return result


def task_name_for(path: Path, root: Path | None = None) -> str:
    path = path.resolve()
    if root is not None:
        try:
            return path.relative_to(root.resolve()).with_suffix("").as_posix()
        except ValueError:
            pass
    return f"{path.parent.name}/{path.stem}"


def read_spec(path: str | Path, overrides: dict[str, Any] | None = None,
              name: str | None = None) -> TaskSpec:
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"task file {p} does not exist")
    try:
        source = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"task file {p} cannot be read: {exc}") from None
    if name is None:
        from kernelloop.paths import tasks_dir
        name = task_name_for(p, tasks_dir())
    return TaskSpec(name=name, path=str(p), source=source, overrides=dict(overrides or {}))


def with_device_sizes(spec: TaskSpec, device: str) -> TaskSpec:
    """On ``cpu`` the task's CPU_SIZES preset applies, under any explicit overrides."""
    if device != "cpu":
        return spec
    preset = _cpu_preset_of(spec)
    if not preset:
        return spec
    merged = {**preset, **spec.overrides}
    return TaskSpec(name=spec.name, path=spec.path, source=spec.source, overrides=merged)


def _cpu_preset_of(spec: TaskSpec) -> dict[str, Any]:
    """Read CPU_SIZES statically (no execution) so presets are known before loading."""
    try:
        tree = pyast.parse(spec.source, filename=spec.path)
    except SyntaxError:
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:   # CPU_SIZES: dict[...] = {...}
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == CPU_PRESET_NAME for t in targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "dict":
                    try:
                        return {kw.arg: ast.literal_eval(kw.value) for kw in node.value.keywords}
                    except ValueError:
                        return {}
                return {}
            return dict(value) if isinstance(value, dict) else {}
    return {}


def exec_source(source: str, filename: str, module_name: str = "kernelloop_task") -> dict[str, Any]:
    """Execute module source in a fresh namespace, as if it were a module named ``module_name``."""
    namespace: dict[str, Any] = {"__name__": module_name, "__file__": filename, "__builtins__": __builtins__}
    code = compile(source, filename, "exec")
    exec(code, namespace)
    return namespace


def load_task(spec: TaskSpec, validate: bool = True) -> LoadedTask:
    """Execute the task file in its own namespace, apply overrides, and validate it."""
    where = spec.path
    try:
        namespace = exec_source(spec.source, where)
    except SyntaxError as exc:
        raise TaskError(f"task {where}: syntax error at line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - any failure of the task module is reported
        raise TaskError(f"task {where}: executing the file raised {type(exc).__name__}: {exc}") from None
    missing = [n for n in REQUIRED_NAMES if n not in namespace]
    if missing:
        raise TaskError(f"task {where}: missing {', '.join(missing)} "
                        f"(a KernelBench task defines Model, get_inputs and get_init_inputs)")
    unknown = [k for k in spec.overrides if k not in namespace]
    if unknown:
        raise TaskError(f"task {where}: size override(s) {', '.join(unknown)} name no module-level constant")
    namespace.update(spec.overrides)
    task = LoadedTask(spec=spec, namespace=namespace)
    if validate:
        _validate(task)
    return task


def count_task(spec: TaskSpec, device: str, numerics: Any = None) -> Any:
    """The task's FLOP and byte counts (``hardware.counts.RooflineCounts``) at the sizes used on
    ``device`` (CPU_SIZES apply on cpu), in the precision of ``numerics`` (default fp32)."""
    from hardware.counts import count_loaded
    from sandbox.numerics import Numerics

    return count_loaded(load_task(with_device_sizes(spec, device)), numerics or Numerics())


def _call(task: LoadedTask, fn: Callable[[], list], what: str) -> list:
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001
        tb = traceback.format_exc(limit=3)
        raise TaskError(f"task {task.spec.path}: {what}() raised {type(exc).__name__}: {exc}\n{tb}") from None
    return value


def _validate(task: LoadedTask) -> None:
    import torch

    if not isinstance(task.Model, type) or not issubclass(task.Model, torch.nn.Module):
        raise TaskError(f"task {task.spec.path}: Model is not a torch.nn.Module subclass")
    init = _call(task, task.get_init_inputs, "get_init_inputs")
    if not isinstance(init, (list, tuple)):
        raise TaskError(f"task {task.spec.path}: get_init_inputs() must return a list")
    with torch.device("meta"):
        inputs = _call(task, task.get_inputs, "get_inputs")
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise TaskError(f"task {task.spec.path}: get_inputs() must return a non-empty list")


def discover(paths: list[str] | None) -> list[Path]:
    """Expand files, directories and bundled names (``seeds``, ``level1/relu``) into task files."""
    from kernelloop.paths import tasks_dir

    root = tasks_dir()
    out: list[Path] = []
    for raw in paths or [str(root)]:
        p = Path(raw)
        if not p.exists():
            bundled = root / raw
            if bundled.is_dir():
                p = bundled
            elif bundled.with_suffix(".py").is_file():
                p = bundled.with_suffix(".py")
            else:
                raise TaskError(f"no task file or directory {raw!r} (nor a bundled task of that name under {root})")
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*.py")
                              if not f.name.startswith("_") and "__pycache__" not in f.parts))
        else:
            out.append(p)
    seen: set[Path] = set()
    unique = []
    for f in out:
        r = f.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(f)
    return unique
