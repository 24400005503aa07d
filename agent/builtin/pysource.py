"""The Python side of a generated candidate: the task's prelude, ``_Layers`` and ``forward``.

``_Layers`` is the reference's ``Model`` class with its ``forward`` removed and renamed,
so that ``ModelNew(_Layers)`` builds exactly the same submodules and parameters in the
same order (``torch.manual_seed(s); ModelNew(*init)`` draws the same weights as the
reference). The candidate never instantiates or calls ``Model``: ``forward`` is written
from the traced graph, with generated kernels in place of the fused groups.
"""
from __future__ import annotations

import ast
import builtins
import math
import operator
import threading
from typing import Any, Callable, Optional

import torch
from torch.fx import Node
from torch.fx.node import _get_qualified_name

from agent.builtin.ops import ASSERT_DEFAULT
from kernelloop import pyast
from sandbox.tasks import TaskSpec

SKIP_TOP = {"Model", "get_inputs", "get_init_inputs", "CPU_SIZES"}
_INFIX = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
          operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
          operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
          operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
          operator.le: "<=", operator.gt: ">", operator.ge: ">="}
_UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~"}


class SourceError(Exception):
    pass


def _model_class(tree: ast.Module) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            return node
    raise SourceError("the task defines no class Model")


def _names_in(node: ast.AST) -> set[str]:
    """Names a definition reads from its module (loads, minus what it binds itself)."""
    loads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    bound |= {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
    return loads - bound


def _defined_names(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


# task_prelude and layers_class depend on the task's source and overrides only, but are asked for
# every variant the proposer renders (up to ~150 per proposal where no variant has a kernel of its
# own): their parses and unparses were two thirds of a proposal's time. Strings: shared safely.
_SOURCE_CACHE: dict[tuple[str, str, str], str] = {}
_SOURCE_CACHE_LOCK = threading.Lock()


def _cached(kind: str, spec: TaskSpec, make: Callable[[TaskSpec], str]) -> str:
    key = (kind, spec.source, repr(sorted(spec.overrides.items())))
    with _SOURCE_CACHE_LOCK:
        text = _SOURCE_CACHE.get(key)
    if text is None:
        text = make(spec)
        with _SOURCE_CACHE_LOCK:
            if len(_SOURCE_CACHE) >= 256:
                _SOURCE_CACHE.clear()
            _SOURCE_CACHE[key] = text
    return text


def task_prelude(spec: TaskSpec) -> str:
    """Imports and the module-level definitions the reference's class needs (sizes overridden)."""
    return _cached("prelude", spec, _task_prelude)


def _task_prelude(spec: TaskSpec) -> str:
    tree = pyast.parse(spec.source)
    model = _model_class(tree)
    needed = _names_in(model)
    stmts = [s for s in tree.body if not (_defined_names(s) & SKIP_TOP) and s is not model]
    # close over dependencies of kept definitions
    keep: list[ast.stmt] = []
    changed = True
    chosen: set[int] = set()
    while changed:
        changed = False
        for i, s in enumerate(stmts):
            if i in chosen:
                continue
            if isinstance(s, (ast.Import, ast.ImportFrom)) or (_defined_names(s) & needed):
                chosen.add(i)
                needed |= _names_in(s)
                changed = True
    for i, s in enumerate(stmts):
        if i not in chosen:
            continue
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) \
                and s.targets[0].id in spec.overrides:
            s = ast.Assign(targets=s.targets, value=pyast.parse(repr(spec.overrides[s.targets[0].id]),
                                                                mode="eval").body, lineno=s.lineno)
        keep.append(s)
    return "\n".join(ast.unparse(s) for s in keep)


class _RenameModel(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id == "Model":
            return ast.copy_location(ast.Name(id="_Layers", ctx=node.ctx), node)
        return node


def _strip_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body or [ast.Pass()]


def layers_class(spec: TaskSpec) -> str:
    """The reference class without forward, renamed ``_Layers`` (its __init__ unchanged)."""
    return _cached("layers", spec, _layers_class)


def _layers_class(spec: TaskSpec) -> str:
    tree = pyast.parse(spec.source)
    model = _model_class(tree)
    cls = _RenameModel().visit(pyast.parse(ast.unparse(model)).body[0])
    cls.name = "_Layers"
    body = [s for s in _strip_docstring(cls.body)
            if not (isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == "forward")]
    for s in body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            s.body = _strip_docstring(s.body)
    cls.body = body or [ast.Pass()]
    cls.decorator_list = []
    return ast.unparse(ast.fix_missing_locations(cls))


def reference_forward(spec: TaskSpec) -> str:
    """The reference's forward (renamed references), for the candidate of an untraceable model."""
    tree = pyast.parse(spec.source)
    model = _RenameModel().visit(_model_class(tree))
    for s in model.body:
        if isinstance(s, ast.FunctionDef) and s.name == "forward":
            s.body = _strip_docstring(s.body)
            return ast.unparse(ast.fix_missing_locations(s))
    raise SourceError("the task's Model has no forward")


# --------------------------------------------------------------------------------------
# forward emission
# --------------------------------------------------------------------------------------
def var(node: Node) -> str:
    if node.op == "placeholder":
        return str(node.target).lstrip("*")     # the forward's own argument name (node.name may differ)
    return f"v_{node.name}"


def attr_path(path: str, root: str = "self") -> str:
    out = root
    for part in path.split("."):
        out += f".{part}" if part.isidentifier() else f"[{int(part)}]" if part.isdigit() else f"getattr({out}, {part!r})"
    return out


def fmt(value: Any) -> str:
    """A Python expression for a graph argument."""
    if isinstance(value, Node):
        return var(value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    if isinstance(value, torch.Size):
        return f"torch.Size([{', '.join(fmt(v) for v in value)}])"
    if isinstance(value, tuple):
        inner = ", ".join(fmt(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{fmt(k)}: {fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return f"slice({fmt(value.start)}, {fmt(value.stop)}, {fmt(value.step)})"
    if value is Ellipsis:
        return "..."
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, (torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, complex):
        return repr(value)
    raise SourceError(f"cannot write the argument {value!r} as Python")


def _call_args(args: tuple, kwargs: dict) -> str:
    parts = [fmt(a) for a in args] + [f"{k}={fmt(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def function_name(target: Callable) -> str:
    if target is getattr:
        return "getattr"
    name = _get_qualified_name(target)
    module, _, attr = name.rpartition(".")
    if module in ("builtins",) or (hasattr(builtins, attr) and getattr(builtins, attr) is target):
        return attr
    if module in ("_operator", "operator"):
        return f"operator.{attr}"
    if module.startswith("torch"):
        return name
    if module == "math":
        return name
    # a helper defined in the task module (copied into the prelude)
    return attr


def pytorch_statement(node: Node, constants: dict[str, torch.Tensor]) -> str:
    """The Python statement that computes a node on PyTorch."""
    lhs = var(node)
    if node.op == "get_attr":
        if node.target in constants:
            return f"{lhs} = _CONSTANTS[{node.target!r}]"
        return f"{lhs} = {attr_path(node.target)}"
    if node.op == "call_module":
        return f"{lhs} = {attr_path(node.target)}({_call_args(node.args, node.kwargs)})"
    if node.op == "call_method":
        obj, *rest = node.args
        return f"{lhs} = {fmt(obj)}.{node.target}({_call_args(tuple(rest), node.kwargs)})"
    if node.op == "call_function":
        t = node.target
        if t in _INFIX and len(node.args) == 2 and not node.kwargs:
            return f"{lhs} = {fmt(node.args[0])} {_INFIX[t]} {fmt(node.args[1])}"
        if t in _UNARY and len(node.args) == 1 and not node.kwargs:
            return f"{lhs} = {_UNARY[t]}{fmt(node.args[0])}"
        if t is ASSERT_DEFAULT and t is not None and len(node.args) == 2:
            # a parameter traced with its default None (trace._defaults_left): any other value is refused
            return (f"if {fmt(node.args[0])} is not None: raise ValueError({node.args[1]!r} + ': the candidate "
                    "was generated for the forward as get_inputs() calls it')")
        if t is operator.getitem and len(node.args) == 2:
            idx = node.args[1]
            inner = ", ".join(fmt(i) if not isinstance(i, slice) else _slice(i) for i in idx) \
                if isinstance(idx, tuple) and idx else (_slice(idx) if isinstance(idx, slice) else fmt(idx))
            return f"{lhs} = {fmt(node.args[0])}[{inner}]"
        return f"{lhs} = {function_name(t)}({_call_args(node.args, node.kwargs)})"
    raise SourceError(f"cannot write node {node.name} ({node.op})")


def _slice(s: slice) -> str:
    def p(v: Any) -> str:
        return "" if v is None else fmt(v)
    text = f"{p(s.start)}:{p(s.stop)}"
    if s.step is not None:
        text += f":{p(s.step)}"
    return text


def signature(placeholders: list[Node]) -> str:
    parts = ["self"]
    for p in placeholders:
        target = str(p.target)
        if target.startswith("*"):
            parts.append(target)
        elif p.args:
            parts.append(f"{target}={fmt(p.args[0])}")
        else:
            parts.append(target)
    return ", ".join(parts)


def constants_block(constants: dict[str, torch.Tensor]) -> Optional[str]:
    if not constants:
        return None
    lines = ["_CONSTANTS = {"]
    for name, t in constants.items():
        lines.append(f"    {name!r}: torch.tensor({t.tolist()!r}, dtype={t.dtype}),")
    lines.append("}")
    # each constant is copied to a device once, not on every call (a host-to-device copy from
    # pageable memory waits for the stream)
    lines += ["_ON_DEVICE = {}", "", "",
              "def _kl_constant(name, device):",
              "    key = (name, str(device))",
              "    if key not in _ON_DEVICE:",
              "        _ON_DEVICE[key] = _CONSTANTS[name].to(device)",
              "    return _ON_DEVICE[key]"]
    return "\n".join(lines)
