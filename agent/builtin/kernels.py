"""From a fusion group to kernel code: operand accesses, element bodies, launch metadata.

One ``KernelGroup`` describes everything the templates need for one group:

* ``inputs``: the external tensors (FX nodes or ``self.<module>.<param>``) the kernel reads;
* ``accesses``: how each input is indexed in each *space* - ``p`` (the core's input shape,
  or the whole shape of an elementwise group) and ``e`` (the core's output shape):
  ``direct`` (same shape), ``scalar`` (one element) or broadcast ``runs`` (each run of
  adjacent non-broadcast dimensions contributes ``((i / inner) % count) * stride``);
* ``meta``: the int64 values the C++ wrapper computes at run time (sizes and run
  parameters) in the order the launcher unpacks them;
* the element bodies (C statements) of the prologue and epilogue, as functions of the
  flat index variable and of the vector lane (4-element vector loads), rendered by the templates;
* the storage type of every input and of the output (``float``, ``c10::Half``,
  ``c10::BFloat16``): loads convert to ``float``, every operator computes in ``float``, and
  the result is converted to the output's type once, on store (see ``dtypes``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch.fx import Node

from agent.builtin.dtypes import c_type, is_half, value_dtype
from agent.builtin.c_expr import c_float, ew_expr
from agent.builtin.ops import ModuleAttr, OpInfo, shape_of
from agent.builtin.plan import Group, Plan

LANES = ("x", "y", "z", "w")
Value = Union[Node, ModuleAttr]
SPLIT_REDUCE_ENV = "KERNELLOOP_CUDA_SPLIT_REDUCE"


NARROW_ENV = "KERNELLOOP_CUDA_NARROW_INDEX"
# the launches' own bound for 32-bit indices (``meta[0] <= INT_MAX / 2``; each quantity a launch
# checks is the element count of a tensor of the group, so one within this at the task's sizes
# takes the 32-bit path there)
NARROW_MAX_ELEMENTS = (2**31 - 1) // 2


def narrow_indices_on() -> bool:
    """Whether a CUDA group whose tensors all have at most ``NARROW_MAX_ELEMENTS`` elements at the
    task's sizes is built with 32-bit indices only (``KernelGroup.largest``): its launch refuses larger
    tensors with the reason instead of running a 64-bit instantiation, which is no longer compiled.
    Every kernel was compiled for ``int`` and ``long long`` indices, and the second is never run at
    KernelBench's level-2 and level-3 sizes: dropping it took nvcc's time for the device code to 0.76x
    (geomean of 8 level-2 tasks, ``scripts/bench_nvcc_index.py``; 0.55x for level2/23's norm and
    reductions) on a 2-core host. On by default;
    ``KERNELLOOP_CUDA_NARROW_INDEX=0`` builds both."""
    return os.environ.get(NARROW_ENV, "1") != "0"


STATIC_VARIANTS_ENV = "KERNELLOOP_CUDA_STATIC_VARIANTS"
LAUNCH_VARIANTS = ("block", "warp", "cols", "split")


def static_variants_on() -> bool:
    """Whether a CUDA norm or reduction group built for the task's sizes (32-bit indices only)
    compiles only the kernels its launch can pick at those sizes (``KernelGroup.reach``): the launch
    chooses among a block per row, a warp per row, column kernels and split ones by the sizes, and the
    others were compiled never to run. A launch that would need one left out refuses with the reason.
    On by default; ``KERNELLOOP_CUDA_STATIC_VARIANTS=0`` compiles every one."""
    return os.environ.get(STATIC_VARIANTS_ENV, "1") != "0"


def split_reduce_on() -> bool:
    """Whether long reductions with few outputs are split over several blocks on cuda, each block
    a chunk, its partial results merged in chunk order by a second kernel:
    on by default, ``KERNELLOOP_CUDA_SPLIT_REDUCE=0`` turns it off. Session u judged it on four H200s
    (``tests/test_builtin_split_reduce.py -m gpu``: correct) and optimised level2/15, 42, 44, 52, 72
    and 73 with it on and off side by side: best vs torch.compile 0.97/0.92/0.71/0.45/0.75/0.55x
    on, 0.60/0.69/0.61/0.65/0.34/0.64x off (``evals/gpu_runs/2026-11-28-session-u.md``). Two
    places, each measured in session s's profiles:

    * a norm's statistics where rows are fewer than the SMs (``cuda_norm.cu.j2``'s
      ``_part``/``_fin``): a BatchNorm row is a channel, so level2/72's 16 channels ran its norm
      kernel in 16 blocks on 132 SMs, 10.95 of the candidate's 14.88 ms (eager: 11.9 ms in all);
    * a column reduction with few outputs (``cuda_reduce.cu.j2``'s ``_colpart``/``_colfin``): a
      global average pool over a channels-last view is 2048 outputs of 65536 elements each in
      level2/44, one thread per output, 8 blocks: 12.1 ms against 0.14 ms for the NCHW row kernel."""
    return os.environ.get(SPLIT_REDUCE_ENV, "1") != "0"


@dataclass
class Access:
    input: int
    space: str                       # p | e
    kind: str                        # direct | scalar | runs
    runs: list[tuple[int, int]] = field(default_factory=list)   # (first, last) dims of the space
    meta_pos: int = -1               # first meta slot of the runs

    @property
    def name(self) -> str:
        return f"r{self.input}{self.space}"


@dataclass
class Input:
    index: int
    value: Value
    shape: tuple[int, ...]

    @property
    def py(self) -> str:
        from agent.builtin.pysource import attr_path, var
        if isinstance(self.value, ModuleAttr):
            return attr_path(f"{self.value.path}.{self.value.attr}")
        if value_dtype(self.value) == torch.bool:       # masked_fill's mask, read as a float (below)
            return f"{var(self.value)}.to(torch.float32)"
        return var(self.value)

    @property
    def label(self) -> str:
        return self.value.key if isinstance(self.value, ModuleAttr) else self.value.name

    @property
    def dtype(self):
        # a bool tensor (masked_fill's mask, the only one the plan lets in: plan._float_mask) reaches
        # the kernel as float32, converted by the candidate's Python (``py``)
        d = value_dtype(self.value)
        return torch.float32 if d == torch.bool else d

    @property
    def ctype(self) -> str:
        return c_type(self.dtype)


def _access(inp: Input, space_shape: tuple[int, ...], space: str) -> Access:
    shp = tuple(inp.shape)
    rank = len(space_shape)
    if len(shp) > rank:
        raise ValueError(f"input {inp.label} has a larger rank than its space")
    al = (1,) * (rank - len(shp)) + shp
    if _numel(shp) == 1:
        return Access(inp.index, space, "scalar")
    if al == tuple(space_shape):
        return Access(inp.index, space, "direct")
    runs: list[tuple[int, int]] = []
    d = 0
    while d < rank:
        if al[d] != 1:
            start = d
            while d + 1 < rank and al[d + 1] != 1:
                d += 1
            runs.append((start, d))
        d += 1
    for a, b in runs:
        for k in range(a, b + 1):
            if al[k] != space_shape[k]:
                raise ValueError(f"input {inp.label} does not broadcast to its space")
    return Access(inp.index, space, "runs", runs)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class KernelGroup:
    """The code-generation view of one fusion group."""

    def __init__(self, plan: Plan, group: Group):
        self.plan = plan
        self.group = group
        self.name = group.name
        infos = plan.infos
        self.nodes = group.nodes
        self.core: Optional[Node] = plan.core_of(group)
        # a direct convolution's tail reduction (plan.tail_reduction): the group's output, one value
        # per (sample, channel), accumulated from the epilogue's values (``tail_op``; ``epilogue``'s ``z``)
        self.tail: Optional[Node] = plan.tail_of(group)
        self.core_info: Optional[OpInfo] = infos[self.core] if self.core is not None else None
        if self.core is None:
            self.kind = "ew"
            self.prologue_nodes = list(group.nodes)
            self.epilogue_nodes: list[Node] = []
        else:
            i = group.nodes.index(self.core)
            self.kind = self.core_info.kind
            self.prologue_nodes = group.nodes[:i]
            self.epilogue_nodes = group.nodes[i + 1:len(group.nodes) - (1 if self.tail is not None else 0)]
        self.op = self.core_info.op if self.core_info else "elementwise"
        self.members = set(group.nodes)
        # spaces
        if self.core is None:
            self.p_shape = shape_of(group.nodes[0])
            self.e_shape = self.p_shape
        else:
            self.p_shape = shape_of(self.core_info.operands[0])
            self.e_shape = shape_of(self.core)
        self.same_space = self.kind == "norm" or self.op in ("softmax", "log_softmax") or self.core is None
        self.epi_space = "p" if self.same_space else "e"
        # inputs and accesses
        self.inputs: list[Input] = []
        self._input_of: dict[Any, int] = {}
        self.accesses: dict[tuple[int, str], Access] = {}
        for n in self.prologue_nodes:
            self._use_operands(n, "p")
        if self.core is not None:
            data = self.core_info.operands[0]
            if data not in self.members:
                self._use(data, "p")
            self.params: list[int] = [self._add_input(v) for v in self.core_info.operands[1:]]
        else:
            self.params = []
        for n in self.epilogue_nodes:
            self._use_operands(n, self.epi_space)
        self.out_node = group.output
        self.out_dtype = value_dtype(self.out_node)
        self.out_ctype = c_type(self.out_dtype)
        self.ops = [infos[n].op for n in group.nodes]
        self.meta: list[str] = []          # C++ expressions pushed by the wrapper, in order
        # a batch norm's statistics summed by the direct convolution before it (conv_stats.py): on the
        # convolution's group, the norm group's name; on the norm's, the convolution group's
        self.stats_to: Optional[str] = None
        self.stats_from: Optional[str] = None
        self.knobs_used: set[str] = set()

    # ---------------------------------------------------------------------------------
    def _add_input(self, value: Value) -> int:
        key = value.key if isinstance(value, ModuleAttr) else value
        if key not in self._input_of:
            shp = value.shape if isinstance(value, ModuleAttr) else shape_of(value)
            self._input_of[key] = len(self.inputs)
            self.inputs.append(Input(len(self.inputs), value, tuple(shp)))
        return self._input_of[key]

    def _use(self, value: Value, space: str) -> Access:
        k = self._add_input(value)
        if (k, space) not in self.accesses:
            shape = self.p_shape if space == "p" else self.e_shape
            self.accesses[(k, space)] = _access(self.inputs[k], shape, space)
        return self.accesses[(k, space)]

    def _use_operands(self, n: Node, space: str) -> None:
        for o in self.plan.infos[n].operands:
            if isinstance(o, Node) and o not in self.members:
                self._use(o, space)

    # ---------------------------------------------------------------------------------
    @property
    def space_inputs(self) -> list[int]:
        """Inputs whose shapes define the ``p`` space (broadcast together at run time)."""
        return sorted({k for (k, s) in self.accesses if s == "p"})

    def runs_list(self) -> list[Access]:
        return [a for a in self.accesses.values() if a.kind == "runs"]

    def direct(self, space: str) -> list[int]:
        return sorted(k for (k, s), a in self.accesses.items() if s == space and a.kind == "direct")

    def scalars(self) -> list[int]:
        return sorted({k for (k, s), a in self.accesses.items() if a.kind == "scalar"})

    # ---------------------------------------------------------------------------------
    def var(self, n: Node) -> str:
        return f"t_{n.name}"

    def _load_expr(self, acc: Access, index: str, lane: Optional[int], chan: Optional[str] = None,
                   row: Optional[str] = None) -> str:
        k = acc.input
        if acc.kind == "scalar":
            return f"s{k}"
        if row is not None and self.along_row(acc):
            return self.load(k, row)
        if acc.kind == "direct":
            if lane is not None:
                return self._to_float(k, f"v{k}.{LANES[lane]}")
            return self.load(k, index)
        if chan is not None and self.per_channel(acc):
            index = chan
        terms = " + ".join(f"kl_off({index}, {acc.name}{j})" for j in range(len(acc.runs)))
        return self.load(k, terms)

    def along_row(self, acc: Access) -> bool:
        """Whether a broadcast operand of a reduction over the last dimension varies along that
        dimension only (the per-channel bias of a channels-last row): its element is then the
        position within the row, which the row kernels have (``row``), with no division."""
        rank = len(self.p_shape)
        return (acc.kind == "runs" and acc.space == "p" and self.kind == "reduce"
                and list(self.core_info.params["dims"]) == [rank - 1] and acc.runs == [(rank - 1, rank - 1)])

    def per_channel(self, acc: Access) -> bool:
        """Whether a broadcast operand varies with the batch and channel dims only (its runs end
        at dim 1 of an (N, C, spatial...) space): constant over one channel's spatial values, so a
        loop over them may index it at the channel's first element (``chan``). On a norm's
        channels-last view (N, *spatial, C), where a column (the column kernels') is one sample's
        channel (a group or instance norm) or one channel over every sample (a batch norm): runs
        over the batch and the last dim only, or the last dim only. Of a layer norm: runs before its
        normalised dims. Of a reduction (its column kernels, ``chan`` an output's first element):
        runs clear of the reduced dims. Of an NCHW pool: runs over N and C (``chan``: the window's
        plane's first element)."""
        if acc.kind != "runs":
            return False
        if self.kind == "reduce":        # the column kernels: runs clear of the reduced dims
            dims = self.core_info.params.get("dims")
            return bool(dims) and all(b < dims[0] or a > dims[-1] for a, b in acc.runs)
        if len(self.p_shape) < 3:
            return False
        if self.kind == "pool":
            # an NCHW pool's window lies in one (n, c) plane: ``chan`` is the plane's first element;
            # on the channels-last view (N, *spatial, C) a window crosses rows and columns, not channels
            return self.core_info.params.get("layout") == "nchw" and all(b <= 1 for _, b in acc.runs)
        if self.kind == "norm" and self.core_info.params.get("channels_last"):
            last = len(self.p_shape) - 1
            ok = {(last, last)} if self.op == "batch_norm" else {(0, 0), (last, last)}
            return all(tuple(r) in ok for r in acc.runs)
        if self.kind == "norm" and self.op == "layer_norm":
            # a layer norm's row is its last nd dims (``chan``: the row's first element): an operand
            # varying only over the dims before them (level2/3 and 34: the conv's bias, the rows
            # along W) is constant along a row
            lead = len(self.p_shape) - int(self.core_info.params["nd"])
            return all(b < lead for _, b in acc.runs)
        return all(b <= 1 for _, b in acc.runs)

    # storage types ----------------------------------------------------------------------
    def _to_float(self, k: int, expr: str) -> str:
        return expr if self.inputs[k].ctype == "float" else f"static_cast<float>({expr})"

    def load(self, k: int, index: str) -> str:
        """Element ``index`` of input ``k`` as a float."""
        return self._to_float(k, f"in{k}[{index}]")

    @property
    def largest(self) -> Optional[int]:
        """The most elements of any tensor the group reads or writes at the task's sizes (None where a
        shape is unknown)."""
        shapes = [self.p_shape, self.e_shape] + [inp.shape for inp in self.inputs] + [shape_of(n) for n in self.nodes]
        if any(sh is None for sh in shapes):
            return None
        return max(_numel(sh) for sh in shapes)

    def reach(self) -> dict[str, bool]:
        """Which of a norm's or a reduction's CUDA kernels (``LAUNCH_VARIANTS``) its launch can pick at
        the task's sizes (every one for other groups and unknown sizes)."""
        sp = self.p_shape
        if self.kind not in ("norm", "reduce") or sp is None or any(not isinstance(d, int) for d in sp):
            return dict.fromkeys(LAUNCH_VARIANTS, True)
        return self._norm_reach(sp) if self.kind == "norm" else self._reduce_reach(sp)

    def _reduce_reach(self, sp) -> dict[str, bool]:
        """``cuda_reduce.cu.j2``'s launch, read at the task's sizes (outer x R x inner around the
        reduced dims): rows of R contiguous elements (inner 1, R >= 32) go to a warp per row (with
        its in-register variant) up to 1024 and to a block per row past it; other shapes to the
        column kernel, and where R >= 4096 to the split column kernels (when outputs are fewer than
        the SMs hold, which the launch reads from the GPU: kept for any GPU)."""
        dims = self.core_info.params.get("dims")
        if not dims:
            return dict.fromkeys(LAUNCH_VARIANTS, True)
        d0, d1 = dims[0], dims[-1]
        reduced, inner = _numel(sp[d0:d1 + 1]), _numel(sp[d1 + 1:])
        rows = inner == 1 and reduced >= 32
        return {"block": rows and reduced > 1024, "warp": rows and reduced <= 1024, "cols": not rows,
                "split": not rows and reduced >= 4096}

    def _norm_reach(self, sp) -> dict[str, bool]:
        """``cuda_norm.cu.j2``'s launch, read at the task's sizes: the row length ``L`` (layer norm: the
        normalised dims; group norm: a group's channels x spatial; instance norm: the spatial size;
        batch norm: batch x spatial) picks a warp per row (``L <= 1024``) or a block per row; the
        split statistics run only where ``L >= 16384`` (and rows are fewer than the SMs, which the
        launch reads from the GPU, or ``L >= 65536``: kept for any GPU); BatchNorm over a spatial
        size of 1 with more than one row in the batch (and any norm of the channels-last view)
        takes the column tiles, split into chunks of rows where long (``_cpart``/``_cfin``)."""
        p, rank = self.core_info.params, len(sp)
        if self.op == "layer_norm":
            n_batch, spatial, length = 0, 0, _numel(sp[rank - p["nd"]:])
        elif p.get("channels_last"):        # columns of (N * spatial, C) (or of each sample's (spatial, C)
            #                                 for a group or instance norm): the column kernels' layout
            if self.op != "batch_norm":
                return {"block": False, "warp": False, "cols": True, "split": _numel(sp[1:rank - 1]) >= 16384}
            n_batch, spatial, length = _numel(sp[:rank - 1]), 1, _numel(sp[:rank - 1])
        else:
            n_batch, spatial = sp[0], _numel(sp[2:])
            length = {"group_norm": sp[1] // max(p.get("groups", 1), 1) * spatial, "instance_norm": spatial,
                      "batch_norm": n_batch * spatial}.get(self.op)
            if length is None:
                return dict.fromkeys(LAUNCH_VARIANTS, True)
        cols = self.op == "batch_norm" and spatial == 1 and n_batch > 1
        split = length >= 16384
        rows = not cols                  # columns: the column tiles, or their split (_cpart/_cfin) where long
        return {"block": rows and length > 1024, "warp": rows and length <= 1024, "cols": cols, "split": split}

    @property
    def dtypes(self) -> set:
        return {i.dtype for i in self.inputs} | {self.out_dtype}

    @property
    def has_half(self) -> bool:
        """Whether the kernel loads or stores a 2-byte type (its code needs the c10 headers)."""
        return any(is_half(d) for d in self.dtypes)

    def vec_type(self, k: Optional[int] = None) -> str:
        """The 4-element vector of input ``k`` (None: of the output): ``float4`` for float, an
        8-byte ``KlVec4`` of the half type (common.h.j2)."""
        ctype = self.out_ctype if k is None else self.inputs[k].ctype
        return "float4" if ctype == "float" else f"KlVec4<{ctype}>"

    def vec_bytes(self, k: Optional[int] = None) -> int:
        """The alignment (bytes) a 4-element vector load of input ``k`` (None: the output) needs."""
        dtype = self.out_dtype if k is None else self.inputs[k].dtype
        return 8 if is_half(dtype) else 16

    def out_param(self) -> str:
        return f"{self.out_ctype}* __restrict__ out"

    def out_arg(self) -> str:
        return f"static_cast<{self.out_ctype}*>(outs[0])"

    def _operand(self, o: Any, loads: dict[int, str]) -> str:
        if isinstance(o, Node):
            if o in self.members:
                return self.var(o)
            return loads[self._input_of[o]]
        return c_float(o)

    def _wanted(self, nodes: list[Node], extra_loads: Optional[list[Value]] = None) -> list[int]:
        """The inputs ``nodes`` (and ``extra_loads``) read, each once, in order of first use."""
        wanted: list[int] = []
        for n in nodes:
            for o in self.plan.infos[n].operands:
                if isinstance(o, Node) and o not in self.members:
                    wanted.append(self._input_of[o])
        for v in extra_loads or []:
            wanted.append(self._input_of[v.key if isinstance(v, ModuleAttr) else v])
        return list(dict.fromkeys(wanted))

    def _prologue_extra(self) -> list[Value]:
        if self.core is None:
            return []
        data = self.core_info.operands[0]
        return [] if data in self.members else [data]

    def plane_loads(self, chan: str) -> str:
        """Declarations ``const float pl<k>`` of the prologue's operands fixed over a plane
        (``per_channel``), read at ``chan``: placed before a loop over the plane's elements, whose
        ``prologue(..., hoisted=True)`` then reads them (a pool's window loop, unrolled with a guard
        on each element, keeps an index division under each guard otherwise)."""
        lines = []
        for k in self._wanted(self.prologue_nodes, self._prologue_extra()):
            acc = self.accesses[(k, "p")]
            if acc.kind == "runs" and self.per_channel(acc):
                lines.append(f"const float pl{k} = {self._load_expr(acc, chan, None, chan)};")
        return "\n".join(lines)

    def _body(self, nodes: list[Node], space: str, index: str, lane: Optional[int], prefix: str,
              extra_loads: Optional[list[Value]] = None, chan: Optional[str] = None,
              row: Optional[str] = None, hoisted: bool = False) -> tuple[list[str], dict[int, str]]:
        lines: list[str] = []
        loads: dict[int, str] = {}
        for k in self._wanted(nodes, extra_loads):
            acc = self.accesses[(k, space)]
            if hoisted and acc.kind == "runs" and self.per_channel(acc):
                loads[k] = f"pl{k}"                 # declared by ``plane_loads``
                continue
            name = f"{prefix}{k}"
            lines.append(f"const float {name} = {self._load_expr(acc, index, lane, chan, row)};")
            loads[k] = name
        for n in nodes:
            info = self.plan.infos[n]
            args = [self._operand(o, loads) for o in info.operands]
            lines.append(f"const float {self.var(n)} = {ew_expr(info.op, args, info.params)};")
        return lines, loads

    def prologue(self, index: str = "i", lane: Optional[int] = None, assign: bool = False,
                 chan: Optional[str] = None, row: Optional[str] = None, hoisted: bool = False) -> str:
        """Statements computing every prologue value and ``x`` (the core's input, or the output);
        ``assign``: assign an ``x`` declared outside instead of declaring it; ``chan``: the index
        of the first element of ``index``'s channel, for the per-channel operands (``per_channel``);
        ``row``: the position of ``index`` within its row, for the operands ``along_row``;
        ``hoisted``: the per-channel operands read from ``plane_loads``' declarations."""
        decl = "x = " if assign else "const float x = "
        if self.core is None:
            lines, _ = self._body(self.prologue_nodes, "p", index, lane, "a", chan=chan, row=row, hoisted=hoisted)
            lines.append(f"{decl}{self.var(self.out_node)};")
            return "\n".join(lines)
        data = self.core_info.operands[0]
        extra = self._prologue_extra()
        lines, loads = self._body(self.prologue_nodes, "p", index, lane, "a", extra, chan=chan, row=row,
                                  hoisted=hoisted)
        x = self.var(data) if data in self.members else loads[self._input_of[data]]
        lines.append(f"{decl}{x};")
        return "\n".join(lines)

    def raw_core_input(self) -> Optional[int]:
        """The kernel input the core reads as it is (no prologue, float32, read element for element):
        one a block may copy straight into shared memory (``cp.async``); None where a prologue computes
        the core's input or a conversion stands between."""
        if self.core is None or self.prologue_nodes:
            return None
        k = self._input_of.get(self.core_info.operands[0])
        acc = self.accesses.get((k, "p")) if k is not None else None
        return k if acc is not None and acc.kind == "direct" and self.inputs[k].ctype == "float" else None

    @property
    def cache_ok(self) -> bool:
        """The write pass can take ``x`` from a cache: no epilogue operator reads a prologue value."""
        pro = set(self.prologue_nodes)
        return not any(o in pro for n in self.epilogue_nodes for o in self.plan.infos[n].operands
                       if isinstance(o, Node))

    @property
    def tail_op(self) -> Optional[str]:
        """The tail reduction's operator (``sum``, ``mean``), None without one."""
        return self.plan.infos[self.tail].op if self.tail is not None else None

    def epilogue(self, core_value: str, index: str, lane: Optional[int] = None, row: Optional[str] = None,
                 chan: Optional[str] = None) -> str:
        """Statements after the core: ``t_<core> = core_value`` then the epilogue; result in ``z``
        (``row`` and ``chan`` as for the prologue; with a tail, ``z`` is the value it reduces)."""
        lines = [f"const float {self.var(self.core)} = {core_value};"]
        body, _ = self._body(self.epilogue_nodes, self.epi_space, index, lane, "b", row=row, chan=chan)
        lines += body
        last = self.epilogue_nodes[-1] if self.epilogue_nodes else self.core
        lines.append(f"const float z = {self.var(last if self.tail is not None else self.out_node)};")
        return "\n".join(lines)

    def run_params(self, itype: str) -> str:
        parts = []
        for acc in self.runs_list():
            for j in range(len(acc.runs)):
                parts.append(f"const KlRun<{itype}> {acc.name}{j}")
        return ", ".join(parts)

    def run_args(self, itype: str) -> str:
        parts = []
        for acc in self.runs_list():
            for j in range(len(acc.runs)):
                p = acc.meta_pos + 3 * j
                parts.append(f"KlRun<{itype}>{{({itype})meta[{p}], ({itype})meta[{p + 1}], ({itype})meta[{p + 2}]}}")
        return ", ".join(parts)

    def in_params(self) -> str:
        return ", ".join(f"const {i.ctype}* __restrict__ in{i.index}" for i in self.inputs)

    def in_args(self) -> str:
        return ", ".join(f"static_cast<const {i.ctype}*>(ins[{i.index}])" for i in self.inputs)

    def describe(self) -> str:
        return " -> ".join(self.ops)
