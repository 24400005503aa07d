"""Reading the generator's own earlier attempts back from ``ProposalRequest.history``.

Each generated source starts with ``# kernelloop-builtin: {json}`` recording its knobs and
its groups (node names). From the history the generator derives:

* ``cuts``/``excluded``: a group that failed (compile error, load error, runtime error,
  timeout, incorrect output) and was never part of a correct attempt is narrowed - split
  around its core, halved, or (a single operator) left to PyTorch. A compiler or runtime
  message that names one kernel (``kl_g3``) blames that group alone;
* ``bad knobs``: a failure whose groups all appear in correct attempts blames the knobs; a
  failure that names the split-TF32 GEMM (``kl_tc_*``), or one whose only code of its own is
  that GEMM, blames ``matmul="tc3"``;
* ``precision``: a correct attempt whose precision the sandbox doubts (see ``precision_doubt``)
  is never the best, and where it ran split-TF32 GEMMs it blames ``matmul="tc3"``;
* ``best``: the fastest correct attempt, around which exploration continues;
* ``seen``: hashes of every earlier source body, so no identical source is proposed twice.

All of it under the run's precision (its ``Numerics``): only attempts generated for that
precision (the header's ``precision``; none recorded: ``fp32``) are read, since a float16
kernel's verdict says nothing about a float32 one, and the split-TF32 GEMM (``matmul``) is
considered, blamed and explored under ``fp32`` only; under ``fp16``/``bf16`` the knob is
pinned to ``ieee`` (PyTorch's own GEMM).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from agent.builtin.attention import ATTENTION_MODES
from agent.builtin.codegen import BLOCK_SIZES, HEADER_PREFIX, Knobs, body_hash
from agent.builtin.conv import DEFAULT_TILE, tile_names
from agent.builtin.gemm import MATMUL_MODES
from agent.builtin.graphed import GRAPH_MODES
from agent.builtin.layout import LAYOUTS
from agent.builtin.plan import FUSION_MODES, narrow
from agent.builtin.recurrent import RECURRENT_MODES
from agent.builtin.search import SearchState, neighbour_key, read_search
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # agent.types pulls in pydantic; the generator itself needs only torch and jinja2
    from agent.types import AttemptView

FAILED = {"compile_error", "load_error", "runtime_error", "timeout", "incorrect"}
_GROUP_RE = re.compile(r"\bkl_g(\d+)(?!\d)")
_TC_RE = re.compile(r"\bkl_tc_")
TC3 = ("matmul", "tc3")


def parse_header(source: Optional[str]) -> Optional[dict[str, Any]]:
    if not source:
        return None
    for line in source.splitlines()[:3]:
        if line.startswith(HEADER_PREFIX):
            try:
                value = json.loads(line[len(HEADER_PREFIX):])
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


@dataclass
class Feedback:
    cuts: set[str] = field(default_factory=set)
    excluded: set[str] = field(default_factory=set)
    bad_knobs: set[tuple[str, Any]] = field(default_factory=set)
    bad_combos: set[frozenset] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)
    best: Optional[dict[str, Any]] = None          # header of the fastest correct attempt
    best_ms: Optional[float] = None
    notes: list[str] = field(default_factory=list)
    precision: str = "fp32"                        # the run's (Numerics.precision)
    best_attempt: Optional[int] = None             # the attempt id of ``best``
    search: Optional[SearchState] = None           # what the measured parent -> child steps say (search.py)
    # a correct attempt that only the harness's ``contended`` flag kept from being clean, faster as
    # measured than every clean one and measured once: its header and attempt id (``remeasured``)
    remeasure: Optional[dict[str, Any]] = None
    remeasure_attempt: Optional[int] = None
    remeasure_hash: Optional[str] = None

    def knob_ok(self, k: Knobs) -> bool:
        items = frozenset(k.as_dict().items())
        return items not in self.bad_combos and not (items & self.bad_knobs)


def _named_groups(att: AttemptView, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The group a failure points at: by the compiler's line in the candidate source, or by a
    kernel name in the first compiler error / the runtime error message (never the whole log,
    which names every kernel)."""
    names = {g["name"]: g for g in groups}
    r = att.result
    if r is None:
        return []
    if r.build is not None and r.build.first_error_line and att.source:
        g = _group_at_line(att.source, r.build.first_error_line)
        if g in names:
            return _with_sharers(names[g], groups)
    texts = [r.build.first_error if r.build is not None else None, r.error_message]
    for text in texts:
        if not text:
            continue
        found = [f"kl_g{m}" for m in _GROUP_RE.findall(text)]
        hits = [names[f] for f in dict.fromkeys(found) if f in names]
        if hits:
            return _with_sharers(hits[0], groups)
    return []


def _with_sharers(group: dict[str, Any], groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A group and the groups that call its kernel (the header's ``kernel``, see
    ``codegen.share_kernels``): a failure of that kernel is theirs too."""
    return [group] + [g for g in groups if g.get("kernel") == group["name"]]


def _group_at_line(source: str, line: int) -> Optional[str]:
    """The marked block (``kl_g3``, or ``kl_tc`` for the split-TF32 GEMM) holding ``line``
    (``// ---- kl_g3 begin`` in C++/CUDA sources, ``# ---- kl_g3 begin`` in Triton ones)."""
    current = None
    for text in source.splitlines()[:line]:
        m = re.search(r"(?://|#) ---- (kl_g\d+|kl_tc) (begin|end)", text)
        if m:
            current = m.group(1) if m.group(2) == "begin" else None
    return current


def _knobs_of(header: dict[str, Any]) -> dict[str, Any]:
    """A header's knobs as ``Knobs(**...)`` takes them. Headers written before the ``matmul`` knob
    existed lack it: those attempts ran their library GEMMs on PyTorch in float32, ``ieee``."""
    knobs = dict(header.get("knobs") or {})
    if knobs and "matmul" not in knobs:
        knobs["matmul"] = "ieee"
    if knobs and "layout" not in knobs:
        knobs["layout"] = "nchw"     # written before the layout knob: convolutions ran in NCHW
    if knobs and "recurrent" not in knobs:
        knobs["recurrent"] = "library"   # written before the recurrent knob: nn.LSTM/GRU/RNN ran as the library's
    if knobs and "graph" not in knobs:
        knobs["graph"] = "off"           # written before the graph knob: no CUDA graph
    return knobs


def _flags(result: Any) -> list[tuple[str, str]]:
    out = []
    for f in getattr(result, "flags", None) or []:
        kind = getattr(f, "kind", None)
        out.append((str(getattr(kind, "value", kind)), str(getattr(f, "reason", ""))))
    return out


# The static scan's notes that a source uses a half type: under fp16/bf16 that is the run's own
# format (every candidate loads and stores it), not a narrowing of it.
_HALF_NOTE = "half type"


def precision_doubt(result: Any, precision: str = "fp32") -> Optional[str]:
    """Why a correct result's precision is in doubt, or None: a measured ``inaccurate`` flag, or
    a ``precision`` flag where the sandbox did not measure the error against float64 (where it
    did, its ``inaccurate`` flag, not the static scan's note, is the verdict). Under the run's
    ``precision`` fp16/bf16 a note that the source uses a half type is no doubt."""
    flags = _flags(result)
    for kind, reason in flags:
        if kind == "inaccurate":
            return f"inaccurate: {reason}"
    notes = [reason for kind, reason in flags if kind == "precision"
             and not (precision != "fp32" and _HALF_NOTE in reason)]
    if notes and not result.fp64_measured:
        return f"precision: {notes[-1]}"
    return None


def _names_tc(att: AttemptView) -> bool:
    """Whether a failure points at the split-TF32 GEMM: the compiler's line inside its code, or
    ``kl_tc_`` in the first compiler error / the runtime error message."""
    r = att.result
    if r is None:
        return False
    if r.build is not None and r.build.first_error_line and att.source:
        if _group_at_line(att.source, r.build.first_error_line) == "kl_tc":
            return True
    texts = [r.build.first_error if r.build is not None else None, r.error_message]
    return any(t and _TC_RE.search(t) for t in texts)


def header_precision(header: dict[str, Any]) -> str:
    """The precision a candidate was generated for (headers written before precisions: fp32)."""
    return str(header.get("precision") or "fp32")


def read_history(history: list[AttemptView], device: str, precision: str = "fp32",
                 math: Optional[str] = None) -> Feedback:
    """What the history says, from the attempts generated for this device, precision and (when
    given) math mode: under ``strict`` the reference's convolutions are full fp32 and under
    ``default`` TF32, so a verdict or a time taken under one says nothing about the other."""
    fb = Feedback(precision=precision)
    fp32 = precision == "fp32"
    ours: list[tuple[AttemptView, dict[str, Any]]] = []
    for att in sorted(history, key=lambda a: (a.round, a.attempt_id)):
        if att.source:
            fb.seen.add(body_hash(att.source))
        h = parse_header(att.source)
        if h is None or h.get("device") != device or att.result is None:
            continue
        if header_precision(h) != precision or (math and h.get("math", math) != math):
            continue            # generated for another convention: its verdicts are not this run's
        ours.append((att, h))
    correct = [(a, h) for a, h in ours if a.result.correct]
    # the groups of a correct attempt computed the right values, whatever its flags say
    proven = {tuple(g["nodes"]) for _, h in correct for g in h.get("groups", [])}
    doubted = {id(a): precision_doubt(a.result, precision) for a, _ in correct}
    for att, h in correct:
        why = doubted[id(att)]
        if why is None:
            continue
        knobs = _knobs_of(h)
        if fp32 and knobs.get("matmul") == "tc3" and h.get("tc3"):
            fb.bad_knobs.add(TC3)
            fb.bad_combos.add(frozenset(knobs.items()))
            fb.notes.append(f"attempt {att.attempt_id} (correct, {why}): not counted as the best; "
                            f"blaming knobs {[TC3]} (split-TF32 GEMMs on {', '.join(h['tc3'])})")
        else:
            fb.notes.append(f"attempt {att.attempt_id} (correct, {why}): not counted as the best")
    correct = [(a, h) for a, h in correct if doubted[id(a)] is None]
    from agent.builtin.profiled import blame_slow

    blame_slow(correct, fb)     # the profile of a correct attempt slower than eager names a group
    good_values = {kv for _, h in correct for kv in _knobs_of(h).items()}
    for att, h in correct:
        t = att.result.candidate_time.median_ms if att.result.candidate_time else None
        if t is None:
            continue
        if fb.best_ms is None or t < fb.best_ms:
            fb.best, fb.best_ms, fb.best_attempt = h, t, att.attempt_id
    if fb.best is None and correct:
        fb.best, fb.best_attempt = correct[0][1], correct[0][0].attempt_id
    fb.search = read_search(correct, fb.best_attempt)
    remeasured(correct, fb)
    for att, h in ours:
        status = att.result.status.value if hasattr(att.result.status, "value") else str(att.result.status)
        if status not in FAILED:
            continue
        groups = h.get("groups", [])
        tc = h.get("tc3") or []
        knobs = _knobs_of(h)
        if fp32 and tc and knobs.get("matmul") == "tc3" and (not groups or _names_tc(att)):
            # the split-TF32 GEMM failed (or is the only code of its own): blame it, not the groups
            fb.bad_knobs.add(TC3)
            fb.bad_combos.add(frozenset(knobs.items()))
            fb.notes.append(f"attempt {att.attempt_id} ({status}): the split-TF32 GEMM failed; "
                            f"blaming knobs {[TC3]}")
            continue
        if not groups:
            continue
        named = _named_groups(att, groups)
        pool = named or groups
        culprits = [g for g in pool if tuple(g["nodes"]) not in proven]
        if knobs:
            fb.bad_combos.add(frozenset(knobs.items()))
        if not culprits:
            bad = {kv for kv in knobs.items() if kv not in good_values}
            fb.bad_knobs |= bad
            fb.notes.append(f"attempt {att.attempt_id} ({status}): its groups all ran correctly elsewhere; "
                            f"blaming knobs {sorted(bad) or sorted(knobs.items())}")
            continue
        for g in culprits:
            cuts, excl = narrow(list(g["nodes"]), list(g.get("kinds", [])))
            fb.cuts |= cuts
            fb.excluded |= excl
            what = f"left {', '.join(sorted(excl))} to PyTorch" if excl else f"cut after {', '.join(sorted(cuts))}"
            fb.notes.append(f"attempt {att.attempt_id} ({status}): group {g['name']} "
                            f"({' -> '.join(g.get('ops', []))}) narrowed: {what}")
    return fb


# The third entry is the first's twin with PyTorch's own float32 GEMM, so that the loop measures
# the split-TF32 GEMMs against it early (on tasks without a qualifying GEMM the knob is
# normalised away and the twin is the first again, skipped as seen). The fourth is the first's
# twin in NCHW: convolutions run in channels-last by default (layout.py), measured against it
# (on tasks without a convolution the knob is normalised away the same way). Where convolutions
# may run in TF32 (cuda, PyTorch's defaults), and on the CPU, the NCHW twin comes first instead (variant_order).
# The fifth is the NCHW twin with its small-K convolutions as direct fp32 kernels fused with their
# epilogue (conv.py; normalised away where there is none, or where they are off: cuda with
# KERNELLOOP_CUDA_CONV=0); where the NCHW twin comes first it comes second, before channels-last:
# the small-K convolutions it applies to are those whose NCHW cuDNN algorithm is not TF32 (C_in 3-8),
# where the channels-last candidate fails the tolerance (session l), and on an H200 the direct
# kernels measured 1.47x torch.compile on six such 3-D tasks against cuDNN's 1.03x (session q).
DEFAULT_ORDER = [
    Knobs("max", True, 256, "onepass", "tc3"),
    Knobs("max", False, 256, "twopass", "tc3"),
    Knobs("max", True, 256, "onepass", "ieee"),
    Knobs("max", True, 256, "onepass", "tc3", "nchw"),
    Knobs("max", True, 256, "onepass", "tc3", "nchw", conv="direct"),
    Knobs("max", True, 256, "onepass", "tc3", attention="library"),     # attention's matmuls on the library
    Knobs("max", True, 256, "onepass", "tc3", recurrent="library"),     # nn.LSTM/GRU/RNN as the library's layers
    Knobs("max", True, 512, "twopass", "tc3"),
    Knobs("no_prologue", True, 256, "onepass", "tc3"),
    Knobs("elementwise", True, 256, "onepass", "tc3"),
    Knobs("max", True, 128, "onepass", "tc3"),
    Knobs("split", True, 256, "twopass", "tc3"),
]
# (the direct convolution with each of its tiles in NCHW only: the channels-last graph keeps cuDNN)
_CONVS = [("library", DEFAULT_TILE)] + [("direct", t) for t in tile_names()]
ALL_KNOBS = [Knobs(f, v, b, r, m, lay, a, rec, cv, tile, gr) for cv, tile in _CONVS for f in FUSION_MODES
             for v in (True, False) for b in BLOCK_SIZES for r in ("onepass", "twopass") for m in MATMUL_MODES
             for lay in LAYOUTS for a in ATTENTION_MODES for rec in RECURRENT_MODES for gr in GRAPH_MODES
             if cv == "library" or lay == "nchw"]
_ALL_INDEX = {k: i for i, k in enumerate(ALL_KNOBS)}
# Around the best, one-knob changes are tried in this order: the GEMM's mode and the convolutions'
# layout first (the GEMM or the convolution dominates the time of every task that has one).
_PRIORITY = {"matmul": 0, "layout": 0, "conv": 0, "graph": 0, "attention": 1, "recurrent": 1, "block": 2, "conv_tile": 2,
             "vec": 3, "reduce": 4, "fusion": 5}


def variant_order(fb: Feedback, precision: Optional[str] = None, nchw_first: bool = False,
                  direct_second: bool = False, graphs: bool = False) -> list[Knobs]:
    """Knob settings to try, best first: around the fastest correct attempt, else the default
    order. Under fp16/bf16 (``precision``, else the feedback's) every setting has
    ``matmul="ieee"``: there is no split-TF32 GEMM to try. Without ``graphs`` (the task's forward is
    not one the CUDA-graph replay applies to, graphed.py) every setting has ``graph="off"``; with it,
    and no best yet, the first setting's twin without the graph comes second.

    ``nchw_first``: the convolutions' own layout (``nchw``) comes first, its direct-convolution
    twin second (where the task has a small-K convolution; else it is the first again, skipped)
    and channels-last third. ``direct_second`` (convolutions keep NCHW, yet no layout rewrite
    exists: a convolution before a group norm), with no best yet: the first direct setting second,
    beside the first setting still to try (two knobs from the default, two rounds would not reach
    it). Where a task has no small-K convolution the twin renders the first's code and is skipped
    as seen. ``_propose_one`` asks for it on cuda where convolutions may run in TF32: a
    channels-last convolution is another cuDNN algorithm with its own TF32 rounding, and where
    the reference's NCHW one is not TF32 at all (level2/71_Conv2d_Divide_LeakyReLU on an H100:
    8 input channels) the channels-last candidate's 1e-3 differences fail the 1e-4 tolerance,
    in KernelBench's harness too, and the float64 rule (relative to the reference's own error)
    cannot excuse them. And on the CPU, where oneDNN's NCHW convolution of the seed tasks' few
    channels measured faster without the layout copies (conv2d_divide_leakyrelu: 1.16-1.19x
    eager in NCHW, 1.01-1.11x channels-last, scripts/bench_cpu_seeds.py)."""
    precision = precision or fb.precision
    if fb.best is not None and _knobs_of(fb.best):
        base = _knobs_of(fb.best)

        def key(k: Knobs) -> tuple:
            d = k.as_dict()
            diff = [name for name in d if d[name] != base.get(name)]
            # measured losses last; then measured wins, untried structural changes (GEMM mode,
            # layout, convolution) and the profile's order first (search.neighbour_key)
            lost, rank = neighbour_key({n: d[n] for n in diff}, fb.search)
            return (lost, len(diff), rank, sorted(_PRIORITY[n] for n in diff), _ALL_INDEX[k])

        order = sorted(ALL_KNOBS, key=key)
    else:
        first = DEFAULT_ORDER
        if nchw_first:
            first = [DEFAULT_ORDER[3], DEFAULT_ORDER[4], DEFAULT_ORDER[0]] + DEFAULT_ORDER[1:3] + DEFAULT_ORDER[5:]
        if graphs:        # the first's twin without the CUDA graph second
            first = [first[0], replace(first[0], graph="off")] + [k for k in first[1:] if k != replace(first[0], graph="off")]
        order = first + [k for k in ALL_KNOBS if k not in first]
    if precision != "fp32":
        order = list(dict.fromkeys(replace(k, matmul="ieee") for k in order))
    if not graphs:
        order = list(dict.fromkeys(replace(k, graph="off") for k in order))
    good = [k for k in order if fb.knob_ok(k)]
    kept = set(good)
    order = good + [k for k in order if k not in kept]
    if direct_second and not nchw_first and not (fb.best is not None and _knobs_of(fb.best)):
        direct = next((k for k in order if k.conv == "direct"), None)
        if direct is not None:
            order = [order[0], direct] + [k for k in order[1:] if k != direct]
    return order


_CONV_KERNEL_RE = re.compile(r"fprop|dgrad|implicit_conv|convolve", re.I)


def fp32_reference_convolution(history: list[AttemptView]) -> Optional[str]:
    """The name of a convolution kernel the reference ran in full fp32, where the profiles of the
    reference stored with earlier evaluations name convolution kernels (cuDNN's ``fprop``/``dgrad``
    implicit GEMMs and ``convolveNd`` engines) and none of them TF32 (``tf32`` in its name); None
    otherwise. Under PyTorch's default math cuDNN picks a full-fp32 NCHW algorithm for few input
    channels (level2/57: 8) and a TF32 one for the same convolution channels-last, whose 1e-3
    differences then fail the tolerance and the float64 rule."""
    names = [k.name for att in history if att.result is not None
             for k in (getattr(att.result, "reference_profile", None) or []) if _CONV_KERNEL_RE.search(k.name)]
    if not names or any("tf32" in n.lower() for n in names):
        return None
    return names[0]


def remeasured(correct: list[tuple[AttemptView, dict[str, Any]]], fb: Feedback) -> None:
    """Set ``fb.remeasure`` to the correct attempt to measure once more, if there is one: flagged
    ``contended`` and nothing else that disqualifies (the reference's window or the GPU was disturbed:
    the harness's condition, not the candidate's fault), at least as fast as eager and faster than
    every clean attempt as measured, and its source evaluated once. Session x: 7_GoogleNetInceptionV1's CUDA-graph candidate met a
    GPU slow for seconds (its own replay 4.4 ms against 1.15 in a quiet check) and was flagged; the
    next round measured its graph-free twin (0.48x eager), which became the clean best."""
    def timed(att: AttemptView) -> Optional[float]:
        t = getattr(att.result, "candidate_time", None)
        return t.median_ms if t is not None and t.median_ms > 0 else None

    clean = [timed(a) for a, _ in correct if a.result.clean and timed(a) is not None]
    hashes = {a.attempt_id: body_hash(a.source) for a, _ in correct}
    count = Counter(hashes.values())
    for att, h in sorted(correct, key=lambda ah: timed(ah[0]) or float("inf")):
        t = timed(att)
        if not att.result.contended_only or t is None or count[hashes[att.attempt_id]] > 1:
            continue
        if (att.result.speedup_eager or 0.0) >= 1.0 and (not clean or t < min(clean)):
            fb.remeasure, fb.remeasure_attempt, fb.remeasure_hash = h, att.attempt_id, hashes[att.attempt_id]
        return
