"""``--model builtin --backend triton``: the builtin's elementwise fusion groups as Triton kernels.

The same trace and plan as the C++/CUDA generator (``plan.make_plan`` in ``elementwise`` mode:
chains of elementwise operators between library operators; reductions and norms stay on
PyTorch here), each group one ``@triton.jit`` kernel over the flat index of its output: direct
operands are loaded at the index, one-element operands once, broadcast operands at the offset
their expanded strides give; every operator computes in float32 and the result is stored in the
output's type. Each sample of a round is another block size and warp count.

Only operators with a core ``tl`` form that Triton's interpreter also runs are generated
(``tl.exp``, ``tl.log``, ``tl.sqrt``, ``tl.erf``, ``tl.sin``/``cos``, ``tl.where``...): the
interpreter in Triton 3.9 has no ``libdevice``, so ``tanh`` is written with ``exp`` (and a series
near 0), and ``log1p``/``expm1``-based operators (elu, selu, softplus, mish, logsigmoid) and ``pow``
are left to PyTorch, with a comment saying so.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

from torch.fx import Node

from agent.builtin import pysource
from agent.builtin.codegen import HEADER_PREFIX, body_hash, emit_forward, render
from agent.builtin.kernels import KernelGroup
from agent.builtin.plan import make_plan

# (BLOCK, num_warps): the samples of a round, in order
VARIANTS = ((1024, 4), (2048, 8), (512, 4), (4096, 8), (256, 2))

_TANH = ("tl.where(tl.abs({a}) < 0.0625, {a} * (1.0 - {a} * {a} * (0.3333333333333333 - 0.13333333333333333 * {a} * {a})), "
         "1.0 - 2.0 / (tl.exp(2.0 * {a}) + 1.0))")
UNARY: dict[str, str] = {
    "relu": "tl.where({a} < 0.0, 0.0, {a})",
    "neg": "(-{a})",
    "copy": "({a})",
    "abs": "tl.abs({a})",
    "exp": "tl.exp({a})",
    "log": "tl.log({a})",
    "sqrt": "tl.sqrt({a})",
    "rsqrt": "(1.0 / tl.sqrt({a}))",
    "square": "({a} * {a})",
    "reciprocal": "(1.0 / {a})",
    "erf": "tl.erf({a})",
    "sigmoid": "(1.0 / (1.0 + tl.exp(-{a})))",
    "tanh": _TANH,
    "silu": "({a} / (1.0 + tl.exp(-{a})))",
    "gelu": "(0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476)))",
    "hardswish": "({a} * tl.minimum(tl.maximum({a} + 3.0, 0.0), 6.0) / 6.0)",
    "hardsigmoid": "(tl.minimum(tl.maximum({a} + 3.0, 0.0), 6.0) / 6.0)",
    "softsign": "({a} / (1.0 + tl.abs({a})))",
    "sin": "tl.sin({a})",
    "cos": "tl.cos({a})",
    "leaky_relu": "tl.where({a} > 0.0, {a}, {a} * {negative_slope})",
    # clamps keep NaN, as torch.clamp does
    "clamp_min": "tl.where({a} < {lo}, {lo}, {a})",
    "clamp_max": "tl.where({a} > {hi}, {hi}, {a})",
    "clamp": "tl.where({a} > {hi}, {hi}, tl.where({a} < {lo}, {lo}, {a}))",
    "hardtanh": "tl.where({a} > {hi}, {hi}, tl.where({a} < {lo}, {lo}, {a}))",
}
BINARY: dict[str, str] = {
    "add": "({a} + {b})",
    "sub": "({a} - {b})",
    "mul": "({a} * {b})",
    "div": "({a} / {b})",
    "maximum": "tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": "tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
}


def py_float(v: Any) -> str:
    """A float literal for a kernel; non-finite constants are not generated (KeyError)."""
    v = float(v)
    if not math.isfinite(v):
        raise KeyError(f"constant {v}")
    return repr(v)


def tl_expr(op: str, args: list[str], params: dict[str, Any]) -> str:
    """The Triton expression of one elementwise operator; KeyError where it has none here."""
    if op == "gelu_tanh":
        a = args[0]
        return f"(0.5 * {a} * (1.0 + {_TANH.format(a=f'(0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a}))')}))"
    p = {k: py_float(v) for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if op in ("add_alpha", "sub_alpha"):
        return f"({args[0]} {'+' if op == 'add_alpha' else '-'} {p['alpha']} * {args[1]})"
    if op == "cube":
        return f"({args[0]} * {args[0]} * {args[0]})"
    if op in BINARY:
        return BINARY[op].format(a=args[0], b=args[1])
    if op in UNARY:
        return UNARY[op].format(a=args[0], **p)
    raise KeyError(op)


class Untranslatable(KeyError):
    """One operator of a group has no Triton form here: it alone is left to PyTorch."""


class TritonGroup:
    """One elementwise fusion group as a Triton kernel and its Python launcher."""

    def __init__(self, kg: KernelGroup):
        if kg.kind != "ew":
            raise KeyError(f"{kg.kind} group")
        self.kg = kg
        self.rank = len(kg.p_shape)
        self.body = self._body()          # raises KeyError for an operator without a Triton form

    @property
    def kernel_name(self) -> str:
        return f"{self.kg.name}_kernel"

    def _operand(self, o: Any, loads: dict[int, str]) -> str:
        if isinstance(o, Node):
            return self.kg.var(o) if o in self.kg.members else loads[self.kg._input_of[o]]
        return py_float(o)

    def _body(self) -> list[str]:
        kg = self.kg
        lines: list[str] = []
        runs = [a for a in kg.accesses.values() if a.kind == "runs"]
        if runs:
            lines.append("rem = offs")
            for d in range(self.rank - 1, 0, -1):
                lines.append(f"c{d} = rem % size{d}")
                lines.append(f"rem = rem // size{d}")
            lines.append("c0 = rem")
        loads: dict[int, str] = {}
        for (k, _space), acc in sorted(kg.accesses.items()):
            name = f"v{k}"
            if acc.kind == "scalar":
                lines.append(f"{name} = tl.load(in{k}_ptr).to(tl.float32)")
            elif acc.kind == "direct":
                lines.append(f"{name} = tl.load(in{k}_ptr + offs, mask=mask).to(tl.float32)")
            else:
                off = " + ".join(f"c{d} * st{k}_{d}" for d in range(self.rank))
                lines.append(f"{name} = tl.load(in{k}_ptr + ({off}), mask=mask).to(tl.float32)")
            loads[k] = name
        for n in kg.nodes:
            info = kg.plan.infos[n]
            try:
                lines.append(f"{kg.var(n)} = {tl_expr(info.op, [self._operand(o, loads) for o in info.operands], info.params)}")
            except KeyError as exc:
                raise Untranslatable(n.name) from exc
        lines.append(f"tl.store(out_ptr + offs, {kg.var(kg.out_node)}, mask=mask)")
        return lines

    def _strided(self) -> list[int]:
        return sorted(k for (k, _s), a in self.kg.accesses.items() if a.kind == "runs")

    def kernel(self) -> str:
        ins = [f"in{i.index}_ptr" for i in self.kg.inputs]
        sizes = [f"size{d}" for d in range(1, self.rank)] if self._strided() else []
        strides = [f"st{k}_{d}" for k in self._strided() for d in range(self.rank)]
        params = ", ".join([*ins, "out_ptr", "n", *sizes, *strides, "BLOCK: tl.constexpr"])
        body = ["offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)", "mask = offs < n", *self.body]
        return "\n".join([f"# ---- {self.kg.name} begin", "@triton.jit", f"def {self.kernel_name}({params}):",
                          *("    " + b for b in body), f"# ---- {self.kg.name} end"])

    def launcher(self, block: int, warps: int) -> str:
        kg = self.kg
        args = [f"t{i.index}" for i in kg.inputs]
        space = ", ".join(f"t{k}.shape" for k in kg.space_inputs)
        lines = [f"# ---- {kg.name} begin", f"def _{kg.name}({', '.join(args)}):",
                 f'    """{kg.describe()}"""',
                 f"    sp = torch.broadcast_shapes({space}{',' if len(kg.space_inputs) == 1 else ''})",
                 f"    out = torch.empty(sp, device=t{kg.space_inputs[0]}.device, dtype={kg.out_dtype})",
                 "    n = out.numel()"]
        call = []
        for i in kg.inputs:
            acc = next(a for (k, _s), a in kg.accesses.items() if k == i.index)
            call.append(f"t{i.index}.contiguous()" if acc.kind in ("direct", "scalar") else f"t{i.index}")
        extra = []
        if self._strided():
            extra += [f"sp[{d}]" for d in range(1, self.rank)]
            for k in self._strided():
                lines.append(f"    e{k} = t{k}.expand(sp)")
                call[k] = f"e{k}"
                extra += [f"e{k}.stride({d})" for d in range(self.rank)]
        lines.append(f"    {self.kernel_name}[(triton.cdiv(n, {block}),)]({', '.join([*call, 'out', 'n', *extra])}, "
                     f"BLOCK={block}, num_warps={warps})")
        lines.append("    return out")
        lines.append(f"# ---- {kg.name} end")
        return "\n".join(lines)

    def python_call(self) -> list[str]:
        return [f"{pysource.var(self.kg.out_node)} = _{self.kg.name}({', '.join(i.py for i in self.kg.inputs)})"]


@dataclass
class TritonCandidate:
    source: str
    header: dict[str, Any]
    groups: list[TritonGroup]


def plan_groups(traced: Any, excluded: set[str], cuts: set[str] = frozenset()) -> tuple[Any, list[TritonGroup], set[str]]:
    """The elementwise plan (``cuts`` and ``excluded`` from the history: ``feedback.read_history``)
    and its Triton groups; an operator this generator cannot write is left to PyTorch and the plan
    made again."""
    excluded = set(excluded)
    for _ in range(64):
        plan = make_plan(traced, "elementwise", cuts, excluded)
        groups, bad = [], None
        for g in plan.groups:
            try:
                groups.append(TritonGroup(KernelGroup(plan, g)))
            except Untranslatable as exc:
                bad = {exc.args[0]}         # the operator alone; its neighbours stay fused
                break
            except (KeyError, ValueError):
                bad = {n.name for n in g.nodes}
                break
        if bad is None:
            return plan, groups, excluded
        excluded |= bad
    raise RuntimeError("no plan without untranslatable groups")


def render_triton(traced: Any, plan: Any, groups: list[TritonGroup], device: str, block: int, warps: int,
                  excluded: set[str], math_mode: Optional[str], cuts: set[str] = frozenset()) -> TritonCandidate:
    infos = plan.infos
    header = {"v": 1, "generator": "builtin", "backend": "triton", "device": device, "task": traced.spec.name,
              "precision": traced.precision, **({"math": math_mode} if math_mode else {}),
              "knobs": {"block": block, "warps": warps},
              "groups": [{"name": t.kg.name, "kind": t.kg.kind, "ops": t.kg.ops, "nodes": [n.name for n in t.kg.nodes],
                          "kinds": [infos[n].kind for n in t.kg.nodes]} for t in groups],
              "cuts": sorted(cuts),
              "excluded": sorted(excluded), "library": [infos[n].op for n in infos if infos[n].kind == "library"],
              "uncovered": sorted({infos[n].op for n in infos if infos[n].kind == "other"})}
    summary = [f"{t.kg.name}: Triton kernel fusing {t.kg.describe()} (nodes {', '.join(n.name for n in t.kg.nodes)})"
               for t in groups]
    left = sorted({infos[n].op for n in infos if n.name in excluded or (infos[n].fusible and infos[n].is_core)})
    if left:
        summary.append(f"Left on PyTorch (no Triton form here, or not elementwise): {', '.join(left)}.")
    if not groups:
        summary.append("Nothing could be fused: this candidate runs on PyTorch only.")
    source = render("candidate_triton.py.j2",
                    header=json.dumps(header, sort_keys=True, separators=(",", ":")), task_name=traced.spec.name,
                    summary=summary, prelude=pysource.task_prelude(traced.spec),
                    constants=pysource.constants_block(traced.constants),
                    kernels=[t.kernel() for t in groups], launchers=[t.launcher(block, warps) for t in groups],
                    layers=pysource.layers_class(traced.spec), forward=emit_forward(traced, plan, groups, None))
    return TritonCandidate(source=source, header=header, groups=groups)


def propose_triton(traced: Any, device: str, sample: int, history: list[Any], math_mode: Optional[str]) -> TritonCandidate:
    """The ``sample``-th variant not yet in ``history`` (all tried: the first, marked a repeat).
    The history is read as the C++/CUDA generator reads it (``feedback.read_history``): a group of
    a failed attempt that no correct attempt ran is narrowed (an elementwise chain halved, a single
    operator left to PyTorch), the one a compiler error's line or an error message names first."""
    from agent.builtin.feedback import read_history

    fb = read_history(history, device, traced.precision, math_mode)
    plan, groups, excluded = plan_groups(traced, set(fb.excluded), set(fb.cuts))
    seen = set(fb.seen)
    cuts = set(fb.cuts)
    fresh: list[TritonCandidate] = []
    for block, warps in VARIANTS:
        cand = render_triton(traced, plan, groups, device, block, warps, excluded, math_mode, cuts)
        h = body_hash(cand.source)
        if h not in seen and h not in {body_hash(c.source) for c in fresh}:
            fresh.append(cand)
    if len(fresh) > sample:
        return fresh[sample]
    cand = render_triton(traced, plan, groups, device, *VARIANTS[0], excluded, math_mode, cuts)
    cand.header["repeat"] = True
    lines = cand.source.split("\n")
    lines[0] = HEADER_PREFIX + json.dumps(cand.header, sort_keys=True, separators=(",", ":"))
    cand.source = "\n".join(lines)
    return cand
