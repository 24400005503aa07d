"""Replay a generated candidate's plan in eager PyTorch before it is proposed (no compiler).

The candidate's own Python (its ``forward``: the library calls, the running-buffer updates of
batch norm, every statement between the kernels) runs for real; each generated kernel
``_ext.kl_gN`` is replaced by an emulation of its group, in one of two modes:

* ``plan``: what the kernel computes, read from the plan (the operator catalogue's ``OpInfo``
  of every node: its canonical op, operands and parameters; batch norm with the batch's own
  statistics and the running-buffer update the kernel performs), computed in float64 and
  rounded once to the output's dtype, as a correctly rounded kernel would;
* ``torch``: the group's original FX nodes, called as the reference calls them (its modules,
  functions and methods, in the tensors' own dtype): PyTorch's own bits.

Two checks use it, on the CPU at the task's CPU sizes (the published sizes for KernelBench),
with both models built as the sandbox builds them (same seed, training mode, no ``eval()``):

1. **Semantics** (float64): the candidate with every group in ``plan`` mode against the
   reference, outputs *and* state (running means and variances, ``num_batches_tracked``)
   after the forward. A group whose plan is not the reference's computation (a reduction over
   the wrong dims, eval-mode batch norm, a missed buffer update, an in-place alias, dropout
   taken for an identity) is found by replaying it alone in ``plan`` mode, and left to PyTorch.
2. **Verifiability** (the run's precision): the candidate with every group in ``plan`` mode
   must pass the judge's rule (the tolerance, or the float64 rule where it applies) against the
   reference. A reference whose output is dominated by its own rounding (EfficientNetB2 at
   batch 2: its batch norms normalise over two values each, and the float32 reference is 0.9
   from its own float64 run; PyTorch itself, on one thread instead of two, misses it by 0.4)
   accepts nothing but PyTorch's own bits. Then only kernels that compute PyTorch's own bits
   are kept (``exact_bits.gives_pytorch_bits``): elementwise chains and max pools of two or more nodes
   whose every operator either selects a value (relu, clamp, max, neg, max pooling) or is one
   IEEE-754 operation on float32 operands (add, sub, mul, div: correctly rounded in PyTorch's
   kernels and in ours alike), with no multiply and add in one kernel (nvcc, and GCC in the
   AVX-512 clone of a CPU kernel, contract them into an FMA, which rounds once where PyTorch
   rounds twice). The nodes of every other group are left to PyTorch, the candidate is rendered
   again without them (a batch norm's epilogue, ``out += identity; relu``, becomes a group of its
   own), and the kept kernels are replayed operator by operator in float32 (``exact`` mode)
   against the judge's rule before they stay.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.fx import Node
from torch.utils._python_dispatch import TorchDispatchMode

from agent.builtin.exact_bits import gives_pytorch_bits, node_gives_pytorch_bits
from agent.builtin.replay_emulated import Emulated
from agent.builtin.rng import isolated_rng

# activations summed over every node of a CPU trace, above which the replay is not run (its
# forwards would cost seconds each on a small CPU)
MAX_ELEMENTS = 32_000_000
# the same, for a replay at a reduced batch (``agent.builtin._affordable_trace``): the largest
# level-3 models (ResNet101 at batch 2: 45M parameters, 113M activation elements) take about a
# minute and 1.8 GB on 2 cores, once per task
MAX_REDUCED_ELEMENTS = 192_000_000
MAX_GROUP_PROBES = 64
MAX_RERENDERS = 8          # renderings that look for the kernels that give PyTorch's bits (ill-conditioned)
_EXT_LINE = "_ext = _build()"


@dataclass
class Verdict:
    """What the replay found: node names to leave to PyTorch, and why."""

    excluded: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    semantic: list[str] = field(default_factory=list)        # groups whose plan is not the reference's
    unverifiable: list[str] = field(default_factory=list)    # groups the judge could only fail
    ref_fp64_rel_rms: Optional[float] = None
    ran: bool = False
    # the reference accepts only PyTorch's own bits (check 2 failed with correctly rounded kernels)
    ill_conditioned: bool = False
    # then, the kernels kept because they give PyTorch's bits: their operators, joined by "+", and how many
    exact: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ran": self.ran}
        if self.semantic:
            out["semantic"] = self.semantic
        if self.unverifiable:
            out["unverifiable"] = self.unverifiable
        if self.exact:
            out["exact"] = dict(self.exact)
        if self.ref_fp64_rel_rms is not None:
            out["ref_fp64_rel_rms"] = float(f"{self.ref_fp64_rel_rms:.3g}")
        return out


# --------------------------------------------------------------------------------------
# running the candidate with the emulation
# --------------------------------------------------------------------------------------
def _candidate_class(source: str, ext: Emulated) -> type:
    if _EXT_LINE not in source:
        raise ValueError("the candidate does not build its extension with _ext = _build()")
    text = source.replace(_EXT_LINE, "_ext = __kl_replay_ext__")
    ns: dict[str, Any] = {"__name__": "kl_replay_candidate", "__kl_replay_ext__": ext}
    exec(compile(text, "kl_replay_candidate.py", "exec"), ns)
    return ns["ModelNew"]


@dataclass
class _Setup:
    task: Any
    numerics: Any
    source: str
    groups: list[Any]
    infos: dict[Node, Any]
    tf32: set[str] = field(default_factory=set)     # op classes the target runs in TF32


# --------------------------------------------------------------------------------------
# TF32 on the CPU: what cuDNN (convolutions) and cuBLAS (matmuls) do to float32 operands
# --------------------------------------------------------------------------------------
_TF32_OPS = {
    "conv": ("convolution.default", "_convolution.default", "conv1d.default", "conv2d.default",
             "conv3d.default", "conv_transpose1d.default", "conv_transpose2d.input",
             "conv_transpose3d.input"),
    "matmul": ("mm.default", "addmm.default", "bmm.default", "baddbmm.default", "matmul.default",
               "linear.default"),
}


def to_tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) rounded to TF32's 10-bit mantissa, to nearest (ties away), as tensor cores
    read their operands; products and sums stay float32 (the CPU's)."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


class _TF32(TorchDispatchMode):
    """Float32 convolutions and/or matmuls (``classes``: ``Numerics.tf32_classes``) with their
    tensor operands rounded to TF32 first: the target's rounding, on the CPU."""

    def __init__(self, classes: set[str]):
        super().__init__()
        self.names = {n for c in classes for n in _TF32_OPS.get(c, ())}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func._opname}.{func._overloadname}"
        if name in self.names:
            def rnd(a: Any) -> Any:
                return to_tf32(a) if torch.is_tensor(a) and a.dtype == torch.float32 else a
            args = tuple(rnd(a) for a in args)
        return func(*args, **kwargs)


def _tf32_mode(setup: "_Setup", wide: bool):
    import contextlib

    return _TF32(setup.tf32) if setup.tf32 and not wide else contextlib.nullcontext()


def _run(setup: _Setup, modes: dict[str, str], wide: bool, seed: int = 1) -> tuple[list[Any], dict[str, Any]]:
    """The candidate's outputs and state after one forward (``wide``: model and inputs in float64)."""
    from sandbox.harness import flatten_outputs, make_inputs, make_model

    ext = Emulated(setup.groups, setup.infos, modes)
    cls = _candidate_class(setup.source, ext)
    with isolated_rng():        # seed, weights, inputs and forward with no other thread's draws between
        model = make_model(cls, setup.task, seed, "cpu", setup.numerics)
        return _forward(model, ext, setup, wide, seed, flatten_outputs, make_inputs)


def _reference(setup: _Setup, wide: bool, seed: int = 1) -> tuple[list[Any], dict[str, Any]]:
    from sandbox.harness import flatten_outputs, make_inputs, make_model

    with isolated_rng():
        model = make_model(setup.task.Model, setup.task, seed, "cpu", setup.numerics)
        return _forward(model, None, setup, wide, seed, flatten_outputs, make_inputs)


def _forward(model, ext, setup, wide, seed, flatten_outputs, make_inputs):
    if wide:
        model = model.double()
    if ext is not None:
        ext.model = model
    inputs = make_inputs(setup.task, seed, "cpu", setup.numerics)
    if wide:
        inputs = [x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs]
    with torch.no_grad(), isolated_rng(), _tf32_mode(setup, wide):
        out = model(*inputs)
    outs = [o.detach() if torch.is_tensor(o) else o for o in flatten_outputs(out)]
    return outs, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    if not torch.is_tensor(a):
        return a == b
    if not torch.is_tensor(b) or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True))


def _same(ref: tuple[list[Any], dict[str, Any]], got: tuple[list[Any], dict[str, Any]],
          rtol: float = 1e-5) -> Optional[str]:
    """Where a float64 replay departs from the reference (None: nowhere). The tolerance is far
    above float64 rounding, even amplified a million times by an ill-conditioned reference, and
    far below what a different computation gives."""
    (ro, rs), (go, gs) = ref, got
    scale = max([float(a.abs().max()) for a in ro if torch.is_tensor(a) and a.is_floating_point() and a.numel()] + [1.0])
    atol = rtol * scale
    if len(ro) != len(go):
        return f"{len(go)} outputs, the reference {len(ro)}"
    for i, (a, b) in enumerate(zip(ro, go)):
        if not _close(a, b, rtol, atol):
            return f"output {i}"
    for k, v in rs.items():
        if k not in gs or not _close(v, gs[k], rtol, atol):
            return f"state {k}"
    return None


def _judged(ref32: list[Any], ref64: list[Any], got: list[Any], numerics: Any) -> bool:
    """Whether outputs ``got`` pass the judge's rule against the float32 reference: the tolerance,
    or the float64 rule where it applies (``sandbox.compare``)."""
    from sandbox.compare import fp64_bounds

    tol = numerics.tolerance
    bounds = fp64_bounds(ref32, ref64, numerics) if numerics.fp64_check else [None] * len(ref32)
    for i, (r, o) in enumerate(zip(ref32, got)):
        if not torch.is_tensor(r):
            if r != o:
                return False
            continue
        if not torch.is_tensor(o) or o.shape != r.shape:
            return False
        rd, od = r.double().reshape(-1), o.double().reshape(-1)
        bad = ~((od - rd).abs() <= tol.atol + tol.rtol * rd.abs())
        bad &= ~(torch.isnan(rd) & torch.isnan(od))
        if bool(bad.any()) and i < len(bounds) and bounds[i] is not None:
            bad = bounds[i].still_bad(0, rd.numel(), od, bad, tol)
        if bool(bad.any()):
            return False
    return True


def _rel_rms(ref32: list[Any], ref64: list[Any]) -> Optional[float]:
    worst = None
    for r, x in zip(ref32, ref64):
        if torch.is_tensor(r) and r.is_floating_point() and torch.is_tensor(x) and r.numel():
            d, s = (r.double() - x).pow(2).sum().item(), x.double().pow(2).sum().item()
            v = math.sqrt(d / s) if s else math.sqrt(d)
            worst = v if worst is None else max(worst, v)
    return worst


def affordable(traced: Any, limit: Optional[int] = None) -> bool:
    """Whether the replay's forwards are cheap enough at the CPU trace's sizes (``limit``
    elements, default ``MAX_ELEMENTS``)."""
    # parameters and buffers count too: the replay holds the models in float32 and float64 (a
    # level-2 GEMM's 67M weights took 4 GB and 17 s at published sizes)
    total = sum(t.numel() for t in (*traced.gm.parameters(), *traced.gm.buffers()))
    for n in traced.gm.graph.nodes:
        if n.op == "call_method" and n.target == "permute":
            continue        # a view, no memory of its own (the channels-last graph's, layout.py)
        tm = n.meta.get("tensor_meta")
        if hasattr(tm, "shape"):
            total += math.prod(int(s) for s in tm.shape)
    return total <= (MAX_ELEMENTS if limit is None else limit)


def check(traced: Any, rendered: Any, infos: dict[Node, Any], numerics: Any, device: str = "cpu",
          limit: Optional[int] = None,
          rerender: Optional[Callable[[frozenset], tuple[Any, dict[Node, Any]]]] = None) -> Verdict:
    """Both checks of the module docstring on a candidate rendered from the CPU trace ``traced``,
    for a run on ``device``: where that device runs float32 convolutions or matmuls in TF32
    (``Numerics.tf32_classes``: cuDNN convolutions under PyTorch's default math), the float32
    forwards of the verifiability check round those operands to TF32 as the target does, for
    the reference and the candidate alike (the candidate's library calls are the reference's).
    ``rerender(excluded)``: the same candidate rendered with the nodes named in ``excluded`` left
    to PyTorch, and its plan's ``infos`` (without it, an ill-conditioned reference keeps only the
    groups of ``rendered`` that give PyTorch's bits as they stand)."""
    from sandbox.numerics import Numerics
    from sandbox.tasks import load_task

    numerics = numerics if numerics is not None else Numerics()
    verdict = Verdict()
    groups = list(rendered.groups)
    if not groups:
        return verdict
    if not affordable(traced, limit):
        verdict.notes.append("replay: not run (the task's CPU sizes are too large for it)")
        return verdict
    setup = _Setup(load_task(traced.spec), numerics, rendered.source, groups, infos,
                   set(numerics.tf32_classes(device)))
    # a group that calls another's kernel (codegen.share_kernels) is that kernel's: blamed with it
    shared = rendered.shared
    names = [c.kg.name for c in groups if c.kg.name not in shared]
    nodes_of: dict[str, list[str]] = {}
    for c in groups:
        nodes_of.setdefault(shared.get(c.kg.name, c.kg.name), []).extend(n.name for n in c.kg.nodes)
    verdict.ran = True
    # 1. semantics, in float64
    ref = _reference(setup, wide=True)
    if _same(ref, _run(setup, {n: "plan" for n in names}, wide=True)) is not None:
        if _same(ref, _run(setup, {}, wide=True)) is not None:
            verdict.semantic = names
            verdict.notes.append("replay: the candidate's forward departs from the reference in float64 even with "
                                 "PyTorch in every group; nothing is fused")
        else:
            for name in names[:MAX_GROUP_PROBES]:
                where = _same(ref, _run(setup, {name: "plan"}, wide=True))
                if where is not None:
                    verdict.semantic.append(name)
                    verdict.notes.append(f"replay: {name} ({_describe(groups, name)}) is not the reference's "
                                         f"computation in float64 ({where} differs): left to PyTorch")
    for name in verdict.semantic:
        verdict.excluded.update(nodes_of[name])
    rest = [n for n in names if n not in verdict.semantic]
    if not rest:
        return verdict
    # 2. verifiability, in the run's precision
    ref32, _ = _reference(setup, wide=False)
    ref64 = ref[0]
    verdict.ref_fp64_rel_rms = _rel_rms(ref32, ref64)
    if _judged(ref32, ref64, _run(setup, {n: "plan" for n in rest}, wide=False)[0], numerics):
        return verdict
    # A correctly rounded kernel fails: the reference accepts (nearly) nothing but PyTorch's own
    # bits. Only kernels that give those bits stay (exact_bits.gives_pytorch_bits).
    verdict.ill_conditioned = True
    kept = _pytorch_bits_only(setup, verdict, groups, infos, rest, nodes_of, ref32, ref64, rerender)
    verdict.unverifiable = [n for n in rest if not set(nodes_of[n]) <= kept]
    for name in verdict.unverifiable:
        verdict.excluded.update(set(nodes_of[name]) - kept)
    rms = f"{verdict.ref_fp64_rel_rms:.3g}" if verdict.ref_fp64_rel_rms is not None else "?"
    note = (f"replay: the reference is ill-conditioned in {numerics.precision} (relative RMS {rms} from its own float64 "
            f"run): with correctly rounded kernels the candidate already fails the judge's rule, so every group that "
            f"rounds ({', '.join(verdict.unverifiable)}) stays on PyTorch, whose bits the reference accepts")
    if verdict.exact:
        note += ("; kernels that give PyTorch's bits (selections and single IEEE operations) stay: "
                 + ", ".join(f"{ops} x{k}" if k > 1 else ops for ops, k in sorted(verdict.exact.items())))
    verdict.notes.append(note)
    return verdict


def _pytorch_bits_only(setup: _Setup, verdict: Verdict, groups: list[Any], infos: dict[Node, Any],
                       rest: list[str], nodes_of: dict[str, list[str]], ref32: list[Any], ref64: list[Any],
                       rerender: Optional[Callable[[frozenset], tuple[Any, dict[Node, Any]]]]) -> set[str]:
    """For an ill-conditioned reference: the node names of ``rest``'s groups that keep a kernel,
    in groups that give PyTorch's own bits (``verdict.exact`` records them). With ``rerender``, the
    nodes that round (a batch norm, a sum) are left to PyTorch and the candidate is rendered
    again, so the chains around them form groups of their own (ResNet's ``bn3 -> add -> relu``
    was one norm group: ``add -> relu`` remains); groups that still do not give PyTorch's bits
    are left to PyTorch in turn. The kept kernels are then replayed operator by operator in
    float32 (``exact`` mode) and must pass the judge's rule, or none is kept."""
    members = {n for name in rest for n in nodes_of[name]}
    if rerender is None:
        names = {n for n in rest if gives_pytorch_bits(next(c.kg for c in groups if c.kg.name == n), infos)}
        keep = [c for c in groups if getattr(c, "fn", c.kg.name) in names]      # (with those sharing their kernels)
        cand_setup, outside = setup, set()
    else:
        excluded = frozenset(verdict.excluded | {n.name for c in groups for n in c.kg.nodes
                                                 if n.name in members and not node_gives_pytorch_bits(n, infos[n])})
        keep = []
        try:
            for _ in range(MAX_RERENDERS):
                r, r_infos = rerender(excluded)
                bad: set[str] = set()
                for c in r.groups:
                    if not gives_pytorch_bits(c.kg, r_infos):
                        # its nodes that round, else all of them (a lone node; a multiply beside an add)
                        rounding = {n.name for n in c.kg.nodes if not node_gives_pytorch_bits(n, r_infos[n])}
                        bad |= rounding or {n.name for n in c.kg.nodes}
                if not bad:
                    keep = list(r.groups)
                    break
                excluded |= bad
        except Exception as exc:  # noqa: BLE001 - then every group stays on PyTorch, as without this search
            verdict.notes.append(f"replay: the kernels that give PyTorch's bits were not searched "
                                 f"({type(exc).__name__}: {str(exc)[:200]})")
            return set()
        cand_setup = _Setup(setup.task, setup.numerics, r.source, keep, r_infos, setup.tf32) if keep else setup
        # (nodes in no group of ``rest`` that the renderings left to PyTorch: the proposal leaves them too)
        outside = set(excluded) - members - verdict.excluded
    if not keep:
        return set()
    try:
        passed = _judged(ref32, ref64, _run(cand_setup, {c.kg.name: "exact" for c in keep}, wide=False)[0],
                         setup.numerics)
    except Exception as exc:  # noqa: BLE001 - an emulation that cannot run vouches for nothing
        verdict.notes.append(f"replay: the kernels that give PyTorch's bits could not be replayed "
                             f"({type(exc).__name__}: {str(exc)[:200]}): every group stays on PyTorch")
        return set()
    if not passed:
        verdict.notes.append("replay: the kernels that give PyTorch's bits, replayed operator by operator in float32, "
                             "still fail the judge's rule: every group stays on PyTorch")
        return set()
    verdict.excluded |= outside
    for c in keep:
        ops = "+".join(c.kg.ops)
        verdict.exact[ops] = verdict.exact.get(ops, 0) + 1
    return {n.name for c in keep for n in c.kg.nodes}


def _describe(groups: list[Any], name: str) -> str:
    return next(c.kg.describe() for c in groups if c.kg.name == name)
