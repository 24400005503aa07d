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
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node
from torch.utils._python_dispatch import TorchDispatchMode

from agent.builtin import conv, pool
from agent.builtin.exact_bits import gives_pytorch_bits, node_gives_pytorch_bits
from agent.builtin.norm_nhwc import NormChannelsLast, apply_on_view, copies_for
from agent.builtin.ops import ModuleAttr
from agent.builtin.plan import resolve_alias
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
# plan mode: each catalogue operator in torch
# --------------------------------------------------------------------------------------
def _t(v: Any, like: torch.Tensor) -> torch.Tensor:
    return v if torch.is_tensor(v) else torch.tensor(float(v), dtype=like.dtype)


_EW: dict[str, Callable[..., torch.Tensor]] = {
    "relu": lambda a, p: torch.relu(a), "neg": lambda a, p: -a, "copy": lambda a, p: a.clone(), "abs": lambda a, p: a.abs(),
    "exp": lambda a, p: a.exp(), "log": lambda a, p: a.log(), "log1p": lambda a, p: a.log1p(),
    "expm1": lambda a, p: a.expm1(), "sqrt": lambda a, p: a.sqrt(), "rsqrt": lambda a, p: a.rsqrt(),
    "square": lambda a, p: a * a, "cube": lambda a, p: a * a * a, "reciprocal": lambda a, p: 1.0 / a,
    "erf": lambda a, p: torch.erf(a), "sigmoid": lambda a, p: torch.sigmoid(a), "tanh": lambda a, p: a.tanh(),
    "silu": lambda a, p: F.silu(a), "gelu": lambda a, p: F.gelu(a),
    "gelu_tanh": lambda a, p: F.gelu(a, approximate="tanh"), "mish": lambda a, p: F.mish(a),
    "hardswish": lambda a, p: F.hardswish(a), "hardsigmoid": lambda a, p: F.hardsigmoid(a),
    "selu": lambda a, p: F.selu(a), "logsigmoid": lambda a, p: F.logsigmoid(a),
    "softsign": lambda a, p: F.softsign(a), "sin": lambda a, p: a.sin(), "cos": lambda a, p: a.cos(),
    "leaky_relu": lambda a, p: F.leaky_relu(a, p["negative_slope"]),
    "elu": lambda a, p: F.elu(a, p["alpha"]),
    "softplus": lambda a, p: F.softplus(a, p["beta"], p["threshold"]),
    "clamp_min": lambda a, p: a.clamp_min(p["lo"]), "clamp_max": lambda a, p: a.clamp_max(p["hi"]),
    "clamp": lambda a, p: a.clamp(p["lo"], p["hi"]), "hardtanh": lambda a, p: a.clamp(p["lo"], p["hi"]),
}
_BIN: dict[str, Callable[[Any, Any], torch.Tensor]] = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "pow": lambda a, b: a ** b,
    "maximum": lambda a, b: torch.maximum(*_pair(a, b)), "minimum": lambda a, b: torch.minimum(*_pair(a, b)),
}


def _pair(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    like = a if torch.is_tensor(a) else b
    return _t(a, like), _t(b, like)


def _plan_ew(op: str, args: list[Any], params: dict[str, Any]) -> torch.Tensor:
    if op == "masked_fill":
        return args[0].masked_fill(args[1].bool(), params["value"])
    if op in ("add_alpha", "sub_alpha"):
        b = args[1] * params["alpha"]
        return args[0] + b if op == "add_alpha" else args[0] - b
    if op in _BIN:
        return _BIN[op](args[0], args[1])
    if op in _EW:
        return _EW[op](args[0], params)
    raise KeyError(f"no plan-mode emulation of {op}")


def _plan_reduce(op: str, x: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    dims, keep = list(params["dims"]), bool(params["keepdim"])
    if op == "softmax":
        return torch.softmax(x, dims[0])
    if op == "log_softmax":
        return torch.log_softmax(x, dims[0])
    fn = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin,
          "logsumexp": torch.logsumexp}[op]
    return fn(x, dim=dims, keepdim=keep)


def _plan_norm(op: str, vals: list[Any], params: dict[str, Any], flags: tuple) -> torch.Tensor:
    x, eps = vals[0], params["eps"]
    rest = vals[1:]
    if op == "layer_norm":
        w = rest.pop(0) if params.get("weight") else None
        b = rest.pop(0) if params.get("bias") else None
        return F.layer_norm(x, x.shape[x.dim() - params["nd"]:], w, b, eps)
    w, b = (rest[0], rest[1]) if params.get("affine") else (None, None)
    rest = rest[2:] if params.get("affine") else rest
    if op in ("group_norm", "instance_norm"):
        def norm(t: torch.Tensor) -> torch.Tensor:
            if op == "group_norm":
                return F.group_norm(t, params["groups"], w, b, eps)
            return F.instance_norm(t, weight=w, bias=b, eps=eps)
        # on the view (N, *spatial, C): the norm of its logical tensor, back on the view (norm_nhwc.py)
        return apply_on_view(norm, x, copies=True) if params.get("channels_last") else norm(x)
    # batch_norm, as the kernel computes it: the batch's statistics when use_batch, the
    # running ones otherwise; with update, running = (1 - f) running + f stat (unbiased var)
    use_batch, update, factor = flags
    rm, rv = (rest[0], rest[1]) if params.get("track") else (None, None)
    cdim = x.dim() - 1 if params.get("channels_last") else 1      # (N, *spatial, C) on the view
    dims = [d for d in range(x.dim()) if d != cdim]
    shape = [-1 if d == cdim else 1 for d in range(x.dim())]
    if use_batch or rm is None:
        mean = x.mean(dims)
        var = x.var(dims, unbiased=False)
        if update and rm is not None:
            count = x.numel() // x.shape[cdim]
            unbiased = var * (count / (count - 1)) if count > 1 else var
            rm.mul_(1 - factor).add_(factor * mean.to(rm.dtype))
            rv.mul_(1 - factor).add_(factor * unbiased.to(rv.dtype))
    else:
        mean, var = rm.to(x.dtype), rv.to(x.dtype)
    y = (x - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + eps)
    if w is not None:
        y = y * w.to(x.dtype).reshape(shape) + b.to(x.dtype).reshape(shape)
    return y


# --------------------------------------------------------------------------------------
# the emulated extension
# --------------------------------------------------------------------------------------
class _Emulated:
    """Stands in for the compiled extension: ``kl_gN(*tensors[, use_batch, update, factor])``."""

    def __init__(self, groups: list[Any], infos: dict[Node, Any], modes: dict[str, str]):
        self.groups = {c.kg.name: c.kg for c in groups}
        self.infos = infos
        self.modes = modes                  # group name -> plan | exact | torch (default torch)
        self.model: Optional[nn.Module] = None

    def __getattr__(self, name: str) -> Callable[..., torch.Tensor]:
        kg = self.__dict__["groups"].get(name)
        if kg is None:
            raise AttributeError(name)
        return lambda *args: self._run(kg, list(args))

    def _run(self, kg: Any, args: list[Any]) -> Any:
        if kg.kind == "recurrent":          # recurrent.RnnKernel: called with (x, state, weights)
            return kg.replay(args, self.model, self.modes.get(kg.name, "torch"))
        n_in = len(kg.inputs)
        tensors, flags = args[:n_in], tuple(args[n_in:])
        mode = self.modes.get(kg.name, "torch")
        if mode in ("plan", "exact"):
            return self._plan(kg, tensors, flags, wide=mode == "plan")
        return self._torch(kg, tensors, flags)

    def _plan(self, kg: Any, tensors: list[torch.Tensor], flags: tuple, wide: bool = True) -> torch.Tensor:
        """The plan's computation: in float64, rounded once at the end (``wide``), or operator by
        operator in the tensors' own dtype (``exact`` mode: what a kernel that rounds each
        operator's result to float computes, for the groups ``exact_bits.gives_pytorch_bits`` keeps)."""
        if kg.kind == "attention":          # attention.AttnKernel: its own float64 emulation
            return kg.emulate(tensors)
        first = next(t for t, i in zip(tensors, kg.inputs) if isinstance(i.value, Node))
        out_dtype = first.dtype
        by_key = {(i.value.key if isinstance(i.value, ModuleAttr) else i.value): t
                  for i, t in zip(kg.inputs, tensors)}
        env: dict[Node, torch.Tensor] = {}

        def val(o: Any, widen: bool = True) -> Any:
            if isinstance(o, Node):
                v = env[o] if o in env else by_key[o]
            elif isinstance(o, ModuleAttr):
                v = by_key[o.key]
            else:
                return o
            return v.double() if wide and widen and v.is_floating_point() else v

        infos = kg.plan.infos          # the plan's classification (conv=direct: its conv cores)
        for n in kg.nodes:
            info = infos[n]
            if info.kind == "ew":
                env[n] = _plan_ew(info.op, [val(o) for o in info.operands], info.params)
            elif info.kind == "reduce":
                env[n] = _plan_reduce(info.op, val(info.operands[0]), info.params)
            elif info.kind == "pool":
                env[n] = pool.emulate(info, val(info.operands[0]))
            elif info.kind == "conv":
                ops = [val(o) for o in info.operands]
                env[n] = conv.emulate(info, ops[0], ops[1], ops[2] if len(ops) > 2 else None)
            else:
                # running buffers are updated in place, in their own dtype
                vals = [val(o, widen=not (isinstance(o, ModuleAttr) and o.attr.startswith("running_")))
                        for o in info.operands]
                env[n] = _plan_norm(info.op, vals, info.params, flags)
        return env[kg.out_node].to(out_dtype)

    def _torch(self, kg: Any, tensors: list[torch.Tensor], flags: tuple) -> torch.Tensor:
        by_node = {i.value: t.clone() if torch.is_tensor(t) else t      # (a scale passed as a float)
                   for i, t in zip(kg.inputs, tensors) if isinstance(i.value, Node)}
        by_attr = {i.value.key: t for i, t in zip(kg.inputs, tensors) if isinstance(i.value, ModuleAttr)}
        env: dict[Node, Any] = {}

        def load(a: Any) -> Any:
            if isinstance(a, Node):
                if a in env:
                    return env[a]
                if a in by_node:
                    return by_node[a]
                src = resolve_alias(a, self.infos)
                return env[src] if src in env else by_node[src]
            if isinstance(a, (list, tuple)):
                return type(a)(load(x) for x in a)
            if isinstance(a, dict):
                return {k: load(v) for k, v in a.items()}
            return a

        for n in kg.nodes:
            args, kwargs = load(n.args), load(n.kwargs)
            if n.op == "call_module":
                plan = getattr(kg, "plan", None)          # (an attention or recurrent kernel has none)
                wrapped = plan.traced.modules.get(str(n.target)) if plan is not None else None
                if isinstance(wrapped, NormChannelsLast):       # on the channels-last view (norm_nhwc.py)
                    mod = self.model.get_submodule(wrapped.path)
                    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                        fn = lambda t: self._torch_bn(mod, wrapped.path, t, by_attr, flags)    # noqa: E731
                    else:
                        fn = mod
                    env[n] = apply_on_view(fn, args[0], copies_for(mod))
                    continue
                mod = self.model.get_submodule(str(n.target))
                if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                    env[n] = self._torch_bn(mod, str(n.target), args[0], by_attr, flags)
                else:
                    env[n] = mod(*args, **kwargs)
            elif n.op == "call_method":
                env[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
            else:
                env[n] = n.target(*args, **kwargs)
        return env[kg.out_node]

    @staticmethod
    def _torch_bn(mod: nn.Module, path: str, x: torch.Tensor, by_attr: dict[str, torch.Tensor],
                  flags: tuple) -> torch.Tensor:
        """nn.BatchNorm's own call, with the flags the candidate's forward computed (it counts
        ``num_batches_tracked`` itself)."""
        use_batch, update, factor = flags
        rm, rv = by_attr.get(f"{path}.running_mean"), by_attr.get(f"{path}.running_var")
        if use_batch and not update:
            rm = rv = None
        return F.batch_norm(x, rm, rv, mod.weight, mod.bias, bool(use_batch), float(factor), mod.eps)


# --------------------------------------------------------------------------------------
# running the candidate with the emulation
# --------------------------------------------------------------------------------------
def _candidate_class(source: str, ext: _Emulated) -> type:
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

    ext = _Emulated(setup.groups, setup.infos, modes)
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
