"""Render a plan into a candidate: kernels (jinja2 templates), C++ wrappers and the Python module."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence

import jinja2
from torch.fx import Node

from agent.builtin import graphed, pysource
from agent.builtin.conv import DEFAULT_TILE, rendered_tile, shared_floats, tile_shape
from agent.builtin.conv_stats import amend_wrapper, stats_var
from agent.builtin.dtypes import at_type, c_type
from agent.builtin.gemm import TcGemm, tc3_gemms
from agent.builtin.kernels import (LANES, NARROW_MAX_ELEMENTS, LAUNCH_VARIANTS, KernelGroup, narrow_indices_on,
                                   split_reduce_on, static_variants_on)
from agent.builtin.layout import forward_statement, uses_to_channels_last
from agent.builtin.c_expr import c_float
from agent.builtin.plan import Plan
from agent.builtin.pool import fixed_meta as pool_fixed_meta, wrapper_sizes
from agent.builtin.pysource import fmt, pytorch_statement, var
from agent.builtin.trace import Traced

TEMPLATES = Path(__file__).resolve().parent / "templates"
HEADER_PREFIX = "# kernelloop-builtin: "
BLOCK_SIZES = (256, 128, 512)


@dataclass(frozen=True)
class Knobs:
    fusion: str = "max"        # max | no_prologue | split | elementwise
    vec: bool = True           # 4-element vector loads (cuda: float4, 8 bytes for half types) / omp simd (cpu)
    block: int = 256           # threads per block (cuda); chunk/tile scale (cpu)
    reduce: str = "onepass"    # onepass | twopass (logsumexp/softmax, norm statistics)
    matmul: str = "tc3"        # tc3 (large GEMMs as split-TF32 tensor-core GEMMs, cuda; see gemm.py) | ieee
    layout: str = "nhwc"       # nhwc (convolutions in channels-last, epilogues on the permuted view; see layout.py) | nchw
    attention: str = "fused"   # fused (q@k^T..softmax|relu..@v in one kernel, see attention.py) | library
    recurrent: str = "fused"   # fused (nn.LSTM/GRU/RNN with their own time loop, see recurrent.py) | library
    conv: str = "library"      # library (cuDNN/oneDNN) | direct (small-K convolutions as fp32 FMA kernels with their epilogue, see conv.py)
    conv_tile: str = DEFAULT_TILE   # the direct convolution's CUDA tile (conv.TILES, conv.SLIDE_TILES)
    graph: str = "replay"      # replay (the forward replayed from a CUDA graph where it launches many kernels, see graphed.py) | off

    def as_dict(self) -> dict[str, Any]:
        # the fields are strings, bools and ints: a shallow dict (``asdict`` deep-copies, and the
        # proposer asks this of every one of the thousands of settings ``variant_order`` ranks)
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _env() -> jinja2.Environment:
    global _ENV
    if _ENV is None:
        _ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                                  undefined=jinja2.StrictUndefined, trim_blocks=True,
                                  lstrip_blocks=True, keep_trailing_newline=True,
                                  autoescape=False)
    return _ENV


_ENV: Optional[jinja2.Environment] = None


def render(template: str, **ctx: Any) -> str:
    return _env().get_template(template).render(**ctx)


# --------------------------------------------------------------------------------------
# Per-group kernel and wrapper
# --------------------------------------------------------------------------------------
class GroupCode:
    """KernelGroup plus roles of the norm parameters and the wrapper's statements."""

    def __init__(self, kg: KernelGroup, device: str, knobs: Knobs):
        self.kg = kg
        self.device = device
        self.knobs = knobs
        self.roles: dict[str, int] = {}
        self.fn = kg.name          # the extension function it calls (another group's, where the code is the same)
        if kg.core_info is not None and kg.kind == "norm":
            names = self._param_roles()
            for role, idx in zip(names, kg.params):
                self.roles[role] = idx
        self._layout_meta()

    def _param_roles(self) -> list[str]:
        info = self.kg.core_info
        p = info.params
        if info.op in ("group_norm", "instance_norm"):
            return ["weight", "bias"] if p.get("affine") else []
        if info.op == "layer_norm":
            return (["weight"] if p.get("weight") else []) + (["bias"] if p.get("bias") else [])
        roles = ["weight", "bias"] if p.get("affine") else []
        if p.get("track"):
            roles += ["running_mean", "running_var"]
        return roles

    # template helpers (g.*) -----------------------------------------------------------
    def __getattr__(self, item: str) -> Any:
        return getattr(self.kg, item)

    def role(self, name: str) -> Optional[int]:
        return self.roles.get(name)

    @property
    def fixed_meta(self) -> int:
        if self.kg.kind == "pool":
            return pool_fixed_meta(self.kg.core_info.params)
        return {"ew": 2, "reduce": 4, "norm": 11, "conv": 9}[self.kg.kind]

    def _layout_meta(self) -> None:
        pos = self.fixed_meta
        for acc in self.kg.runs_list():
            acc.meta_pos = pos
            pos += 3 * len(acc.runs)

    @property
    def uses_knobs(self) -> set[str]:
        op = self.kg.op
        if self.kg.kind == "pool":          # one thread per output (cuda); rows or pixels (cpu)
            return {"block"} if self.device == "cuda" else set()
        if self.kg.kind == "conv":          # its tile (cuda); output rows (cpu)
            return {"conv", "conv_tile"} if self.device == "cuda" else {"conv"}
        used = set() if (self.device == "cpu" and self.kg.kind == "norm") else {"block"}
        if self.device == "cuda" or self.kg.kind in ("ew", "norm") or op in ("softmax", "log_softmax", "logsumexp"):
            used.add("vec")
        if self.kg.kind == "norm" or op in ("logsumexp", "softmax", "log_softmax"):
            used.add("reduce")
        return used

    def summary_line(self) -> str:
        """The candidate's docstring line for this kernel."""
        return (f"{self.kg.name}: {self.kg.kind} kernel fusing {self.kg.describe()} "
                f"(nodes {', '.join(n.name for n in self.kg.nodes)})")

    def kernel_source(self) -> str:
        kg = self.kg
        template = {"ew": "ew", "reduce": "reduce", "norm": "norm", "pool": "pool", "conv": "conv"}[kg.kind]
        template = f"{'cuda' if self.device == 'cuda' else 'cpu'}_{template}." + ("cu.j2" if self.device == "cuda" else "cpp.j2")
        eps = c_float(kg.core_info.params["eps"]) if kg.kind == "norm" else "0.f"
        source = render(template, g=self, op=kg.op, vec=self.knobs.vec, block=self.knobs.block,
                        twopass=self.knobs.reduce == "twopass", lanes=LANES, eps=eps,
                        split_rows=self.device == "cuda" and split_reduce_on(),
                        blocks_per_sm=max(2048 // self.knobs.block, 1) * 2,
                        chunk=self.knobs.block * 32, tile=max(self.knobs.block // 4, 16),
                        pool=kg.core_info.params if kg.kind == "pool" else None,
                        conv=self._conv_ctx() if kg.kind == "conv" else None,
                        narrow=self.narrow, reach=self.reach,
                        view=kg.kind == "norm" and kg.op in ("group_norm", "instance_norm")
                        and bool(kg.core_info.params.get("channels_last")))
        return source if self.device == "cuda" else cpu_math(source)

    @property
    def reach(self) -> dict[str, bool]:
        """The norm or reduction kernels compiled (``KernelGroup.reach``): those the launch can pick at
        the task's sizes where the group is built for them (``narrow``), every one elsewhere."""
        if self.narrow and static_variants_on():
            return self.kg.reach()
        return dict.fromkeys(LAUNCH_VARIANTS, True)

    @property
    def narrow(self) -> bool:
        """Whether the CUDA kernel is built with 32-bit indices only (``kernels.narrow_indices_on``)."""
        largest = self.kg.largest
        return self.device == "cuda" and narrow_indices_on() and largest is not None and largest <= NARROW_MAX_ELEMENTS

    # wrapper ---------------------------------------------------------------------------
    def wrapper(self) -> dict[str, Any]:
        kg = self.kg
        lines: list[str] = []
        state = {self.roles.get("running_mean"), self.roles.get("running_var")} - {None}
        for inp in kg.inputs:
            fn = "kl_state" if inp.index in state else "kl_prep"
            lines.append(f'torch::Tensor in{inp.index} = {fn}(t{inp.index}, {at_type(inp.dtype)}, who, '
                         f'"{_c_str(inp.label)}");')
        rank = len(kg.p_shape)
        sp_inputs = ", ".join(f"in{k}.sizes()" for k in kg.space_inputs)
        lines.append(f"const std::vector<int64_t> sp = kl_broadcast({{{sp_inputs}}}, {rank}, who);")
        lines.append("std::vector<long long> meta;")
        lines.append(f"meta.push_back((long long)kl_prod(sp, 0, {rank}));")
        shape_e = "sp"
        fmeta = "0.0"
        if kg.kind == "ew":
            lines.append(f"meta.push_back((long long)kl_prod(sp, 0, {rank}));")
            out_shape = "sp"
        elif kg.kind == "reduce":
            dims = kg.core_info.params["dims"]
            d0, d1 = dims[0], dims[-1]
            lines.append(f"meta.push_back((long long)kl_prod(sp, 0, {d0}));")
            lines.append(f"meta.push_back((long long)kl_prod(sp, {d0}, {d1 + 1}));")
            lines.append(f"meta.push_back((long long)kl_prod(sp, {d1 + 1}, {rank}));")
            if kg.op in ("softmax", "log_softmax"):
                out_shape = "sp"
            else:
                keep = kg.core_info.params["keepdim"]
                parts = []
                for d in range(rank):
                    if d0 <= d <= d1:
                        if keep:
                            parts.append("1")
                    else:
                        parts.append(f"sp[{d}]")
                lines.append(f"const std::vector<int64_t> osh{{{', '.join(parts)}}};")
                out_shape = "osh"
                shape_e = "osh"
        elif kg.kind == "pool":
            lines += wrapper_sizes(self.kg.core_info.params)
            out_shape = shape_e = "osh"
        elif kg.kind == "conv":
            lines += self._conv_sizes()
            out_shape = shape_e = "osh"
            if kg.tail is not None:         # its tail reduction's output: (N, C_out), spatial dims kept as 1s
                keep = kg.plan.infos[kg.tail].params["keepdim"]
                lines.append(f"const std::vector<int64_t> tsh{{N, {kg.core_info.params['out_channels']}"
                             + ", 1" * (rank - 2 if keep else 0) + "};")
                out_shape = "tsh"
        else:
            lines += self._norm_sizes(rank)
            out_shape = "sp"
            if kg.op == "batch_norm":
                fmeta = "factor"
        for acc in kg.accesses.values():
            shape = "sp" if acc.space == "p" else shape_e
            if acc.kind == "direct":
                lines.append(f"kl_direct(in{acc.input}, {shape}, who);")
            elif acc.kind == "scalar":
                lines.append(f"kl_scalar(in{acc.input}, who);")
        for acc in kg.runs_list():
            shape = "sp" if acc.space == "p" else shape_e
            runs = ", ".join(f"{{{a}, {b}}}" for a, b in acc.runs)
            lines.append(f"kl_runs(in{acc.input}, {shape}, {{{runs}}}, meta, who);")
        first = kg.space_inputs[0]
        out_dtype = at_type(kg.out_dtype)
        # (a tail reduction's kernel adds its partial sums into a zeroed output)
        alloc = "zeros" if kg.tail is not None else "empty"
        lines.append(f"torch::Tensor out = torch::{alloc}({out_shape}, in{first}.options().dtype({out_dtype}));")
        sig = [f"torch::Tensor t{i.index}" for i in kg.inputs]
        if kg.op == "batch_norm":
            sig += ["bool use_batch", "bool update", "double factor"]
        w = {"name": kg.name, "describe": _c_str(kg.describe()), "signature": ", ".join(sig),
             "body": lines, "in_ptrs": ", ".join(f"in{i.index}.data_ptr<{i.ctype}>()" for i in kg.inputs),
             "out_ptr": f"out.data_ptr<{c_type(kg.out_dtype)}>()", "fmeta": fmeta}
        amend_wrapper(kg, w, self._conv_ctx()["tile"] if kg.kind == "conv" else None)   # (conv_stats.py)
        return w

    def _conv_ctx(self) -> dict[str, Any]:
        """The direct convolution's template context: its parameters, the CUDA tile, the shared
        memory it stages, and which kernel inputs are its weight and bias."""
        p = self.kg.core_info.params
        tile = rendered_tile(p, self.knobs.conv_tile, tail=self.kg.tail is not None or self.kg.stats_to is not None)
        s_in, s_w = shared_floats(p, tile)
        return {**p, "tile": tile_shape(tile, p["out_channels"], p["kernel3"][2]), "s_in": s_in, "s_w": s_w,
                "w": self.kg.params[0], "b": self.kg.params[1] if p["bias"] else None}

    def _conv_sizes(self) -> list[str]:
        """meta[1..8] of a direct convolution (outputs, N, D, H, W, OD, OH, OW; D = OD = 1 in 2-D)
        and its output shape ``osh`` (N, C_out, [OD,] OH, OW)."""
        p = self.kg.core_info.params
        dims, ci, co = p["dims"], p["in_channels"], p["out_channels"]
        w = self.kg.params[0]
        lines = [f"TORCH_CHECK(sp.size() == {dims + 2} && sp[1] == {ci}, who, \": the input must have {ci} channels\");",
                 f"TORCH_CHECK(in{w}.numel() == {co * p['k']}, who, \": the weight has the wrong size\");",
                 "const int64_t N = sp[0], D = " + ("sp[2]" if dims == 3 else "1")
                 + f", H = sp[{dims}], W = sp[{dims + 1}];"]
        if p["bias"]:
            lines.append(f"TORCH_CHECK(in{self.kg.params[1]}.numel() == {co}, who, \": the bias has the wrong size\");")
        outs = []
        for name, size in zip(("OD", "OH", "OW"), ("D", "H", "W")):
            i = ("OD", "OH", "OW").index(name)
            k, s, pad, dil = p["kernel3"][i], p["stride3"][i], p["padding3"][i], p["dilation3"][i]
            outs.append(f"{name} = ({size} + {2 * pad} - {dil * (k - 1) + 1}) / {s} + 1")
        lines.append(f"TORCH_CHECK(D + {2 * p['padding3'][0]} >= {p['dilation3'][0] * (p['kernel3'][0] - 1) + 1} && "
                     f"H + {2 * p['padding3'][1]} >= {p['dilation3'][1] * (p['kernel3'][1] - 1) + 1} && "
                     f"W + {2 * p['padding3'][2]} >= {p['dilation3'][2] * (p['kernel3'][2] - 1) + 1}, who, "
                     '": the kernel is larger than the padded input");')
        lines.append("const int64_t " + ", ".join(outs) + ";")
        lines.append("const std::vector<int64_t> osh{N, " + str(co) + (", OD" if dims == 3 else "") + ", OH, OW};")
        for v in (f"N * {co} * OD * OH * OW", "N", "D", "H", "W", "OD", "OH", "OW"):
            lines.append(f"meta.push_back((long long)({v}));")
        return lines

    def _norm_sizes(self, rank: int) -> list[str]:
        kg = self.kg
        op = kg.op
        p = kg.core_info.params
        w, b = self.roles.get("weight"), self.roles.get("bias")
        lines = []
        if op == "layer_norm":
            nd = p["nd"]
            lines.append(f"const int64_t D = kl_prod(sp, {rank - nd}, {rank});")
            lines.append(f"const int64_t rows = kl_prod(sp, 0, {rank - nd});")
            vals = ["rows", "1", "D", "D", "D", "D", "1", "1"]
            cnt = "D"
        else:
            # rows of (rows, nseg, seglen, segstride, rowstride). On the channels-last view (N, *spatial,
            # C), norm_nhwc.py: a batch norm's row c is column c of the (N * spatial, C) matrix, its
            # elements C apart; a group norm's row (n, g) is S segments of its cpg channels, C apart,
            # from n * S * C + g * cpg (the kernels' two-level row base; an instance norm: cpg = 1)
            last = bool(p.get("channels_last"))
            cdim, s0, s1 = (rank - 1, 1, rank - 1) if last else (1, 2, rank)
            lines.append(f"const int64_t N = sp[0], C = sp[{cdim}];")
            lines.append(f"const int64_t S = kl_prod(sp, {s0}, {s1});")
            cnt = "C"
            if op == "group_norm":
                g = p["groups"]
                lines.append(f"TORCH_CHECK(C % {g} == 0, who, \": channels are not divisible by the groups\");")
                lines.append(f"const int64_t cpg = C / {g};")
                vals = ([f"N * {g}", "S", "cpg", "C", "cpg"] if last
                        else [f"N * {g}", "1", "cpg * S", "cpg * S", "cpg * S"]) + ["C", "cpg", "S"]
            elif op == "instance_norm":
                vals = (["N * C", "S", "1", "C", "1"] if last else ["N * C", "1", "S", "S", "S"]) + ["C", "1", "S"]
            else:
                vals = (["C", "N * S", "1", "C", "1"] if last else ["C", "N", "S", "C * S", "S"]) + ["C", "1", "S"]
        for v in vals:
            lines.append(f"meta.push_back((long long)({v}));")
        if op == "batch_norm":
            lines.append("meta.push_back(use_batch ? 1 : 0);")
            lines.append("meta.push_back(update ? 1 : 0);")
        else:
            lines.append("meta.push_back(1);")
            lines.append("meta.push_back(0);")
        for role in ("weight", "bias", "running_mean", "running_var"):
            k = self.roles.get(role)
            if k is not None:
                lines.append(f'TORCH_CHECK(in{k}.numel() == {cnt}, who, ": {role} has the wrong size");')
        return lines

    def python_call(self) -> list[str]:
        kg = self.kg
        args = [i.py for i in kg.inputs]
        out = var(kg.out_node) + (f", {stats_var(kg.name)}" if kg.stats_to else "")
        args += [stats_var(kg.stats_from)] if kg.stats_from else []
        if kg.op != "batch_norm":
            return [f"{out} = _ext.{self.fn}({', '.join(args)})"]
        path = kg.core_info.params["module"]
        m = pysource.attr_path(path)
        if kg.core_info.params.get("track"):
            return [
                f"_bn = {m}",
                "_update = _bn.training and _bn.track_running_stats",
                "if _update:",
                "    _bn.num_batches_tracked.add_(1)",
                "    _factor = (1.0 / float(_bn.num_batches_tracked)) if _bn.momentum is None else float(_bn.momentum)",
                "else:",
                "    _factor = 0.0",
                f"{out} = _ext.{self.fn}({', '.join(args)}, bool(_bn.training), bool(_update), _factor)",
            ]
        return [f"{out} = _ext.{self.fn}({', '.join(args)}, True, False, 0.0)"]


_EXPF = re.compile(r"(?<![\w.])expf\(")


def cpu_math(source: str) -> str:
    """A CPU kernel's ``expf`` calls as ``kl_expf`` (common.h.j2): vectorisable, within 1.4 ulp."""
    return _EXPF.sub("kl_expf(", source)


def _c_str(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', "'")


# --------------------------------------------------------------------------------------
# The whole candidate
# --------------------------------------------------------------------------------------
@dataclass
class Rendered:
    source: str
    header: dict[str, Any]
    groups: list[GroupCode] = field(default_factory=list)
    knobs_used: set[str] = field(default_factory=set)
    tc: list[TcGemm] = field(default_factory=list)      # library GEMMs run as split-TF32 GEMMs
    shared: dict[str, str] = field(default_factory=dict)   # group -> the group whose kernel it calls (share_kernels)

    @property
    def has_kernel(self) -> bool:
        """Whether the candidate runs code of its own: a fused group or a split-TF32 GEMM."""
        return bool(self.groups or self.tc)


def body_hash(source: str) -> str:
    """Hash of a candidate without its header line: identical code, whatever the header says."""
    lines = source.splitlines()
    if lines and lines[0].startswith(HEADER_PREFIX):
        lines = lines[1:]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def render_candidate(traced: Traced, plan: Plan, kgroups: list[KernelGroup], device: str,
                     knobs: Knobs, header: dict[str, Any], init: Optional[list[str]] = None,
                     extra: Sequence[Any] = ()) -> Rendered:
    """``init``: lines of the candidate's own ``__init__`` (layout.py); ``extra``: further kernels with
    GroupCode's interface (attention.AttnCode, recurrent.RnnCode), after the plan's."""
    codes = [GroupCode(kg, device, knobs) for kg in kgroups] + list(extra)
    # groups computing the same (an unrolled loop's steps, a network's repeated blocks) call one kernel
    shared = share_kernels(codes[:len(kgroups)])
    for c in codes:
        if c.kg.name in shared:
            c.fn = shared[c.kg.name]
    for g in header.get("groups", []):
        if g["name"] in shared:
            g["kernel"] = shared[g["name"]]
    own = [c for c in codes if c.kg.name not in shared]
    inside = {n for c in extra for n in c.kg.nodes}
    qualifying = [g for g in tc3_gemms(plan.infos, traced.modules, device, traced.precision) if g.node not in inside]
    tc = qualifying if knobs.matmul == "tc3" else []
    tc_fns = {g.fn for g in tc}
    kernels = "\n".join(c.kernel_source() for c in own)
    if tc:
        kernels += ("\n" if kernels else "") + render("cuda_tc.cu.j2")
    # the channels-last input copy (layout.py), in candidates that build their own kernels anyway
    to_cl = device == "cuda" and bool(codes or tc) and uses_to_channels_last(traced)
    if to_cl:
        kernels += ("\n" if kernels else "") + render("cuda_nhwc.cu.j2")
    common = render("common.h.j2", device=device, half=any(c.kg.has_half for c in codes))
    wrappers = render("wrapper.cpp.j2", device=device, wrappers=[c.wrapper() for c in own],
                      tc_linear="kl_tc_linear" in tc_fns, tc_matmul="kl_tc_matmul" in tc_fns, to_cl=to_cl)
    if device == "cuda":
        cuda_source = common + "\n" + kernels
        cpp_source = wrappers
    else:
        cuda_source = ""
        cpp_source = common + "\n" + kernels + "\n" + wrappers
    digest = hashlib.sha256((cpp_source + cuda_source).encode()).hexdigest()[:16]
    ext_name = f"kl_builtin_{device}_{digest}"
    forward = emit_forward(traced, plan, codes, tc, to_cl)
    # the launch-bound forward replayed from a CUDA graph (graphed.py): a knob where it applies
    graph_ok = graphed.offered(traced, plan.infos, {n for c in codes for n in c.kg.nodes}, len(codes), device)
    graph = graph_ok and knobs.graph == "replay"
    if graph:
        forward = graphed.wrap_forward(forward, [n for n in traced.gm.graph.nodes if n.op == "placeholder"],
                                       [g.kept for g in tc if g.kept])
    if init:
        forward = "\n".join(["    def __init__(self, *args, **kwargs):", *("        " + line for line in init),
                              "", forward])
    used: set[str] = set()
    for c in codes:
        used |= c.uses_knobs
    if qualifying:
        used.add("matmul")
    if graph_ok:
        used.add("graph")
    spec = traced.spec
    summary = _summary(plan, codes, tc, traced.precision, shared)
    functions = [c.kg.name for c in own] + sorted(tc_fns) + (["kl_to_cl"] if to_cl else [])
    source = render(
        "candidate.py.j2",
        header=json.dumps(header, sort_keys=True, separators=(",", ":")),
        task_name=spec.name, summary=summary, build=bool(functions), device=device,
        prelude=pysource.task_prelude(spec), constants=pysource.constants_block(traced.constants),
        cpp_source=cpp_source, cuda_source=cuda_source, ext_name=ext_name,
        functions=repr(functions), layers=pysource.layers_class(spec),
        forward=forward, graph_runtime=render("graph_replay.py.j2", warmups=graphed.WARMUPS) if graph else "")
    return Rendered(source=source, header=header, groups=codes, knobs_used=used, tc=tc, shared=shared)


def cuda_source_of(candidate: str) -> str:
    """A CUDA candidate's device code (its ``_CUDA_SOURCE``, which includes only cuda_runtime.h: nvcc
    compiles it without torch's headers); empty where it has none."""
    m = re.search(r'_CUDA_SOURCE = r"""\n(.*?)\n"""', candidate, re.S)
    return m.group(1) if m else ""


def share_kernels(codes: list[GroupCode]) -> dict[str, str]:
    """Groups whose kernel and wrapper are another group's but for names -> that group's name.

    Their own kernel would be the same code under another name (each step of an unrolled loop
    has its group): they call the first one's instead, so the extension holds each kernel once.
    Names are the group's (``kl_g3``), its values' (``t_<node>``) and its inputs' labels (in the
    wrapper's messages, which then name the first group's inputs)."""
    first: dict[str, str] = {}
    shared: dict[str, str] = {}
    for c in codes:
        kg = c.kg
        wrapper = c.wrapper()
        body = wrapper["body"]
        for inp in kg.inputs:
            body = [line.replace(f'"{_c_str(inp.label)}"', f'"in{inp.index}"') for line in body]
        text = c.kernel_source() + "\n" + json.dumps({**wrapper, "body": body}, sort_keys=True)
        text = re.sub(rf"(?<!\w){kg.name}(?!\d)", "kl_g", text)        # kl_g3, kl_g3_impl, kl_g3_cpu ...
        values = {f"t_{n.name}": f"t_{i}" for i, n in enumerate(kg.nodes)}
        text = re.sub(r"(?<!\w)(" + "|".join(values) + r")(?!\w)", lambda m: values[m.group(1)], text)
        key = hashlib.sha256(text.encode()).hexdigest()
        if key in first:
            shared[kg.name] = first[key]
        else:
            first[key] = kg.name
    return shared


def _summary(plan: Plan, codes: list[GroupCode], tc: list[TcGemm], precision: str = "fp32",
             shared: Optional[dict[str, str]] = None) -> list[str]:
    out = []
    if precision != "fp32":
        halves = sorted({c_type(d) for c in codes for d in c.kg.dtypes if c_type(d) != "float"})
        out.append(f"Precision {precision}: the model and its inputs are in the half type. The kernels load and "
                   f"store {', '.join(halves) or 'it'}, compute every operator and accumulate every reduction "
                   "in float32, and round each result once, on store. Library operators (GEMMs, "
                   f"convolutions) stay on PyTorch in {precision} (the split-TF32 GEMM is for fp32 only).")
    for c in codes:
        out.append(c.summary_line())
    if shared:
        out.append(f"{len(shared)} of these groups compute what an earlier group does and call its kernel: "
                   f"{len(codes) - len(shared)} kernel(s) in the extension.")
    for g in tc:
        out.append(f"{g.fn} ({g.node.name}, [{g.m}x{g.k}] x [{g.k}x{g.n}]): the float32 GEMM runs as split-TF32 "
                   "tensor-core GEMMs with K-chunked accumulation: each operand is split into its TF32 rounding "
                   "and the float32 remainder; cuBLAS (TF32 on for these calls only) computes bias + the two "
                   "cross products in one GEMM, then adds the big x big product in K-chunks of 256 with "
                   "float32 rounding: within 2x of an fp32 SGEMM's error against float64 (0.6-1.75x measured on an H200).")
    on_tc = {g.node for g in tc} | {n for c in codes for n in c.kg.nodes}
    lib = [n.name for n, i in plan.infos.items() if i.kind == "library" and n not in on_tc]
    if lib:
        out.append(f"Library operators kept on PyTorch: {', '.join(lib)}.")
    other = [f"{n.name} ({i.note})" for n, i in plan.infos.items() if i.kind == "other" and n not in on_tc]
    if other:
        out.append(f"Left on PyTorch: {'; '.join(other)}.")
    if not codes:
        if tc:
            out.append("Nothing could be fused: the candidate's own code is its split-TF32 GEMM.")
        else:
            out.append("Nothing could be fused: this candidate runs the library operators only.")
    return out


def emit_forward(traced: Traced, plan: Plan, codes: list[GroupCode], tc: Optional[list[TcGemm]] = None,
                 to_cl: bool = False) -> str:
    nodes = list(traced.gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    at_output = {c.kg.out_node: c for c in codes}
    group_of = {n: c for c in codes for n in c.kg.nodes}
    device_src = next((p for p in placeholders if p.meta.get("tensor_meta") is not None), None)
    on_tc = {g.node: g for g in tc or []}
    body: list[str] = []
    for n in nodes:
        info = plan.infos[n]
        if n.op == "placeholder":
            continue
        if n.op == "output":
            # the module attributes the reference's forward assigns (state kept across calls)
            body.extend(f"self.{path} = {fmt(node)}" for path, node in traced.rebinds.items())
            body.append(f"return {fmt(n.args[0])}")
            continue
        if n in group_of:
            c = at_output.get(n)
            if c is not None:
                body.append(f"# {c.kg.name}: {c.kg.describe()}")
                body.extend(c.python_call())
            continue
        if info.kind == "alias":
            src = info.operands[0]
            if isinstance(src, Node):
                g = group_of.get(src)
                if g is not None and g.kg.out_node is not src:
                    continue      # its source lives inside a kernel, and so do all its users
                suffix = ".contiguous()" if info.op == "contiguous" else ""
                body.append(f"{var(n)} = {fmt(src)}{suffix}")
                continue
        if n in on_tc:
            body.append(on_tc[n].comment())
            body.append(on_tc[n].statement())
            continue
        why = None
        if info.kind == "other":
            why = f"# not covered by builtin: {info.op} ({info.note}); stays on PyTorch"
        elif info.kind == "library":
            why = f"# library operator {info.op}: stays on PyTorch"
        elif info.fusible and n.name in plan.excluded:
            why = f"# {info.op}: left to PyTorch after an earlier failure"
        elif info.fusible:
            why = f"# {info.op}: kept on PyTorch in this variant ({plan.fusion} fusion)"
        layout_lines = forward_statement(n, to_cl, traced.modules)
        if layout_lines is not None:     # a layout copy, or an operator of the view left to PyTorch
            body.extend(([why] if why is not None and info.fusible else []) + layout_lines)
            continue
        if why is not None:
            body.append(why)
        stmt = pytorch_statement(n, traced.constants)
        if n.op == "get_attr" and n.target in traced.constants and device_src is not None:
            stmt = f"{var(n)} = _kl_constant({n.target!r}, {var(device_src)}.device)"
        body.append(stmt)
    sig = pysource.signature(placeholders)
    text = [f"    def forward({sig}):"]
    text += ["        " + line for line in shape_checks(traced.shapes)]
    text += ["        " + line for line in body]
    return "\n".join(text)


def shape_checks(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The forward's first statements where the trace specialised on its inputs' shapes
    (``Traced.shapes``): the code was unrolled for those shapes and computes something else for
    any other, so another shape is refused with the reason, never run."""
    lines = []
    for name, shape in shapes.items():
        want = tuple(int(d) for d in shape)
        lines += [f"if tuple({name}.shape) != {want!r}:",
                  f"    raise ValueError(f\"ModelNew was generated for {name} of shape {want!r} (the task's inputs: "
                  f"its trace read that shape and unrolled on it), got {{tuple({name}.shape)}}\")"]
    return lines
