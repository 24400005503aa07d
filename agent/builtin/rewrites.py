"""The traced graph rewritten before it is planned (``trace._trace_with``): each rewrite keeps
what the graph computes and moves work where the generated kernels can take it.

* ``rewrite_tuple_reductions``: ``torch.max(x, dim)[0]`` -> ``torch.amax(x, dim)``;
* ``rewrite_global_avg_pools``: a global average pool -> the mean ATen computes for it;
* ``fold_scalar_tensors``: a 0-d tensor made in forward -> the number, in its elementwise users;
* ``split_conv_bias`` (not on the CPU): a convolution's bias -> an add the next kernel fuses.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule, Node


_CONVS: dict[type, Any] = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d,
                           nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
                           nn.ConvTranspose3d: F.conv_transpose3d}


def split_conv_bias(gm: GraphModule, device: str) -> bool:
    """``conv(x)`` -> ``conv(x, weight, None) + bias.view(-1, 1, ...)`` where the convolution's one
    user is an operator the plan fuses, or its users are elementwise operators (level2/52's
    ``tanh(softplus(x)) * x``: two, fused with the add in one kernel). PyTorch adds a
    convolution's bias in a kernel of its own after cuDNN's (a full read and write of the
    output); as an add node it becomes part of the generated kernel that follows. The sum is the same float32 addition (under fp16/bf16:
    the convolution's output in its half type plus the bias, added in float and rounded once,
    as PyTorch's own separate bias add does). Returns whether the graph changed (its shapes
    must then be propagated again)."""
    from agent.builtin.ops import classify
    from agent.builtin.pool import pool_info

    modules = dict(gm.named_modules())
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        mod = modules.get(str(node.target))
        fn = _CONVS.get(type(mod))
        if fn is None or getattr(mod, "bias", None) is None or getattr(mod, "padding_mode", "zeros") != "zeros":
            continue
        users = list(node.users)
        infos = [pool_info(u, modules, device) or classify(u, modules, {}) for u in users]
        # one fusible user, or elementwise users (one kernel with the add), or one norm and elementwise
        # users (level2/92's residual ``x_conv + hardswish(tanh(group_norm(x_conv)))``: the norm's
        # epilogue reads its own prologue's value); the add before several reductions would be a
        # kernel of its own, as PyTorch's bias add is
        cores = [i for i in infos if i.kind != "ew"]
        if not users or not all(i.fusible for i in infos) or (len(users) > 1 and (
                len(cores) > 1 or any(i.kind != "norm" for i in cores))):
            continue
        rank = len(mod.kernel_size)          # spatial dimensions after the channels
        if mod.transposed:
            extra = (mod.stride, mod.padding, mod.output_padding, mod.groups, mod.dilation)
        else:
            extra = (mod.stride, mod.padding, mod.dilation, mod.groups)
        graph = gm.graph
        with graph.inserting_before(node):
            weight = graph.get_attr(f"{node.target}.weight")
            bias = graph.get_attr(f"{node.target}.bias")
            conv = graph.call_function(fn, (node.args[0], weight, None, *extra))
            shaped = graph.call_method("view", (bias, -1, *([1] * rank)))
            added = graph.call_function(operator.add, (conv, shaped))
        node.replace_all_uses_with(added)
        graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


_GLOBAL_AVG_FUNCS = {F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3}
_GLOBAL_AVG_MODULES = {nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3}


def rewrite_global_avg_pools(gm: GraphModule) -> None:
    """``adaptive_avg_pool{1,2,3}d(x, 1)`` (function or module) -> ``torch.mean(x, dim=<its spatial
    dims>, keepdim=True)``: what PyTorch itself computes for one output per channel (ATen's adaptive
    average pool to 1 x 1 is a mean over the last dimensions), as a reduction the plan fuses with the
    operators before it (level2/67: GELU then the pool in one pass over the convolution's output, as
    torch.compile does, instead of an elementwise kernel and PyTorch's mean)."""
    modules = dict(gm.named_modules())
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _GLOBAL_AVG_FUNCS and len(node.args) + len(node.kwargs) == 2:
            k = _GLOBAL_AVG_FUNCS[node.target]
            size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
        elif node.op == "call_module" and type(modules.get(str(node.target))) in _GLOBAL_AVG_MODULES \
                and len(node.args) == 1 and not node.kwargs:
            k = _GLOBAL_AVG_MODULES[type(modules[str(node.target)])]
            size = modules[str(node.target)].output_size
        else:
            continue
        sizes = [size] * k if isinstance(size, int) else list(size) if isinstance(size, (tuple, list)) else []
        if len(sizes) != k or any(s != 1 or isinstance(s, bool) for s in sizes):
            continue
        with gm.graph.inserting_before(node):
            mean = gm.graph.call_function(torch.mean, (node.args[0],), {"dim": tuple(range(-k, 0)), "keepdim": True})
        mean.meta = dict(node.meta)
        node.replace_all_uses_with(mean)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def rewrite_tuple_reductions(gm: GraphModule) -> None:
    """``torch.max(x, dim)[0]`` / ``x.max(dim).values`` -> ``torch.amax(x, dim)`` where only values are used."""
    for node in list(gm.graph.nodes):
        is_max = (node.op == "call_function" and node.target in (torch.max, torch.min)) or \
                 (node.op == "call_method" and node.target in ("max", "min"))
        if not is_max:
            continue
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if dim is None or isinstance(dim, Node):
            continue
        keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        users = list(node.users)
        if not users or not all(_is_values_of(u) for u in users):
            continue
        name = "max" if (node.target in (torch.max, "max")) else "min"
        fn = torch.amax if name == "max" else torch.amin
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(fn, (node.args[0],), {"dim": dim, "keepdim": bool(keepdim)})
        new.meta = dict(users[0].meta)
        for u in users:
            u.replace_all_uses_with(new)
            gm.graph.erase_node(u)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


# elementwise users of a 0-d tensor made in forward, and what each becomes with the number instead
_FOLD_MINMAX = {torch.min: torch.clamp_max, torch.minimum: torch.clamp_max,
                torch.max: torch.clamp_min, torch.maximum: torch.clamp_min}
_FOLD_ARITH = {operator.add, operator.sub, operator.mul, operator.truediv}
_FOLD_TORCH = {torch.add, torch.sub, torch.mul, torch.div}      # the number as the second operand only


def fold_scalar_tensors(gm: GraphModule) -> None:
    """``torch.tensor(c, device=x.device)`` whose users are elementwise operators on a floating tensor
    -> the number ``c`` in those operators (``torch.min(x, t)`` -> ``torch.clamp_max(x, c)``).

    The tracer records such a tensor as a call that depends on ``x`` (through ``x.device``), so the
    plan had to end a fused group before it and start another after (level2/93: two passes over
    the output where one does). The values are the same: a 0-d tensor does not promote a
    floating tensor's type, a Python number does not either, and ``clamp_max``/``clamp_min``
    propagate NaN as ``minimum``/``maximum`` do. A float literal only (``torch.tensor(2)`` is an
    integer tensor), with no dtype or a floating one."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is torch.tensor and len(node.args) == 1
                and set(node.kwargs) <= {"device", "dtype"}):
            continue
        value, dtype = node.args[0], node.kwargs.get("dtype")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point) and not (dtype is None and isinstance(value, float)):
            continue
        rewrites = []
        for user in node.users:
            others = [a for a in user.args if a is not node]
            meta = others[0].meta.get("tensor_meta") if len(others) == 1 and isinstance(others[0], Node) else None
            if (user.op != "call_function" or user.kwargs or len(user.args) != 2 or meta is None
                    or not meta.dtype.is_floating_point):
                break
            if user.target in _FOLD_MINMAX:
                rewrites.append((user, _FOLD_MINMAX[user.target], (others[0], float(value))))
            elif user.target in _FOLD_ARITH or (user.target in _FOLD_TORCH and user.args[1] is node):
                rewrites.append((user, user.target, tuple(float(value) if a is node else a for a in user.args)))
            else:
                break
        else:
            for user, fn, args in rewrites:
                user.target, user.args = fn, args
            device = node.kwargs.get("device")
            graph.erase_node(node)
            if isinstance(device, Node) and not device.users and device.op == "call_function" \
                    and device.target is getattr:
                graph.erase_node(device)
    graph.lint()
    gm.recompile()


def _is_values_of(user: Node) -> bool:
    if user.op != "call_function":
        return False
    if user.target is operator.getitem and len(user.args) == 2 and user.args[1] == 0:
        return True
    return user.target is getattr and len(user.args) == 2 and user.args[1] == "values"
