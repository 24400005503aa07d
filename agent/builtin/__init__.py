"""``--model builtin``: a fusion code generator that writes real kernels without a model.

``propose`` traces the task's reference with torch.fx (meta tensors, so GPU sizes cost
nothing), keeps library operators (GEMM, convolution, pooling) on PyTorch and turns the
chains between them into generated kernels - elementwise chains, reductions and
normalisations with fused prologues and epilogues - from the jinja2 templates in
``templates/`` (CUDA for ``cuda``, C++/OpenMP for ``cpu``). Each round it answers distinct
variants (where groups end, vectorised loads, block size, one- or two-pass statistics)
and it learns from the history of its own attempts (see ``feedback``). On ``cuda`` a large
float32 GEMM runs by default as split-TF32 tensor-core GEMMs with K-chunked accumulation
(the ``matmul`` knob, see ``gemm``), still through cuBLAS.

Everything follows the run's ``Numerics`` (``ProposalRequest.numerics``; None: fp32): the
reference is traced in its precision, and under ``fp16``/``bf16`` the kernels load and store
the half type while computing and accumulating in float32 (see ``dtypes``); the split-TF32
GEMM is for ``fp32`` only.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from agent.builtin import attention, conv_stats, recurrent, unrolled_rnn
from agent.builtin.codegen import HEADER_PREFIX, Knobs, Rendered, body_hash, render_candidate
from agent.builtin.dtypes import precision_of
from agent.builtin.feedback import (Feedback, _knobs_of, fp32_reference_convolution, parse_header, read_history,
                                    variant_order)
from agent.builtin.kernels import KernelGroup
from agent.builtin.plan import Plan, classify_graph, make_plan
from agent.builtin.search import lineage
from agent.builtin.trace import Traced, trace_task
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # agent.types pulls in pydantic; the generator itself needs only torch and jinja2
    from agent.types import AttemptView
    from sandbox.numerics import Numerics
from sandbox.tasks import TaskSpec

__all__ = ["GeneratedCandidate", "Knobs", "generate", "propose", "parse_header", "HEADER_PREFIX"]

HEADER_VERSION = 1
DEFAULT_KNOBS = Knobs()


@dataclass
class GeneratedCandidate:
    source: str
    choices: dict[str, Any]
    covered_ops: list[str] = field(default_factory=list)
    uncovered_ops: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Generator:
    def __init__(self, traced: Traced, device: str, fb: Feedback, math: Optional[str] = None,
                 layout: str = "nchw", init: Optional[list[str]] = None):
        self.traced = traced
        self.device = device
        self.fb = fb
        self.precision = traced.precision
        self.math = math                    # the run's math mode, recorded in the header
        self.infos = classify_graph(traced)
        self._plans: dict[str, tuple[Plan, list[KernelGroup], set[str]]] = {}
        self.layout = layout                # the graph's layout (see layout.py)
        self.init = init                    # the candidate's __init__ lines (nhwc: weight conversion)
        self._others: dict[str, Optional[_Generator]] = {}
        self._conv_infos: Optional[dict] = None
        self._rendered: dict[tuple[Knobs, frozenset], Rendered] = {}

    def infos_for(self, conv: str) -> dict:
        """The plan's classification under the ``conv`` knob: ``direct`` makes every supported
        convolution a ``conv`` core (conv.py); NCHW graphs only (the channels-last one keeps cuDNN)."""
        if conv != "direct" or self.layout != "nchw":
            return self.infos
        if self._conv_infos is None:
            from agent.builtin.conv import with_direct_convs

            self._conv_infos = with_direct_convs(list(self.traced.gm.graph.nodes), self.infos,
                                                 self.traced.modules, self.device)
        return self._conv_infos

    def other(self, layout: str) -> Optional["_Generator"]:
        """The generator of the same task in another layout (None: it would change nothing)."""
        if layout not in self._others:
            from agent.builtin.layout import channels_last, init_lines

            cl = channels_last(self.traced, self.infos) if layout == "nhwc" and self.layout == "nchw" else None
            self._others[layout] = None if cl is None else _Generator(
                cl.traced, self.device, self.fb, self.math, layout, init_lines(cl.weights) if cl.weights else None)
        return self._others[layout]

    def plan(self, fusion: str, excluded_extra: frozenset = frozenset(), conv: str = "library"):
        key = fusion + "|" + conv + "|" + ",".join(sorted(excluded_extra))
        if key not in self._plans:
            excluded = set(self.fb.excluded) | set(excluded_extra)
            for _ in range(64):
                plan = make_plan(self.traced, fusion, self.fb.cuts, excluded, infos=self.infos_for(conv))
                kgroups, bad = [], None
                for g in plan.groups:
                    try:
                        kgroups.append(KernelGroup(plan, g))
                    except (ValueError, KeyError):
                        bad = g
                        break
                if bad is None:
                    lone = _lone_small_groups(plan)
                    if not lone:
                        break
                    excluded |= lone
                    continue
                excluded |= {n.name for n in bad.nodes}
            conv_stats.link(kgroups, self.device, fusion)     # a batch norm's statistics from its convolution
            self._plans[key] = (plan, kgroups, excluded)
        return self._plans[key]

    def render(self, knobs: Knobs, excluded_extra: frozenset = frozenset()) -> Rendered:
        """The candidate for ``knobs`` (rendered once per generator: a proposal asks for the default's
        first, to learn whether the CUDA-graph knob applies, and then again in its variant order)."""
        key = (knobs, frozenset(excluded_extra))
        if key not in self._rendered:
            self._rendered[key] = self._render(knobs, frozenset(excluded_extra))
        return self._rendered[key]

    def _render(self, knobs: Knobs, excluded_extra: frozenset) -> Rendered:
        if knobs.layout != self.layout and self.layout == "nchw":
            other = self.other(knobs.layout)
            if other is not None:
                return other.render(knobs, excluded_extra)
        # attention spans (attention.py) leave the plan to one kernel each under attention="fused"
        spans = attention.find(list(self.traced.gm.graph.nodes), self.infos,
                               set(self.fb.excluded) | set(self.fb.cuts) | set(excluded_extra))
        fused = spans if knobs.attention == "fused" else []
        # Python loops of an Elman cell, unrolled by the trace (unrolled_rnn.py): one recurrent kernel each
        # (a node the forward assigns to the module, Traced.rebinds, is read outside the loop: no match)
        loops = unrolled_rnn.find(list(self.traced.gm.graph.nodes), self.traced.modules, self.infos,
                                  set(self.fb.excluded) | set(excluded_extra) |
                                  {n.name for n in self.traced.rebinds.values()})
        looped = loops if knobs.recurrent == "fused" else []
        inside = frozenset(n.name for sp in fused for n in sp.nodes) | frozenset(n.name for lp in looped for n in lp.nodes)
        plan, kgroups, excluded = self.plan(knobs.fusion, excluded_extra | inside, knobs.conv)
        excluded = excluded - inside
        # nn.LSTM/GRU/RNN calls (recurrent.py): library nodes of the plan, one kernel each under recurrent="fused"
        layers = recurrent.find(list(self.traced.gm.graph.nodes), self.traced.modules,
                                set(self.fb.excluded) | set(excluded_extra))
        cells = layers if knobs.recurrent == "fused" else []

        def extras(k: Knobs) -> list:
            return attention.codes(fused, len(plan.groups), self.infos, self.device, k) + \
                recurrent.codes(cells, len(plan.groups) + len(fused), self.device, k) + \
                unrolled_rnn.codes(looped, len(plan.groups) + len(fused) + len(cells), self.device, k)

        extra = extras(knobs)
        # knobs that change nothing in this plan are normalised, so equal code has equal headers
        probe = render_candidate(self.traced, plan, kgroups, self.device, knobs, {}, self.init, extra)
        used = probe.knobs_used | ({"attention"} if spans else set()) | ({"recurrent"} if layers or loops else set())
        # a layout is "used" where the graph has a convolution it rewrites (then both are distinct code)
        has_layouts = self.layout != "nchw" or self.other("nhwc") is not None
        eff = Knobs(fusion=knobs.fusion,
                    vec=knobs.vec if "vec" in used else DEFAULT_KNOBS.vec,
                    block=knobs.block if "block" in used else DEFAULT_KNOBS.block,
                    reduce=knobs.reduce if "reduce" in used else DEFAULT_KNOBS.reduce,
                    matmul=knobs.matmul if "matmul" in used else default_matmul(self.precision),
                    layout=self.layout if has_layouts else DEFAULT_KNOBS.layout,
                    attention=knobs.attention if "attention" in used else DEFAULT_KNOBS.attention,
                    recurrent=knobs.recurrent if "recurrent" in used else DEFAULT_KNOBS.recurrent,
                    conv=knobs.conv if "conv" in used else DEFAULT_KNOBS.conv,
                    conv_tile=knobs.conv_tile if "conv_tile" in used else DEFAULT_KNOBS.conv_tile,
                    graph=knobs.graph if "graph" in used else "off")
        # (where the knob is used it is kept as asked, so the probe ran the same GEMMs)
        extra = extras(eff)
        header = self.header(plan, kgroups + [c.kg for c in extra], eff, excluded, [g.node.name for g in probe.tc])
        return render_candidate(self.traced, plan, kgroups, self.device, eff, header, self.init, extra)

    def header(self, plan: Plan, kgroups: list[Any], knobs: Knobs, excluded: set[str],
               tc: list[str]) -> dict[str, Any]:
        infos = plan.infos
        groups = [{"name": kg.name, "kind": kg.kind, "ops": kg.ops, "nodes": [n.name for n in kg.nodes],
                   "kinds": [infos[n].kind for n in kg.nodes],
                   # a batch norm whose statistics its convolution sums (conv_stats.py)
                   **({"stats_from": kg.stats_from} if getattr(kg, "stats_from", None) else {})} for kg in kgroups]
        # attention.py's spans and recurrent.py's layers
        inside = {n for kg in kgroups if kg.kind in ("attention", "recurrent") for n in kg.nodes}
        return {
            "v": HEADER_VERSION, "generator": "builtin", "device": self.device, "task": self.traced.spec.name,
            "precision": self.precision, **({"math": self.math} if self.math else {}),
            "knobs": knobs.as_dict(), "groups": groups,
            "cuts": sorted(self.fb.cuts), "excluded": sorted(excluded),
            "library": [infos[n].op for n in infos if infos[n].kind == "library" and n not in inside],
            "tc3": tc,          # library GEMM nodes run as split-TF32 tensor-core GEMMs
            "uncovered": sorted({infos[n].op for n in infos if infos[n].kind == "other" and n not in inside}),
        }


# A forward with at least LONE_MIN_CALLS groups that are each the same one elementwise operator on
# at most LONE_MAX_NUMEL elements (an unrolled recurrence: level3/34_VanillaRNNHidden's 256 tanh of
# 8x256) keeps those operators on PyTorch: such a kernel fuses nothing, moves the same bytes and
# launches as often as eager's, and pays the extension's host glue on every call (the H200:
# 0.82x eager with kernel-per-tanh, 0.42x without vector loads; issue #39: no kernel that
# loses to eager's for its part).
LONE_MIN_CALLS = 16
LONE_MAX_NUMEL = 1 << 16


def _lone_small_groups(plan: Plan) -> set[str]:
    """The nodes of ``plan``'s launch-bound lone groups where there are many of them (see above)."""
    import math

    lone: dict[str, list[str]] = {}        # by operator: a recurrence repeats one, a task's chain does not
    for g in plan.groups:
        if len(g.nodes) != 1 or plan.infos[g.nodes[0]].kind != "ew":
            continue
        tm = g.nodes[0].meta.get("tensor_meta")
        if hasattr(tm, "shape") and math.prod(int(d) for d in tm.shape) <= LONE_MAX_NUMEL:
            lone.setdefault(plan.infos[g.nodes[0]].op, []).append(g.nodes[0].name)
    return {name for names in lone.values() if len(names) >= LONE_MIN_CALLS for name in names}


def default_matmul(precision: str) -> str:
    """The ``matmul`` knob of a candidate that runs no split-TF32 GEMM: ``tc3`` (the default)
    under fp32, ``ieee`` (PyTorch's own GEMM, the only one) under fp16/bf16."""
    return DEFAULT_KNOBS.matmul if precision == "fp32" else "ieee"


def propose(spec: TaskSpec, device: str, round: int, sample: int,
            history: Optional[list[AttemptView]] = None, numerics: Optional[Numerics] = None,
            backend: Optional[str] = None) -> GeneratedCandidate:
    """One candidate for one sample of one round (distinct from the round's other samples and
    from every source already in ``history``), in the run's ``numerics`` (None: fp32);
    ``backend`` ``triton``: Triton kernels for the elementwise groups (``triton_gen``), else the
    device's C++/CUDA. A candidate derived from an earlier attempt names it in its header
    (``parent``, ``changed``: see ``search``). A generator error costs the task its kernels, not
    every attempt: the candidate is then the reference's forward, the error in its header."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
    try:
        cand = _propose_one(spec, device, round, sample, history, numerics, backend)
    except Exception as exc:  # noqa: BLE001 - a generator bug, reported in the candidate
        traced = trace_task(spec, device, numerics)
        return _untraceable(traced, device, Feedback(precision=precision_of(numerics)), f"{type(exc).__name__}: {exc}")
    if backend != "triton" and history and not cand.choices.get("fallback"):
        fb = read_history(list(history), device, precision_of(numerics), getattr(numerics, "math", None))
        family = lineage(cand.choices, fb.best_attempt, _knobs_of(fb.best) if fb.best else {},
                         list(fb.best.get("excluded") or []) if fb.best else None)
        if family:
            cand.choices.update(family)
            cand.source = _rewrite_header(cand.source, cand.choices)
    return cand


def _propose_one(spec: TaskSpec, device: str, round: int, sample: int,
                 history: Optional[list[AttemptView]] = None, numerics: Optional[Numerics] = None,
                 backend: Optional[str] = None) -> GeneratedCandidate:
    """``propose``'s candidate, before its lineage is recorded."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
    history = list(history or [])
    if backend == "triton":
        return _propose_triton(spec, device, sample, history, numerics)
    precision = precision_of(numerics)
    fb = read_history(history, device, precision, getattr(numerics, "math", None))
    traced = trace_task(spec, device, numerics)
    if not traced.ok:
        return _untraceable(traced, device, fb)
    verdict = replay_verdict(spec, numerics, device)
    fb.excluded |= verdict.excluded
    fb.notes.extend(verdict.notes)
    # a reference that accepts only PyTorch's own bits, with convolutions that round in TF32 on
    # the target: a channels-last or generated convolution rounds differently, and the reference
    # amplifies it like any other rounding (level3/10_ResNet101: see docs/builtin_replay.md); so
    # also where every group kept its kernel because it gives PyTorch's bits (exact_bits.gives_pytorch_bits)
    forbidden = {("layout", "nhwc"), ("conv", "direct")} if verdict.ill_conditioned and \
        numerics is not None and "conv" in numerics.tf32_classes(device) else set()
    gen = _Generator(traced, device, fb, getattr(numerics, "math", None))
    picked: list[str] = []
    chosen: Optional[Rendered] = None
    # (only where a convolution is rewritten to channels-last: elsewhere both layouts are one code)
    nchw_convs = device == "cpu" or (numerics is not None and "conv" in numerics.tf32_classes(device))
    nchw_first = nchw_convs and gen.other("nhwc") is not None
    # where the reference's own convolutions ran full fp32, a channels-last one (TF32) is tried last
    full_fp32 = fp32_reference_convolution(history) if nchw_first and device == "cuda" else None
    if full_fp32 is not None and fb.search is not None:
        fb.search.doubtful.add(("layout", "nhwc"))
        fb.notes.append(f"the reference's convolution ran in full fp32 ({full_fp32.split('(')[0][:80]}): "
                        "channels-last (TF32 in cuDNN) tried after every other variant")
    # the CUDA-graph replay where it applies to this forward (graphed.py), else every setting without it
    graphs = "graph" in gen.render(DEFAULT_KNOBS).knobs_used
    # sample 0 measures again a correct candidate that only a disturbed window kept from being clean
    # (feedback.remeasured: the same source, once); the other samples take the variants as before
    again = gen.render(Knobs(**_knobs_of(fb.remeasure))) if device == "cuda" and fb.remeasure else None
    if again is not None and body_hash(again.source) != fb.remeasure_hash:
        again = None                # rendered differently now (a group left to PyTorch since): not a remeasure
    if again is not None and sample == 0:
        header = {**again.header, "repeat": True, "remeasure": fb.remeasure_attempt}
        chosen = copy.copy(again)   # (the generator's renderings are memoized: not changed in place)
        chosen.header, chosen.source = header, _rewrite_header(again.source, header)
        fb.notes.append(f"attempt {fb.remeasure_attempt} (correct, flagged contended only): measured again")
    sample -= again is not None
    for knobs in variant_order(fb, precision, nchw_first, direct_second=nchw_convs, graphs=graphs) if chosen is None else ():
        if set(knobs.as_dict().items()) & forbidden:
            continue
        r = gen.render(knobs)
        h = body_hash(r.source)
        if h in fb.seen or h in picked or not r.has_kernel:
            continue            # seen before, or no code of its own (kept for when all else is spent)
        picked.append(h)
        if len(picked) > sample:
            chosen = r
            break
    if chosen is None:
        # every knob setting was tried: leave everything to PyTorch if that is new, else repeat the best
        everything = frozenset(n.name for n, i in gen.infos.items() if i.fusible)
        layout = "nchw" if ("layout", "nhwc") in forbidden else DEFAULT_KNOBS.layout
        r = gen.render(Knobs(matmul="ieee", recurrent="library", graph="off", layout=layout), everything)
        if body_hash(r.source) not in fb.seen and body_hash(r.source) not in picked:
            chosen = r
        else:
            best = Knobs(**_knobs_of(fb.best)) if fb.best and fb.best.get("knobs") else DEFAULT_KNOBS
            chosen = gen.render(best)
            chosen.header["repeat"] = True
            chosen.source = _rewrite_header(chosen.source, chosen.header)
    if verdict.ran and (verdict.semantic or verdict.unverifiable or verdict.exact):
        chosen.header["replay"] = verdict.as_dict()
        chosen.source = _rewrite_header(chosen.source, chosen.header)
    covered = sorted({op for kg in chosen.groups for op in kg.kg.ops})
    uncovered = list(chosen.header.get("uncovered", []))
    excluded_ops = sorted({gen.infos[n].op for n in gen.infos if n.name in set(chosen.header.get("excluded", []))})
    return GeneratedCandidate(source=chosen.source, choices=chosen.header, covered_ops=covered,
                              uncovered_ops=sorted(set(uncovered) | set(excluded_ops)), notes=list(fb.notes))


_VERDICTS: dict[tuple, Any] = {}
_VERDICT_LOCK = threading.Lock()


def replay_verdict(spec: TaskSpec, numerics: Optional[Numerics] = None, device: str = "cpu"):
    """The plan replay's verdict on the task (``replay.check``; cached per task, numerics and
    target ``device``): the default candidate, rendered from the CPU trace, with its kernels
    emulated in eager PyTorch against the reference in training mode, with the target's TF32
    rounding where it has one. Never raises: a replay that cannot run says so."""
    tf32 = tuple(sorted(numerics.tf32_classes(device))) if numerics is not None else ()
    key = (spec.key, spec.name, precision_of(numerics), getattr(numerics, "math", None), tf32)
    with _VERDICT_LOCK:            # the backend's samples run in threads: one replay per task
        if key not in _VERDICTS:
            if len(_VERDICTS) > 64:
                _VERDICTS.clear()
            _VERDICTS[key] = _replay(spec, numerics, device)
        return _VERDICTS[key]


def _affordable_trace(spec: TaskSpec, numerics: Optional[Numerics]) -> tuple[Traced, Optional[str]]:
    """The CPU trace the replay runs: the task's own CPU sizes, or, where those are too large for
    it (``replay.affordable``) and the task has an integer ``batch_size``, the largest smaller
    batch (from 2 down to 1) that fits and traces the same graph. The second value says which
    batch, for the notes (None: the task's own sizes)."""
    from agent.builtin import replay
    from sandbox.tasks import load_task, with_device_sizes

    traced = trace_task(spec, "cpu", numerics)
    if not traced.ok or replay.affordable(traced):
        return traced, None
    try:
        batch = load_task(with_device_sizes(spec, "cpu"), validate=False).namespace.get("batch_size")
    except Exception:  # noqa: BLE001 - no smaller batch, then
        batch = None
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 1:
        return traced, None
    names = [n.name for n in traced.gm.graph.nodes]
    for b in sorted({min(2, batch - 1), 1}, reverse=True):
        small = TaskSpec(name=spec.name, path=spec.path, source=spec.source,
                         overrides={**spec.overrides, "batch_size": b})
        t = trace_task(small, "cpu", numerics)
        if t.ok and replay.affordable(t, replay.MAX_REDUCED_ELEMENTS) and [n.name for n in t.gm.graph.nodes] == names:
            return t, f"batch_size={b} (the task's {batch} is too large for the replay)"
    return traced, None


def _replay(spec: TaskSpec, numerics: Optional[Numerics], device: str = "cpu"):
    from agent.builtin import replay

    try:
        traced, resized = _affordable_trace(spec, numerics)
        if not traced.ok:
            verdict = replay.Verdict()
        else:
            gen = _Generator(traced, "cpu", Feedback(precision=traced.precision), getattr(numerics, "math", None))
            rendered = gen.render(Knobs(matmul="ieee"))
            # a channels-last candidate is the rewritten graph's: its groups hold that graph's nodes
            owner = gen.other(rendered.header["knobs"]["layout"]) or gen

            def rerender(excluded: frozenset):
                """The candidate with the nodes named in ``excluded`` left to PyTorch, in NCHW: the
                layout the proposal keeps for a reference that accepts only PyTorch's bits (its
                convolutions are the reference's calls)."""
                r = gen.render(Knobs(matmul="ieee", layout="nchw"), frozenset(excluded))
                return r, (gen.other(r.header["knobs"]["layout"]) or gen).infos
            # the models are built under the sandbox's seeds, each build and forward holding the
            # process's generator (rng.isolated_rng, in replay._run/_reference), not the whole check:
            # a big task's replay takes a minute, and other tasks' traces wait only between forwards
            verdict = replay.check(owner.traced, rendered, owner.infos, numerics, device,
                                   replay.MAX_REDUCED_ELEMENTS if resized else None, rerender)
            if resized and verdict.ran:
                verdict.notes.append(f"replay: run at {resized}")
    except Exception as exc:  # noqa: BLE001 - the replay is advice; the sandbox judges anyway
        verdict = replay.Verdict(notes=[f"replay: could not run ({type(exc).__name__}: {str(exc)[:200]})"])
    return verdict


def generate(spec: TaskSpec, device: str, knobs: Knobs = DEFAULT_KNOBS, cuts: tuple[str, ...] = (),
             excluded: tuple[str, ...] = (), numerics: Optional[Numerics] = None) -> GeneratedCandidate:
    """The candidate for explicit knobs (no history), in ``numerics`` (None: fp32): for tests and tools."""
    traced, r = _rendered(spec, device, knobs, cuts, excluded, numerics)
    if r is None:
        return _untraceable(traced, device, Feedback(precision=traced.precision))
    covered = sorted({op for kg in r.groups for op in kg.kg.ops})
    return GeneratedCandidate(source=r.source, choices=r.header, covered_ops=covered,
                              uncovered_ops=list(r.header.get("uncovered", [])))


def _rendered(spec: TaskSpec, device: str, knobs: Knobs, cuts: Any = (), excluded: Any = (),
              numerics: Optional[Numerics] = None) -> tuple[Traced, Optional[Rendered]]:
    """The task traced and, where it traced, rendered for explicit knobs, cuts and exclusions."""
    traced = trace_task(spec, device, numerics)
    if not traced.ok:
        return traced, None
    fb = Feedback(cuts=set(cuts), excluded=set(excluded), precision=traced.precision)
    return traced, _Generator(traced, device, fb, getattr(numerics, "math", None)).render(knobs)


def group_traffic(spec: TaskSpec, device: str, choices: dict[str, Any],
                  numerics: Optional[Numerics] = None) -> dict[str, dict[str, Any]]:
    """For a builtin candidate's header ``choices`` (its knobs, cuts and exclusions), each kernel
    group's name -> its ``kind``, ``ops`` and ``bytes``: every input read once and the output
    written once at the task's sizes, the least memory traffic its kernel can have (a norm's
    second pass, a tile's re-reads are not counted). With a profile's kernel times it gives each
    kernel's achieved bandwidth (``scripts/kernel_bandwidth.py``)."""
    import math

    from agent.builtin.ops import shape_of

    _, rendered = _rendered(spec, device, Knobs(**_knobs_of(choices)), choices.get("cuts") or (),
                            choices.get("excluded") or (), numerics)
    if rendered is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for code in rendered.groups:
        kg = code.kg
        shapes = [(i.shape, i.dtype) for i in getattr(kg, "inputs", [])]
        shapes.append((shape_of(kg.out_node) if getattr(kg, "out_node", None) is not None else None,
                       getattr(kg, "out_dtype", None)))
        if any(sh is None or dt is None for sh, dt in shapes):
            continue
        size = sum(math.prod(sh) * dt.itemsize for sh, dt in shapes)
        out[kg.name] = {"kind": kg.kind, "ops": list(kg.ops), "bytes": int(size)}
    return out


def _propose_triton(spec: TaskSpec, device: str, sample: int, history: list, numerics: Optional[Numerics]) -> GeneratedCandidate:
    from agent.builtin.triton_gen import propose_triton

    traced = trace_task(spec, device, numerics)
    if not traced.ok:
        return _untraceable(traced, device, Feedback(precision=traced.precision))
    cand = propose_triton(traced, device, sample, history, getattr(numerics, "math", None))
    covered = sorted({op for g in cand.groups for op in g.kg.ops})
    return GeneratedCandidate(source=cand.source, choices=cand.header, covered_ops=covered,
                              uncovered_ops=list(cand.header.get("uncovered", [])))


def _rewrite_header(source: str, header: dict[str, Any]) -> str:
    import json
    lines = source.split("\n")
    lines[0] = HEADER_PREFIX + json.dumps(header, sort_keys=True, separators=(",", ":"))
    return "\n".join(lines)


def _untraceable(traced: Traced, device: str, fb: Feedback, generator_error: Optional[str] = None) -> GeneratedCandidate:
    """A model torch.fx cannot trace (or, with ``generator_error``, whose trace the generator
    failed on): its forward, copied, on PyTorch (no kernel), the reason in the header, the
    docstring and the notes."""
    import json

    from agent.builtin import pysource

    spec = traced.spec
    kind = "generator_error" if generator_error else "untraceable"
    reason = generator_error or traced.error or ""
    header = {"v": HEADER_VERSION, "generator": "builtin", "device": device, "task": spec.name,
              "precision": traced.precision, "fallback": kind, "groups": [], "knobs": {},
              "reason": reason.splitlines()[0][:300] if reason else ""}
    error = reason.replace('"""', "'''")
    fwd = pysource.reference_forward(spec)
    fwd = "\n".join("    " + line for line in fwd.splitlines())
    prelude = pysource.task_prelude(spec)
    source = "\n".join([
        HEADER_PREFIX + json.dumps(header, sort_keys=True, separators=(",", ":")),
        '"""ModelNew for ' + spec.name + ", written by kernelloop's builtin generator.",
        "",
        ("torch.fx could not trace the reference" if kind == "untraceable" else
         "the builtin generator failed on this reference") + ", so nothing is fused: the forward below is the",
        "reference's own computation on PyTorch (no custom kernel).",
        f"{'Trace' if kind == 'untraceable' else 'Generator'} error: {error}",
        '"""',
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        "",
        prelude,
        "",
        "",
        pysource.layers_class(spec),
        "",
        "",
        "class ModelNew(_Layers):",
        fwd,
        "",
    ])
    return GeneratedCandidate(source=source, choices=header, covered_ops=[], uncovered_ops=[f"<{kind}>"],
                              notes=[f"{kind}: {reason}"])
