"""The arithmetic of ``cpu``'s interleaved timing blocks (``sandbox.checks._time_in_blocks``):
how the timed runs split into blocks, each block's median, the blocks' eager/candidate ratios, and
the burst rule that makes an evaluation ``contended``. Pure functions of ``Timing``s, so the critic's
evidence (``agent.critic.figures``) derives the same figures from a stored result that the judge
read when it flagged it.

The burst rule. Interleaving (ABBA) cancels the host's drift that both sides meet; a burst of load
that takes one side's whole block is not cancelled. Two conditions, both needed:

- the blocks' eager/candidate ratios differ by more than ``RATIO_SPREAD`` (a burst took a block);
- the speedup, the ratio of the two sides' medians over all runs, moves by more than
  ``LEAVE_ONE_OUT`` when any one block pair is left out (the burst reached the figure).

A burst the median absorbs (one block of four, its runs past the median) leaves the figure as the
quiet blocks give it and is not flagged; the 2-core CI host, with a llama.cpp server beside the
suite, met such bursts in one evaluation of three (a candidate block at 4.49 ms against 1.29-1.40 ms,
the speedup 1.00x with or without it).
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Optional, Sequence

# Blocks whose eager/candidate ratios (block medians) differ by more than this factor met a burst of
# load that one side's whole block took. On the idle-but-drifting 2-core host the A/A check's single
# evaluations ranged 0.84-1.08x with 4 blocks; a burst read one seed 4.11x (two eager blocks at
# 5.7-6.1 ms against 1.15-1.17 ms).
RATIO_SPREAD = 2.5
# ... and the speedup moved by more than this factor with one block pair left out.
LEAVE_ONE_OUT = 1.15


def block_plan(runs: int, blocks: int) -> list[tuple[int, int]]:
    """``runs`` timed runs in ``blocks`` blocks as even as can be: (first run, runs) per block."""
    blocks = max(1, min(blocks, runs))
    plan, off = [], 0
    for b in range(blocks):
        n = runs // blocks + (1 if b < runs % blocks else 0)
        plan.append((off, n))
        off += n
    return plan


def split_blocks(timing: Any) -> Optional[list[list[float]]]:
    """A stored side's runs per block (``Timing.samples_ms`` in run order, cut by ``block_plan``),
    or None where it was one block or its samples were not all kept."""
    blocks = getattr(timing, "blocks", None) or 1
    samples = list(getattr(timing, "samples_ms", None) or [])
    if blocks < 2 or len(samples) != timing.runs:
        return None
    return [samples[off:off + n] for off, n in block_plan(timing.runs, blocks)]


def block_runs(block: Any) -> list[float]:
    """One block ``Timing``'s runs: its samples, or its median repeated where they were not kept."""
    s = list(getattr(block, "samples_ms", None) or [])
    return s if len(s) == block.runs else [block.median_ms] * block.runs


def block_ratios(candidate: Sequence[Sequence[float]], eager: Sequence[Sequence[float]]) -> list[float]:
    """Each block pair's eager/candidate ratio of medians (each block given as its runs)."""
    out = []
    for c, e in zip(candidate, eager):
        cm = statistics.median(c)
        if cm > 0:
            out.append(statistics.median(e) / cm)
    return out


def leave_one_out(candidate: Sequence[Sequence[float]], eager: Sequence[Sequence[float]]) -> list[float]:
    """The speedup (median of eager runs / median of candidate runs) with block pair k left out, per k
    (each block given as its runs)."""
    out = []
    for k in range(min(len(candidate), len(eager))):
        c = [x for i, b in enumerate(candidate) if i != k for x in b]
        e = [x for i, b in enumerate(eager) if i != k for x in b]
        if c and e and statistics.median(c) > 0:
            out.append(statistics.median(e) / statistics.median(c))
    return out


def block_burst(candidate: Sequence[Any], eager: Sequence[Any]) -> Optional[str]:
    """Why a burst that one side's block met reached the speedup (the module's rule), or None."""
    c_runs, e_runs = [block_runs(b) for b in candidate], [block_runs(b) for b in eager]
    ratios = block_ratios(c_runs, e_runs)
    if len(ratios) < 2 or min(ratios) <= 0 or max(ratios) / min(ratios) <= RATIO_SPREAD:
        return None
    c_all = [x for b in c_runs for x in b]
    e_all = [x for b in e_runs for x in b]
    loo = leave_one_out(c_runs, e_runs)
    if min(statistics.median(c_all), statistics.median(e_all)) <= 0 or not loo or min(loo) <= 0:
        return None
    whole = statistics.median(e_all) / statistics.median(c_all)
    k = max(range(len(loo)), key=lambda i: abs(math.log(loo[i] / whole)))
    if abs(math.log(loo[k] / whole)) <= math.log(LEAVE_ONE_OUT):
        return None
    return ("a burst of load took one side's whole block: the blocks' eager/candidate ratios ranged "
            f"{min(ratios):.2f}-{max(ratios):.2f} (eager blocks {', '.join(f'{e.median_ms:.3g}' for e in eager)} ms, "
            f"candidate blocks {', '.join(f'{c.median_ms:.3g}' for c in candidate)} ms), and without block {k + 1} "
            f"the speedup reads {loo[k]:.2f}x instead of {whole:.2f}x")
