"""Trace a task's reference with torch.fx and propagate shapes without running it for real.

The model is built on the ``meta`` device (sizes on the GPU can be huge), traced with
``symbolic_trace`` and shape-propagated with meta inputs. Where the meta device cannot
run the model, the task's CPU sizes and real tensors are used instead (shapes only feed
the plan: the generated kernels read every size at run time). The caller's RNG state
is never disturbed.

A forward whose Python control flow reads an input's shape (``seq_len, batch, _ = x.size()``
then ``for t in range(seq_len)``, KernelBench's level3/34) cannot be traced symbolically: a
last attempt answers those questions with the example inputs' sizes (``_ShapeTracer``), so the
loop unrolls. Such a trace holds only for inputs of those shapes: ``Traced.shapes`` names
them, and the candidate refuses any other (``codegen.emit_forward``). A size read off a tensor
the forward computed (Mamba2's ``torch.ones(T, T)``) needs every proxy to carry a meta tensor: the
very last attempt (``_MetaShapeTracer``), its einops calls leaves of the graph.

The trace is taken in the run's precision, as the sandbox builds the models (KernelBench's
casts, through the ``Numerics`` helpers): tensors among the init inputs, the model's
parameters and buffers and the floating-point inputs in float16 or bfloat16 under ``fp16`` or
``bf16``, so the graph's dtypes are those the candidate will see.
"""
from __future__ import annotations

import copy
import inspect
import re
import operator
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node
from torch.fx.experimental.meta_tracer import MetaTracer
from torch.fx.passes.shape_prop import ShapeProp

from agent.builtin.dtypes import cast_model, cast_values, precision_of
from agent.builtin.rewrites import (fold_scalar_tensors, rewrite_global_avg_pools, rewrite_tuple_reductions,
                                    split_conv_bias)
from agent.builtin.view_motion import move_views
from agent.builtin.rng import isolated_rng
from sandbox.tasks import TaskSpec, load_task, with_device_sizes


@dataclass
class Traced:
    spec: TaskSpec                           # the device-sized spec the trace used
    device: str
    gm: Optional[GraphModule] = None
    modules: dict[str, nn.Module] = field(default_factory=dict)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)   # get_attr targets the model lacks
    error: Optional[str] = None              # why tracing failed (then gm is None)
    how: str = "meta"                        # meta | cpu
    precision: str = "fp32"                  # the run's precision the trace was taken in
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)   # inputs the trace specialised on
    # module attributes the forward assigns (level3/33_VanillaRNN's ``self.hidden = ...``): the
    # attribute's path -> the node of its value at the forward's end (``_rebound``)
    rebinds: dict[str, Node] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.gm is not None


_CACHE: dict[tuple[str, str, str, str, bool], Traced] = {}
_LOCK = threading.Lock()


def trace_task(spec: TaskSpec, device: str, numerics: Any = None) -> Traced:
    """The (cached) trace of a task in the run's precision (``numerics``: a
    ``sandbox.numerics.Numerics``, None for float32). Serialised: the backend runs samples in
    threads, and tracing uses process-wide state (the default-device mode, the RNG it saves
    and restores)."""
    from agent.builtin.pool import fused_on

    precision = precision_of(numerics)
    key = (spec.key, spec.name, device, precision, fused_on(device))   # a fused pool splits the conv's bias
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            hit = _trace(spec, device, numerics)
            if len(_CACHE) > 64:
                _CACHE.clear()
            _CACHE[key] = hit
        return hit


def _trace(spec: TaskSpec, device: str, numerics: Any = None) -> Traced:
    dev_spec = with_device_sizes(spec, device)
    precision = precision_of(numerics)
    errors = []
    for how in ("meta", "cpu"):
        use = dev_spec if how == "meta" else with_device_sizes(spec, "cpu")
        try:
            with isolated_rng():
                traced = _trace_with(use, device, how, numerics)
            if traced.shapes and use.overrides != dev_spec.overrides:
                raise ValueError("the trace specialised on the input shapes of the CPU sizes, which are "
                                 f"not those {device} runs")
            return traced
        except Exception as exc:  # noqa: BLE001 - any failure moves on to the next way
            errors.append(f"{how}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return Traced(spec=dev_spec, device=device, error="; ".join(errors), precision=precision)


def _trace_with(spec: TaskSpec, device: str, how: str, numerics: Any = None) -> Traced:
    """One way of tracing; the casts are the harness's (``make_model``/``make_inputs``)."""
    task = load_task(spec, validate=False)
    if how == "meta":
        with torch.device("meta"):
            init = cast_values(numerics, task.get_init_inputs())
            model = cast_model(numerics, task.Model(*init))
            inputs = cast_values(numerics, task.get_inputs())
    else:
        torch.manual_seed(0)
        init = cast_values(numerics, task.get_init_inputs())
        model = cast_model(numerics, task.Model(*init))
        inputs = cast_values(numerics, task.get_inputs())
    gm, shapes, rebinds = _symbolic_trace(model, inputs)
    _ShapeProp(gm).propagate(*inputs)
    rewrite_tuple_reductions(gm)       # first: a convolution followed by torch.min(x, 1)[0] splits its bias too
    rewrite_global_avg_pools(gm)       # and one followed by a global average pool
    fold_scalar_tensors(gm)            # torch.min(x, torch.tensor(0.0, device=x.device)) fuses with its neighbours
    # on the CPU oneDNN adds the bias inside the convolution (no extra pass): it stays there
    if device != "cpu" and split_conv_bias(gm, device):
        _ShapeProp(gm).propagate(*inputs)
    move_views(gm, lambda: _ShapeProp(gm).propagate(*inputs))     # after the bias split: an add it moves past
    modules = dict(gm.named_modules())
    known = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    constants: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in known:
            # a constant the tracer made from a tensor built in forward (``torch.min(x, torch.tensor(c))``)
            # exists on the traced model only: the candidate's model (the reference's __init__) lacks it
            traced_only = _made_by_tracer(str(node.target), spec.source)
            try:
                if traced_only:
                    raise AttributeError(node.target)
                value = _get_path(model, node.target)
            except AttributeError:
                value = _get_path(gm, node.target)
                if not isinstance(value, torch.Tensor) or value.numel() > 4096 or value.is_meta:
                    raise ValueError(f"the trace holds a tensor constant {node.target} that the model lacks "
                                     "(only tensors of at most 4096 values, not on the meta device, are copied)")
                constants[node.target] = value.detach().cpu().clone()
    in_graph = set(gm.graph.nodes)
    gone = [path for path, node in rebinds.items() if node not in in_graph]
    if gone:
        raise ValueError(f"the forward assigns module attributes ({', '.join(gone)}) whose values the trace's "
                         "rewrites replaced")
    return Traced(spec=spec, device=device, gm=gm, modules=modules, constants=constants, how=how,
                  precision=precision_of(numerics), shapes=shapes, rebinds=rebinds)


class _ShapeProp(ShapeProp):
    """``ShapeProp`` that gives a recurrent layer's outputs (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``)
    their shapes without running it: on the meta device PyTorch decomposes each time step and
    layer into reference ops, and a bidirectional LSTM of KernelBench's level 3 took 44 s to
    propagate. The shapes are those ``torch.nn.RNNBase`` documents; anything it does not cover (a
    packed sequence, an input of the wrong width, an initial state that is not tensors of the
    states' shapes) runs the layer as before, errors included."""

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(target)
        if isinstance(module, nn.RNNBase) and not kwargs:
            outputs = _recurrent_outputs(module, *args)
            if outputs is not None:
                return outputs
        return super().call_module(target, args, kwargs)


def _recurrent_outputs(module: nn.RNNBase, x: Any = None, hx: Any = None) -> Any:
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != module.input_size:
        return None
    if module.mode not in ("LSTM", "GRU", "RNN_TANH", "RNN_RELU"):
        return None
    dirs = 2 if module.bidirectional else 1
    layers, hidden = module.num_layers * dirs, module.hidden_size
    out_size = getattr(module, "proj_size", 0) or hidden
    if x.dim() == 3:
        steps, batch = (x.shape[1], x.shape[0]) if module.batch_first else (x.shape[0], x.shape[1])
        output = (batch, steps, dirs * out_size) if module.batch_first else (steps, batch, dirs * out_size)
        h_n, c_n = (layers, batch, out_size), (layers, batch, hidden)
    else:
        output, h_n, c_n = (x.shape[0], dirs * out_size), (layers, out_size), (layers, hidden)
    # the initial state as the layer takes it (none, or tensors of the states' shapes); anything else
    # (a None inside the tuple, a traced default) is left to the layer, which raises as before
    states = (h_n, c_n) if module.mode == "LSTM" else (h_n,)
    if hx is not None:
        given = hx if module.mode == "LSTM" else (hx,)
        if not (isinstance(given, tuple) and len(given) == len(states)
                and all(isinstance(t, torch.Tensor) and tuple(t.shape) == s for t, s in zip(given, states))):
            return None
    if module.mode == "LSTM":
        return x.new_empty(output), (x.new_empty(h_n), x.new_empty(c_n))
    return x.new_empty(output), x.new_empty(h_n)


def _symbolic_trace(model: nn.Module, inputs: list) -> tuple[GraphModule, dict[str, tuple[int, ...]], dict[str, Node]]:
    """``symbolic_trace``; where that fails, again with the model's buffers as proxies (a forward
    that slices a buffer by a traced size, ``self.bias[:, :, :T, :T]`` in minGPT's causal
    attention, indexes a real tensor with a proxy otherwise); where that fails too, with the
    inputs' shapes answered concretely (``_ShapeTracer``), and last with every tensor's shape
    answered concretely (``_MetaShapeTracer``). Returns the graph module, the shapes of the
    inputs it specialised on (empty but for the last two ways) and the module attributes the
    forward assigned (``_rebound``).

    Every way traces the forward as ``get_inputs()`` calls it: a parameter that the inputs leave
    to its default (level3/35_LSTM's ``h0=None``, then drawn with ``torch.randn`` in forward) is
    traced with that default (``concrete_args``: the ``if h0 is None`` branch the reference takes;
    the graph keeps the parameter, asserting it is the default)."""
    concrete = _defaults_left(model, inputs)

    def plain() -> torch.fx.Tracer:
        return torch.fx.Tracer()

    def buffers_as_proxies() -> torch.fx.Tracer:
        tracer = torch.fx.Tracer()
        tracer.proxy_buffer_attributes = True
        return tracer

    def shaped() -> torch.fx.Tracer:
        return _ShapeTracer(model, inputs)

    def meta_shaped() -> torch.fx.Tracer:
        return _MetaShapeTracer(model, inputs)

    ways = (plain, buffers_as_proxies, shaped, meta_shaped)
    for i, way in enumerate(ways):
        tracer = way()
        # the meta tracer runs every submodule on meta tensors: it traces a meta copy of a model
        # whose weights are real (the CPU way), and the graph module reads the real model's
        target = tracer.meta_model if isinstance(tracer, _MetaShapeTracer) else model
        saved = _module_state(target)
        try:
            if isinstance(tracer, _MetaShapeTracer):
                with warnings.catch_warnings():     # (its note on every node it cannot give a meta tensor)
                    warnings.simplefilter("ignore", UserWarning)
                    graph = tracer.trace(target, meta_args=tracer.meta_args, concrete_args=concrete)
            else:
                graph = tracer.trace(target, concrete_args=concrete)
        except Exception:  # noqa: BLE001 - the next way, or the last way's own error
            _restore_module_state(target, saved)
            if i == len(ways) - 1:
                raise
            continue
        # before the graph module copies the attributes its get_attr nodes read: the forward's
        # assignments left proxies on the model
        rebinds = _rebound(target, saved)
        _restore_module_state(target, saved)
        if target is not model:
            _adopt_constants(target, model, saved)
        gm = _forward_names(GraphModule(model, graph, type(model).__name__), concrete)
        used = tracer.used if isinstance(tracer, (_ShapeTracer, _MetaShapeTracer)) else {}
        return gm, used, rebinds
    raise AssertionError("unreachable")


def _module_state(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each module's own attributes (its ``__dict__`` less parameters, buffers and submodules, which
    live in their own dicts), by module path."""
    return {path: dict(vars(m)) for path, m in model.named_modules()}


def _restore_module_state(model: nn.Module, saved: dict[str, dict[str, Any]]) -> None:
    """Each module's attributes as they were before the trace; of the attributes the trace added,
    the forward's own (proxies) go, the tracer's (``_tensor_constant<i>``: tensors its graph reads) stay."""
    for path, m in model.named_modules():
        before = saved.get(path)
        if before is None:
            continue
        now = vars(m)
        for name in [k for k, v in now.items() if k not in before and isinstance(v, torch.fx.Proxy)]:
            del now[name]
        now.update(before)


def _adopt_constants(traced: nn.Module, model: nn.Module, saved: dict[str, dict[str, Any]]) -> None:
    """The tensors the tracer attached to ``traced`` (the meta tracer's copy of ``model``) as
    ``_tensor_constant<i>`` while tracing (a tensor built in the forward: level3/30_SwinTransformerV2's
    ``torch.log(torch.tensor(1. / 0.01))``), set on ``model`` too: its graph module reads its
    get_attr targets from ``model``, which lacked them ("'Model' object has no attribute
    '_tensor_constant0'"). The values are those the forward built (a meta tensor stays one, and
    ``_trace_with`` refuses it)."""
    for path, m in traced.named_modules():
        before = saved.get(path, {})
        for name, value in vars(m).items():
            if name.startswith("_tensor_constant") and name not in before and isinstance(value, torch.Tensor):
                setattr(model.get_submodule(path) if path else model, name, value)


def _rebound(model: nn.Module, saved: dict[str, dict[str, Any]]) -> dict[str, Node]:
    """Module attributes the traced forward assigned a traced value to (``self.hidden = h``):
    attribute path -> the node of the value it holds at the forward's end. A forward that keeps
    state across calls this way (level3/33_VanillaRNN) left the proxies on the model; the
    candidate's forward makes the same assignments (``codegen.emit_forward``)."""
    out: dict[str, Node] = {}
    for path, m in model.named_modules():
        for name, value in vars(m).items():
            if isinstance(value, torch.fx.Proxy) and path in saved:
                out[f"{path}.{name}" if path else name] = value.node
    return out


def _forward_names(gm: GraphModule, concrete: Optional[dict[str, Any]]) -> GraphModule:
    """The forward's own parameter names on the placeholders of parameters traced with their
    defaults (the tracer names them ``h0_1``), so the candidate's forward takes ``h0=None`` as the
    reference's does."""
    if concrete:
        taken = {str(n.target) for n in gm.graph.nodes if n.op == "placeholder"}
        for n in gm.graph.nodes:
            base = re.sub(r"_\d+$", "", str(n.target))
            if n.op == "placeholder" and n.target not in concrete and base in concrete and base not in taken:
                n.target = base
                taken.add(base)
        gm.recompile()
    return gm


def _positional(model: nn.Module) -> list[inspect.Parameter]:
    """The forward's parameters that ``get_inputs()``'s values fill by position."""
    return [p for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _defaults_left(model: nn.Module, inputs: list) -> Optional[dict[str, Any]]:
    """The forward's positional parameters past the inputs given, with their defaults (None where
    there are none, or where a parameter past them has no default: tracing then fails as before)."""
    left = _positional(model)[len(inputs):]
    if not left or any(p.default is inspect.Parameter.empty for p in left):
        return None
    return {p.name: p.default for p in left}


class _ShapedProxy(torch.fx.Proxy):
    """The proxy of a forward's tensor argument that answers shape questions (``size``, ``shape``,
    ``dim``, ``ndim``, ``numel``, ``nelement``, ``len``) with the example input's sizes instead
    of recording them, and records that it did (``_ShapeTracer.used``). Everything else is
    traced as by any proxy; a tensor computed from the input asks its own proxy, which records."""

    def __init__(self, node: Node, tracer: "_ShapeTracer", size: torch.Size):
        super().__init__(node, tracer)
        self._size = size

    def _answer(self) -> torch.Size:
        self.tracer.used[str(self.node.target)] = tuple(self._size)
        return self._size

    def size(self, dim: Optional[int] = None) -> Any:
        return self._answer() if dim is None else self._answer()[dim]

    @property
    def shape(self) -> torch.Size:
        return self._answer()

    def dim(self) -> int:
        return len(self._answer())

    @property
    def ndim(self) -> int:
        return len(self._answer())

    def numel(self) -> int:
        return self._answer().numel()

    def nelement(self) -> int:
        return self._answer().numel()

    def __len__(self) -> int:
        return self._answer()[0]


class _ShapeTracer(torch.fx.Tracer):
    """A tracer whose placeholders for the forward's positional tensor arguments are
    ``_ShapedProxy``s with the example inputs' sizes: Python control flow over those sizes
    unrolls (``for t in range(x.size(0))``). ``used``: the arguments whose sizes were read,
    by name, with their shapes."""

    def __init__(self, model: nn.Module, inputs: list):
        super().__init__()
        self.sizes = {p.name: v.shape for p, v in zip(_positional(model), inputs) if isinstance(v, torch.Tensor)}
        self.used: dict[str, tuple[int, ...]] = {}

    def proxy(self, node: Node) -> torch.fx.Proxy:
        if node.op == "placeholder" and node.target in self.sizes:
            return _ShapedProxy(node, self, self.sizes[str(node.target)])
        return super().proxy(node)

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        """Control flow over a comparison of devices (level3/46_NetVlad's ``if x.device !=
        self.clusters.device: raise``) is answered as the harness runs the model: its parameters,
        buffers and inputs on one device, so ``==`` is True and ``!=`` False. The comparison leaves
        the graph (a device is no kernel's operand). Any other question is the tracer's error."""
        node = obj.node
        if node.op == "call_function" and node.target in (operator.eq, operator.ne) and len(node.args) == 2 \
                and all(_is_device_of(a) for a in node.args) and not node.users:
            answer, graph, args = node.target is operator.eq, node.graph, node.args
            graph.erase_node(node)              # (which clears its args)
            for a in args:
                if isinstance(a, Node) and not a.users:
                    graph.erase_node(a)
            return answer
        return super().to_bool(obj)


# Python types a forward passes as dtypes (``torch.ones(T, T, dtype=bool)``): an fx argument must be a torch.dtype
_PY_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}


class _MetaShapeTracer(MetaTracer):
    """The last way: every proxy carries a meta tensor (``torch.fx.experimental.meta_tracer``), so
    every shape question is answered concretely, a tensor computed inside the forward included
    (level3/48-49, Mamba2: ``T = x.size(-1)`` of a rearranged parameter, then ``torch.ones(T, T)``).
    The forward's einops calls (``from einops import rearrange``, as KernelBench's tasks import
    them) are leaves of the graph, run as the reference runs them; a Python type passed as a dtype
    is the torch dtype it stands for. The trace holds for inputs of the example's shapes only:
    ``used`` names every tensor input, as ``_ShapeTracer`` names those it read."""

    def __init__(self, model: nn.Module, inputs: list):
        forward = getattr(type(model).forward, "__globals__", {})
        leaves = tuple({id(f): f for f in forward.values()
                        if callable(f) and str(getattr(f, "__module__", "") or "").split(".")[0] == "einops"}.values())
        super().__init__(autowrap_functions=leaves)
        # buffers read by the forward are nodes of the graph, not values: a tensor computed from
        # one (level3/30_SwinTransformerV2's window attention mask) would otherwise be computed on
        # the meta copy and frozen into the graph as a meta constant
        self.proxy_buffer_attributes = True
        self.meta_args = {p.name: torch.empty_like(v, device="meta")
                          for p, v in zip(_positional(model), inputs) if isinstance(v, torch.Tensor)}
        real = any(not t.is_meta for t in [*model.parameters(), *model.buffers()])
        self.meta_model = copy.deepcopy(model).to("meta") if real else model
        self.used = {name: tuple(t.shape) for name, t in self.meta_args.items()}

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, type) and a in _PY_DTYPES:
            return _PY_DTYPES[a]
        return super().create_arg(a)

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        """Control flow over numbers the meta tensors answer (``assert L == H * W`` of a computed
        tensor's shape) goes as the example takes it; over anything else, the tracer's error."""
        meta = getattr(obj, "_tensor_meta", None)
        if isinstance(meta, (bool, int)):
            return bool(meta)
        return super().to_bool(obj)


def _is_device_of(a: Any) -> bool:
    """A traced ``t.device`` (or a device value itself)."""
    if isinstance(a, torch.device):
        return True
    return isinstance(a, Node) and a.op == "call_function" and a.target is getattr and len(a.args) == 2 \
        and a.args[1] == "device"


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _made_by_tracer(target: str, source: str) -> bool:
    """Whether a get_attr target is a tensor torch.fx's tracer stored on the model itself (it names
    them ``_tensor_constant<i>``), not an attribute the task's own code sets."""
    root = target.split(".")[0]
    return root.startswith("_tensor_constant") and root not in source
