"""The operator catalogue of the builtin generator: which FX nodes it fuses, and how.

Every node of a traced reference is classified as one of

* ``ew``      an elementwise operator with a C expression (fusible anywhere), computed in float;
* ``reduce``  a reduction over one contiguous run of dimensions (sum, mean, amax, amin,
              logsumexp, softmax, log_softmax) - the *core* of a fusion group;
* ``norm``    GroupNorm, LayerNorm, InstanceNorm, BatchNorm - also a core;
* ``pool``    2-D or 3-D max/avg pooling that ``pool.py`` matches (classified there, not here) - a core;
* ``conv``    a small-K convolution that ``conv.py`` matches, under the ``conv`` knob's ``direct``
              only (the plan's classification, not this one's) - a core;
* ``alias``   an identity (nn.Identity, dropout with p=0, ``contiguous``, ``detach``) - no code;
* ``library`` a library operator (GEMM, convolution, pooling) - stays on PyTorch on purpose;
* ``plumb``   shape plumbing (view, reshape, size, getitem) - stays on PyTorch, no kernel needed;
* ``other``   anything else - stays on PyTorch, reported as *uncovered* with the reason.

The C expressions below are shared by the CUDA and the C++ (OpenMP) templates: they use
only the C math library's float functions (``expf``, ``tanhf`` ...) and the helpers that
``templates/common.h.j2`` defines for both (``kl_softplus``, ``kl_mish`` ...).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from agent.builtin.norm_nhwc import NormChannelsLast


REDUCTIONS = ("sum", "mean", "amax", "amin", "logsumexp", "softmax", "log_softmax")
NORMS = ("group_norm", "layer_norm", "instance_norm", "batch_norm")

LIBRARY_MODULES: tuple[type, ...] = (
    nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
    nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.LPPool1d, nn.LPPool2d, nn.Embedding, nn.Upsample, nn.PixelShuffle,
    nn.MultiheadAttention, nn.LSTM, nn.GRU, nn.RNN,
)
LIBRARY_FUNCTIONS: set[Any] = {
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d,
    F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
    F.interpolate, F.embedding, F.scaled_dot_product_attention,
    torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
    torch.conv1d, torch.conv2d, torch.conv3d, operator.matmul,
    torch.max_pool1d, torch.max_pool2d, torch.avg_pool1d,
}
LIBRARY_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm"}

PLUMB_METHODS = {"view", "reshape", "flatten", "squeeze", "unsqueeze", "permute", "transpose",
                 "size", "dim", "expand", "expand_as", "view_as", "reshape_as", "t", "unflatten",
                 "chunk", "split", "narrow", "select", "numel", "repeat", "to", "type_as", "float"}
PLUMB_FUNCTIONS: set[Any] = {operator.getitem, getattr, torch.flatten, torch.reshape, torch.squeeze,
                             torch.unsqueeze, torch.permute, torch.transpose, torch.cat, torch.stack,
                             torch.chunk, torch.split, torch.narrow}
PLUMB_MODULES: tuple[type, ...] = (nn.Flatten, nn.Unflatten)
# random draws the forward makes itself (level3/35_LSTM's initial states): PyTorch's own calls, so
# the candidate draws the same numbers from the same generator state, in the reference's order
RANDOM_FUNCTIONS: set[Any] = {torch.randn, torch.rand, torch.randint, torch.randn_like, torch.rand_like,
                              torch.randint_like, torch.normal}
LIBRARY_FUNCTIONS |= RANDOM_FUNCTIONS
# the check ``symbolic_trace(concrete_args=...)`` leaves for a parameter traced with its default
# (trace._defaults_left); pysource writes it as a plain ``if ... raise``
ASSERT_DEFAULT = getattr(getattr(torch.fx, "_symbolic_trace", None), "_assert_is_none", None)
if ASSERT_DEFAULT is not None:
    PLUMB_FUNCTIONS.add(ASSERT_DEFAULT)


@dataclass
class ModuleAttr:
    """A tensor read off a submodule at run time, e.g. ``self.gn.weight``."""

    path: str            # dotted submodule path
    attr: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32      # as the model holds it (in the run's precision)

    @property
    def key(self) -> str:
        return f"{self.path}.{self.attr}"


@dataclass
class OpInfo:
    kind: str                                   # ew | reduce | norm | pool | conv | alias | library | plumb | other
    op: str                                     # canonical operator name
    operands: list[Any] = field(default_factory=list)   # Node | ModuleAttr | float | None
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""                              # why it stays on PyTorch
    mutates: Optional[Node] = None              # in-place operators: the tensor they overwrite

    @property
    def fusible(self) -> bool:
        return self.kind in ("ew", "reduce", "norm", "pool", "conv")

    @property
    def is_core(self) -> bool:
        return self.kind in ("reduce", "norm", "pool", "conv")


# --------------------------------------------------------------------------------------
# Tables from callables / method names / module types to canonical operator names.
# Each entry: canonical name, parameter names (after the operands), defaults.
# --------------------------------------------------------------------------------------
def _fn(name, params=(), n_operands=1, **defaults):
    return {"op": name, "params": params, "n": n_operands, "defaults": defaults}


_FUNCTIONS: dict[Any, dict] = {}
_METHODS: dict[str, dict] = {}


def _reg(targets, methods, spec):
    for t in targets:
        _FUNCTIONS[t] = spec
    for m in methods:
        _METHODS[m] = spec


_reg([operator.add, torch.add], ["add", "__add__"], _fn("add", ("alpha",), 2, alpha=1))
_reg([operator.sub, torch.sub, torch.subtract], ["sub", "subtract", "__sub__"], _fn("sub", ("alpha",), 2, alpha=1))
_reg([operator.mul, torch.mul, torch.multiply], ["mul", "multiply", "__mul__"], _fn("mul", (), 2))
_reg([operator.truediv, torch.div, torch.divide, torch.true_divide], ["div", "divide", "true_divide", "__truediv__"],
     _fn("div", ("rounding_mode",), 2, rounding_mode=None))
_reg([operator.pow, torch.pow], ["pow", "__pow__"], _fn("pow", (), 2))
_reg([torch.maximum, torch.fmax], ["maximum"], _fn("maximum", (), 2))
_reg([torch.minimum, torch.fmin], ["minimum"], _fn("minimum", (), 2))
_reg([operator.neg, torch.neg, torch.negative], ["neg", "negative", "__neg__"], _fn("neg"))
_reg([operator.iadd], [], _fn("add", ("alpha",), 2, alpha=1))
_reg([operator.isub], [], _fn("sub", ("alpha",), 2, alpha=1))
_reg([operator.imul], [], _fn("mul", (), 2))
_reg([operator.itruediv], [], _fn("div", ("rounding_mode",), 2, rounding_mode=None))
for _name, _targets in {
    "relu": [torch.relu, F.relu], "sigmoid": [torch.sigmoid, F.sigmoid], "tanh": [torch.tanh, F.tanh],
    "exp": [torch.exp], "log": [torch.log], "abs": [torch.abs], "sqrt": [torch.sqrt], "rsqrt": [torch.rsqrt],
    "square": [torch.square], "reciprocal": [torch.reciprocal], "log1p": [torch.log1p],
    "expm1": [torch.expm1], "erf": [torch.erf], "sin": [torch.sin], "cos": [torch.cos],
    "silu": [F.silu], "mish": [F.mish], "hardswish": [F.hardswish], "hardsigmoid": [F.hardsigmoid],
    "selu": [F.selu, torch.selu], "logsigmoid": [F.logsigmoid], "softsign": [F.softsign],
}.items():
    _reg(_targets, [_name], _fn(_name))
_reg([torch.relu_, F.relu_], ["relu_"], _fn("relu"))
_reg([torch.sigmoid_], ["sigmoid_"], _fn("sigmoid"))
_reg([torch.tanh_], ["tanh_"], _fn("tanh"))
_reg([torch.exp_], ["exp_"], _fn("exp"))
_reg([F.gelu], ["gelu"], _fn("gelu", ("approximate",), approximate="none"))
_reg([F.leaky_relu], ["leaky_relu"], _fn("leaky_relu", ("negative_slope", "inplace"), negative_slope=0.01, inplace=False))
_reg([F.elu], ["elu"], _fn("elu", ("alpha", "inplace"), alpha=1.0, inplace=False))
_reg([F.softplus], ["softplus"], _fn("softplus", ("beta", "threshold"), beta=1.0, threshold=20.0))
_reg([F.hardtanh], ["hardtanh"], _fn("hardtanh", ("min_val", "max_val", "inplace"), min_val=-1.0, max_val=1.0, inplace=False))
_reg([F.relu6], ["relu6"], _fn("relu6", ("inplace",), inplace=False))
_reg([torch.clamp, torch.clip], ["clamp", "clip", "clamp_", "clip_"], _fn("clamp", ("min", "max"), min=None, max=None))
_reg([torch.clamp_min], ["clamp_min", "clamp_min_"], _fn("clamp_min", ("min",), min=None))
_reg([torch.clamp_max], ["clamp_max", "clamp_max_"], _fn("clamp_max", ("max",), max=None))
# a selection by a bool mask (level3/48-49, Mamba2's ``segsum``: ``x.masked_fill(~mask, -inf)`` between
# a subtraction and an exp); the mask reaches the kernel as the run's float (``kernels.Input``)
_reg([torch.masked_fill], ["masked_fill", "masked_fill_"], _fn("masked_fill", ("value",), 2))
_reg([torch.max], ["max"], _fn("max2", ("dim", "keepdim"), dim=None, keepdim=False))
_reg([torch.min], ["min"], _fn("min2", ("dim", "keepdim"), dim=None, keepdim=False))
for _m in ("add_", "sub_", "mul_", "div_"):
    _METHODS[_m] = _METHODS[_m[:-1]]
for _m in ("neg_", "abs_", "sqrt_", "log_"):
    _METHODS[_m] = _METHODS[_m[:-1]]
_reg([torch.sum], ["sum"], _fn("sum", ("dim", "keepdim", "dtype"), dim=None, keepdim=False, dtype=None))
_reg([torch.mean], ["mean"], _fn("mean", ("dim", "keepdim", "dtype"), dim=None, keepdim=False, dtype=None))
_reg([torch.amax], ["amax"], _fn("amax", ("dim", "keepdim"), dim=(), keepdim=False))
_reg([torch.amin], ["amin"], _fn("amin", ("dim", "keepdim"), dim=(), keepdim=False))
_reg([torch.logsumexp], ["logsumexp"], _fn("logsumexp", ("dim", "keepdim"), keepdim=False))
_reg([torch.softmax, F.softmax], ["softmax"], _fn("softmax", ("dim", "_stacklevel", "dtype"), dim=None, _stacklevel=3, dtype=None))
_reg([torch.log_softmax, F.log_softmax], ["log_softmax"], _fn("log_softmax", ("dim", "_stacklevel", "dtype"), dim=None, _stacklevel=3, dtype=None))
_reg([F.group_norm], [], _fn("group_norm_f", ("num_groups", "weight", "bias", "eps"), weight=None, bias=None, eps=1e-5))
_reg([F.layer_norm], [], _fn("layer_norm_f", ("normalized_shape", "weight", "bias", "eps"), weight=None, bias=None, eps=1e-5))
_reg([F.dropout], ["dropout"], _fn("dropout", ("p", "training", "inplace"), p=0.5, training=True, inplace=False))
_reg([], ["contiguous"], _fn("contiguous", ("memory_format",), memory_format=torch.contiguous_format))
# ``x.clone()`` is a copy: an elementwise identity into a tensor of its own (fused, it costs nothing; an
# alias would let a later in-place update of ``x`` show through it). ``detach`` shares its source's memory
# (an alias, as ``contiguous``): level2/20's ``x.clone().detach()`` of a convolution's output
_reg([torch.clone], ["clone"], _fn("copy", ("memory_format",), memory_format=torch.preserve_format))
_reg([torch.detach], ["detach"], _fn("detach"))

_MODULE_UNARY: dict[type, str] = {
    nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.SiLU: "silu", nn.Mish: "mish",
    nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid", nn.SELU: "selu",
    nn.LogSigmoid: "logsigmoid", nn.Softsign: "softsign",
}


class Unsupported(Exception):
    pass


def tensor_meta(node: Any):
    if not isinstance(node, Node):
        return None
    tm = node.meta.get("tensor_meta")
    return tm if hasattr(tm, "shape") else None


def shape_of(node: Any) -> Optional[tuple[int, ...]]:
    tm = tensor_meta(node)
    return tuple(int(s) for s in tm.shape) if tm is not None else None


def _attrs(mod: nn.Module, path: str, names: tuple[str, ...], shape: tuple[int, ...]) -> list[ModuleAttr]:
    """The module's tensors ``names`` as operands, each with its shape and its dtype."""
    return [ModuleAttr(path, a, tuple(shape), getattr(mod, a).dtype) for a in names]


def _bind(node: Node, spec: dict, skip_self: bool) -> tuple[list[Any], dict[str, Any]]:
    """Split a call's arguments into operands and named parameters (with defaults)."""
    args = list(node.args)
    n = spec["n"]
    operands = args[:n]
    rest = args[n:]
    params = dict(spec["defaults"])
    names = list(spec["params"])
    for name, value in zip(names, rest):
        params[name] = value
    for key, value in node.kwargs.items():
        if key in ("input", "self") and not operands:
            operands.append(value)
        elif key == "other" and len(operands) == 1:
            operands.append(value)
        elif key == "exponent" and len(operands) == 1:
            operands.append(value)
        else:
            params[key] = value
    if len(operands) < n:
        raise Unsupported(f"{spec['op']}: missing operands")
    return operands, params


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(v: Any, what: str) -> float:
    if not _scalar(v):
        raise Unsupported(f"{what} is not a Python number")
    return float(v)


def _norm_dims(dim: Any, rank: int) -> Optional[tuple[int, ...]]:
    if dim is None:
        return tuple(range(rank))
    if isinstance(dim, int):
        dim = (dim,)
    if not isinstance(dim, (tuple, list)) or not all(isinstance(d, int) for d in dim):
        raise Unsupported("reduction dims are not constant ints")
    if len(dim) == 0:
        return tuple(range(rank))
    dims = sorted({d % rank if rank else 0 for d in dim})
    if dims != list(range(dims[0], dims[-1] + 1)):
        raise Unsupported(f"reduction over non-adjacent dims {tuple(dim)}")
    return tuple(dims)


def classify(node: Node, modules: dict[str, nn.Module], constants: dict[str, Any]) -> OpInfo:
    """Classify one FX node (see the module docstring)."""
    try:
        return _classify(node, modules, constants)
    except Unsupported as exc:
        return OpInfo("other", _display_name(node), note=str(exc))


def _display_name(node: Node) -> str:
    if node.op == "call_module":
        return type(node.graph.owning_module.get_submodule(node.target)).__name__ if node.graph.owning_module else str(node.target)
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def _classify(node: Node, modules: dict[str, nn.Module], constants: dict[str, Any]) -> OpInfo:
    if node.op in ("placeholder", "get_attr", "output"):
        return OpInfo("plumb", node.op)
    if node.op == "call_module":
        mod = modules.get(node.target)
        if mod is None:
            return OpInfo("other", str(node.target), note="unknown submodule")
        return _classify_module(node, mod)
    if node.op == "call_method":
        name = str(node.target)
        if name in LIBRARY_METHODS:
            return OpInfo("library", name)
        spec = _METHODS.get(name)
        if spec is None:
            if name in PLUMB_METHODS:
                return OpInfo("plumb", name)
            return OpInfo("other", name, note=f"tensor method {name}() is not in the builtin catalogue")
        info = _from_spec(node, spec, skip_self=True)
        if name.endswith("_") and info.fusible:
            info.mutates = node.args[0] if node.args and isinstance(node.args[0], Node) else None
        return info
    if node.op == "call_function":
        target = node.target
        if target in LIBRARY_FUNCTIONS or getattr(target, "kl_library", False):   # kl_library: layout.py's copies
            return OpInfo("library", getattr(target, "__name__", str(target)))
        spec = _FUNCTIONS.get(target)
        if spec is None:
            if target in PLUMB_FUNCTIONS:
                return OpInfo("plumb", getattr(target, "__name__", str(target)))
            name = getattr(target, "__name__", str(target))
            return OpInfo("other", name, note=f"function {name} is not in the builtin catalogue")
        info = _from_spec(node, spec, skip_self=False)
        inplace = (target in (operator.iadd, operator.isub, operator.imul, operator.itruediv)
                   or getattr(target, "__name__", "").endswith("_")
                   or node.kwargs.get("inplace") is True or info.params.get("inplace") is True)
        if inplace and info.kind in ("ew", "alias") and node.args and isinstance(node.args[0], Node):
            info.mutates = node.args[0]
        return info
    return OpInfo("other", node.op, note=f"node kind {node.op}")


def _classify_module(node: Node, mod: nn.Module) -> OpInfo:
    x = node.args[0] if node.args else node.kwargs.get("input")
    path = str(node.target)
    name = type(mod).__name__
    if isinstance(mod, LIBRARY_MODULES):
        return OpInfo("library", name)
    if isinstance(mod, PLUMB_MODULES):
        return OpInfo("plumb", name)
    if len(node.args) + len(node.kwargs) != 1 or not isinstance(x, Node):
        return OpInfo("other", name, note=f"{name} called with extra arguments")
    inplace = bool(getattr(mod, "inplace", False))
    mut = x if inplace else None
    if isinstance(mod, nn.Identity):
        return OpInfo("alias", "identity", [x])
    if isinstance(mod, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)):
        if mod.p == 0.0:
            return OpInfo("alias", "dropout", [x], mutates=mut)
        return OpInfo("other", name, note="dropout with p>0 is random: it stays on PyTorch")
    op = _MODULE_UNARY.get(type(mod))
    if op is not None:
        return OpInfo("ew", op, [x], mutates=mut)
    if isinstance(mod, nn.GELU):
        return OpInfo("ew", "gelu_tanh" if mod.approximate == "tanh" else "gelu", [x])
    if isinstance(mod, nn.LeakyReLU):
        return OpInfo("ew", "leaky_relu", [x], {"negative_slope": float(mod.negative_slope)}, mutates=mut)
    if isinstance(mod, nn.ELU):
        return OpInfo("ew", "elu", [x], {"alpha": float(mod.alpha)}, mutates=mut)
    if isinstance(mod, nn.CELU):
        return OpInfo("other", name, note="CELU is not in the builtin catalogue")
    if isinstance(mod, nn.Softplus):
        return OpInfo("ew", "softplus", [x], {"beta": float(mod.beta), "threshold": float(mod.threshold)})
    if isinstance(mod, (nn.Hardtanh,)):  # ReLU6 is a Hardtanh
        return OpInfo("ew", "hardtanh", [x], {"lo": float(mod.min_val), "hi": float(mod.max_val)}, mutates=mut)
    if isinstance(mod, (nn.Softmax, nn.LogSoftmax)):
        op = "softmax" if isinstance(mod, nn.Softmax) else "log_softmax"
        return _reduction(op, x, {"dim": mod.dim, "keepdim": True})
    last = isinstance(mod, NormChannelsLast)        # a norm of the channels-last view (norm_nhwc.py)
    if last:
        mod, path = mod.norm, mod.path
    cdim = -1 if last else 1                        # its channels: the view's last dimension
    if isinstance(mod, nn.GroupNorm):
        shp = shape_of(x)
        if shp is None or len(shp) < 2 or shp[cdim] != mod.num_channels or mod.num_channels % mod.num_groups:
            raise Unsupported("GroupNorm input shape does not match the module")
        ops: list[Any] = [x]
        if mod.affine:
            ops += _attrs(mod, path, ("weight", "bias"), (mod.num_channels,))
        return OpInfo("norm", "group_norm", ops, {"groups": int(mod.num_groups), "eps": float(mod.eps),
                                                  "affine": bool(mod.affine), "module": path, "channels_last": last})
    if isinstance(mod, nn.LayerNorm):
        shp = shape_of(x)
        ns = tuple(int(s) for s in mod.normalized_shape)
        if shp is None or tuple(shp[len(shp) - len(ns):]) != ns:
            raise Unsupported("LayerNorm input shape does not match normalized_shape")
        ops = [x]
        has_w = mod.weight is not None
        has_b = getattr(mod, "bias", None) is not None
        if has_w:
            ops += _attrs(mod, path, ("weight",), ns)
        if has_b:
            ops += _attrs(mod, path, ("bias",), ns)
        return OpInfo("norm", "layer_norm", ops, {"nd": len(ns), "eps": float(mod.eps), "weight": has_w,
                                                  "bias": has_b, "module": path})
    if isinstance(mod, (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)):
        shp = shape_of(x)
        want = {nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5}[type(mod)]
        if mod.track_running_stats:
            raise Unsupported("InstanceNorm with running statistics stays on PyTorch")
        if shp is None or len(shp) != want:
            raise Unsupported("InstanceNorm on an unbatched input stays on PyTorch")
        ops = [x]
        if mod.affine:
            ops += _attrs(mod, path, ("weight", "bias"), (mod.num_features,))
        return OpInfo("norm", "instance_norm", ops, {"eps": float(mod.eps), "affine": bool(mod.affine), "module": path,
                                                     "channels_last": last})
    if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        shp = shape_of(x)
        if shp is None or len(shp) < 2 or shp[cdim] != mod.num_features:
            raise Unsupported("BatchNorm input shape does not match the module")
        ops = [x]
        if mod.affine:
            ops += _attrs(mod, path, ("weight", "bias"), (mod.num_features,))
        track = mod.running_mean is not None
        if track:
            ops += _attrs(mod, path, ("running_mean", "running_var"), (mod.num_features,))
        return OpInfo("norm", "batch_norm", ops, {"eps": float(mod.eps), "affine": bool(mod.affine),
                                                  "track": track, "module": path, "channels_last": last})
    return OpInfo("other", name, note=f"module {name} is not in the builtin catalogue")


def _reduction(op: str, x: Any, params: dict[str, Any]) -> OpInfo:
    shp = shape_of(x)
    if shp is None:
        raise Unsupported(f"{op}: input is not a tensor")
    rank = len(shp)
    if params.get("dtype") is not None:
        raise Unsupported(f"{op} with a dtype argument")
    if op in ("softmax", "log_softmax"):
        dim = params.get("dim")
        if dim is None:
            raise Unsupported(f"{op} without dim")
        dims = _norm_dims(int(dim), rank) if rank else (0,)
        keep = True
    else:
        dims = _norm_dims(params.get("dim"), rank) if rank else ()
        keep = bool(params.get("keepdim", False))
    if rank == 0:
        raise Unsupported(f"{op} of a 0-d tensor")
    return OpInfo("reduce", op, [x], {"dims": list(dims), "keepdim": keep})


def _from_spec(node: Node, spec: dict, skip_self: bool) -> OpInfo:
    operands, params = _bind(node, spec, skip_self)
    op = spec["op"]
    if op in ("sum", "mean", "amax", "amin", "logsumexp", "softmax", "log_softmax"):
        if op == "logsumexp" and "dim" not in params:
            raise Unsupported("logsumexp without dim")
        return _reduction(op, operands[0], params)
    if op in ("max2", "min2"):
        # torch.max(x, dim) (tuple; rewritten to amax by the tracer when only values are used),
        # torch.max(x, y) (elementwise), torch.max(x) (full reduction)
        if len(node.args) >= 2 and isinstance(node.args[1], Node):
            return OpInfo("ew", "maximum" if op == "max2" else "minimum", [node.args[0], node.args[1]])
        other = node.kwargs.get("other")
        if isinstance(other, Node):
            return OpInfo("ew", "maximum" if op == "max2" else "minimum", [operands[0], other])
        if params.get("dim") is None:
            return _reduction("amax" if op == "max2" else "amin", operands[0], {"dim": None, "keepdim": False})
        raise Unsupported(f"torch.{op[:3]} with dim returns indices too")
    if op in ("group_norm_f", "layer_norm_f"):
        return _functional_norm(op, operands[0], params)
    if op == "dropout":
        if float(params.get("p", 0.5)) == 0.0 or params.get("training") is False:
            return OpInfo("alias", "dropout", [operands[0]])
        raise Unsupported("dropout with p>0 is random: it stays on PyTorch")
    if op == "contiguous":
        return OpInfo("alias", "contiguous", [operands[0]])
    if op == "detach":
        return OpInfo("alias", "detach", [operands[0]])
    if op == "copy":
        return OpInfo("ew", "copy", [operands[0]])    # any memory format: the same values
    if op == "masked_fill":
        x, mask = operands
        value = params.get("value")
        mask_meta = tensor_meta(mask)
        if not isinstance(x, Node) or mask_meta is None or mask_meta.dtype != torch.bool or not _scalar(value):
            raise Unsupported("masked_fill: only a tensor, a bool mask tensor and a number")
        return OpInfo("ew", "masked_fill", [x, mask], {"value": float(value)})
    # elementwise
    for o in operands:
        if not (isinstance(o, Node) or _scalar(o)):
            raise Unsupported(f"{op}: operand {o!r} is neither a tensor nor a number")
    if not any(isinstance(o, Node) for o in operands):
        raise Unsupported(f"{op}: no tensor operand")
    if op in ("add", "sub"):
        alpha = params.get("alpha", 1)
        if alpha != 1:
            return OpInfo("ew", op + "_alpha", operands, {"alpha": _num(alpha, "alpha")})
        return OpInfo("ew", op, operands)
    if op == "div":
        if params.get("rounding_mode") is not None:
            raise Unsupported("division with a rounding mode")
        return OpInfo("ew", "div", operands)
    if op == "pow":
        base, exp_ = operands
        if isinstance(base, Node) and _scalar(exp_):
            e = float(exp_)
            special = {2.0: "square", 1.0: None, 0.5: "sqrt", -1.0: "reciprocal"}
            if e in special and special[e]:
                return OpInfo("ew", special[e], [base])
            if e == 3.0:
                return OpInfo("ew", "cube", [base])
        return OpInfo("ew", "pow", operands)
    if op == "gelu":
        approx = params.get("approximate", "none")
        return OpInfo("ew", "gelu_tanh" if approx == "tanh" else "gelu", operands)
    if op == "leaky_relu":
        return OpInfo("ew", op, operands, {"negative_slope": _num(params["negative_slope"], "negative_slope")})
    if op == "elu":
        return OpInfo("ew", op, operands, {"alpha": _num(params["alpha"], "alpha")})
    if op == "softplus":
        return OpInfo("ew", op, operands, {"beta": _num(params["beta"], "beta"),
                                           "threshold": _num(params["threshold"], "threshold")})
    if op == "hardtanh":
        return OpInfo("ew", op, operands, {"lo": _num(params["min_val"], "min_val"),
                                           "hi": _num(params["max_val"], "max_val")})
    if op == "relu6":
        return OpInfo("ew", "hardtanh", operands, {"lo": 0.0, "hi": 6.0})
    if op in ("clamp", "clamp_min", "clamp_max"):
        lo = params.get("min")
        hi = params.get("max")
        if isinstance(lo, Node) or isinstance(hi, Node):
            raise Unsupported("clamp with tensor bounds")
        if lo is None and hi is None:
            raise Unsupported("clamp without bounds")
        if op == "clamp_min" or (op == "clamp" and hi is None):
            return OpInfo("ew", "clamp_min", operands, {"lo": _num(lo, "min")})
        if op == "clamp_max" or (op == "clamp" and lo is None):
            return OpInfo("ew", "clamp_max", operands, {"hi": _num(hi, "max")})
        return OpInfo("ew", "clamp", operands, {"lo": _num(lo, "min"), "hi": _num(hi, "max")})
    return OpInfo("ew", op, operands)


def _functional_norm(op: str, x: Any, params: dict[str, Any]) -> OpInfo:
    shp = shape_of(x)
    if shp is None:
        raise Unsupported(f"{op}: input is not a tensor")
    w, b = params.get("weight"), params.get("bias")
    for t in (w, b):
        if t is not None and not isinstance(t, Node):
            raise Unsupported(f"{op}: weight/bias are not tensors")
    eps = _num(params.get("eps", 1e-5), "eps")
    ops = [x] + [t for t in (w, b) if t is not None]
    if op == "group_norm_f":
        g = params.get("num_groups")
        if not isinstance(g, int) or len(shp) < 2 or shp[1] % g:
            raise Unsupported("group_norm: num_groups is not a constant divisor of the channels")
        if (w is None) != (b is None):
            raise Unsupported("group_norm with only one of weight/bias")
        return OpInfo("norm", "group_norm", ops, {"groups": g, "eps": eps, "affine": w is not None, "module": None})
    ns = params.get("normalized_shape")
    if isinstance(ns, int):
        ns = (ns,)
    if not isinstance(ns, (tuple, list)) or not all(isinstance(s, int) for s in ns):
        raise Unsupported("layer_norm: normalized_shape is not constant")
    if tuple(shp[len(shp) - len(ns):]) != tuple(ns):
        raise Unsupported("layer_norm: normalized_shape does not match the input")
    return OpInfo("norm", "layer_norm", ops, {"nd": len(ns), "eps": eps, "weight": w is not None,
                                              "bias": b is not None, "module": None})
