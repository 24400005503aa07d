"""The emulated extension of the replay (``agent.builtin.replay``): each generated kernel
``_ext.kl_gN`` replaced by its group computed in ``plan`` mode (the operator catalogue's reading,
in float64 rounded once, or operator by operator in float32: ``exact``) or in ``torch`` mode (the
group's original FX nodes: PyTorch's own bits)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from agent.builtin import conv, pool
from agent.builtin.norm_nhwc import NormChannelsLast, apply_on_view, copies_for
from agent.builtin.ops import ModuleAttr
from agent.builtin.plan import resolve_alias


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
class Emulated:
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
