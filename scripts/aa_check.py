"""A/A check of the judge's timing: a task's own ``Model`` submitted as its candidate
(``class ModelNew(Model): pass``), evaluated ``--n`` times by the sandbox. An unbiased judge
gives speedups around 1.0x; the spread says how far one evaluation's speedup can be read.

Prints each evaluation's eager and candidate medians and speedup (on cpu with each side's page
faults per timed call, which should match), then the median and range. On the CPU target of a
2-core host (session p), four runs of 4-6 evaluations gave medians 0.82x-1.00x: the candidate's
timed calls paid 28 page faults each that the reference's did not (the run check's sampler,
fixed); after the fix five runs of 6 gave medians 0.94x-1.14x, single evaluations 0.77-1.38x:
one evaluation said little there. With the cpu timing's interleaved blocks (4, ABBA), under a loaded
host, medians 0.96x-1.02x, single evaluations 0.84-1.08x, where one block each gave 0.65-1.73x in the
same runs (``--blocks 1,4``; ``docs/judge.md``).

    python scripts/aa_check.py --device cpu --task tasks/seeds/conv2d_divide_leakyrelu.py --n 5
    python scripts/aa_check.py --device cpu --n 6 --blocks 1,4     # both conventions, alternating
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default=str(ROOT / "tasks/seeds/conv2d_divide_leakyrelu.py"), help="a task file")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--n", type=int, default=5, help="evaluations (per convention given to --blocks)")
    ap.add_argument("--blocks", default=None,
                    help="cpu: interleaved timing blocks per side (sandbox.checks), e.g. 4; a comma list "
                         "(1,4) alternates the conventions evaluation by evaluation in one sandbox, so both "
                         "meet the same host; default: KERNELLOOP_CPU_BLOCKS or its default (4)")
    args = ap.parse_args()

    from sandbox.blocks import split_blocks
    from sandbox.evaluate import Sandbox
    from sandbox.result import EvalConfig
    from sandbox.tasks import read_spec, with_device_sizes

    path = Path(args.task)
    spec = with_device_sizes(read_spec(path, name=f"aa/{path.stem}"), args.device)
    source = path.read_text() + "\n\nclass ModelNew(Model):\n    pass\n"
    conventions = [int(b) for b in args.blocks.split(",")] if args.blocks else [None]
    ratios: dict = {b: [] for b in conventions}
    pair_ratios: dict = {b: [] for b in conventions}
    with Sandbox(args.device, EvalConfig(time_compile=False, profile=False)) as sb:
        default = sb.timing_blocks
        for k in range(args.n * len(conventions)):
            blocks = conventions[k % len(conventions)]
            sb.timing_blocks = default if blocks is None else blocks     # read by each evaluation
            r = sb.evaluate(spec, source)
            if r.speedup_eager is None:
                print(f"evaluation {k}: {r.status.value}: {r.error_message}", flush=True)
                continue
            ratios[blocks].append(r.speedup_eager)
            faults = pair = ""
            if r.candidate_time.page_faults is not None and r.eager_time.page_faults is not None:
                faults = (f" (page faults per timed call: eager {r.eager_time.page_faults:g}, "
                          f"candidate {r.candidate_time.page_faults:g})")
            cand_blocks, eager_blocks = split_blocks(r.candidate_time), split_blocks(r.eager_time)
            if cand_blocks and eager_blocks:       # several blocks, every run's sample kept
                # the other estimator: the median of the per-block ratios (block b of each side)
                per = [statistics.median(e) / statistics.median(c) for c, e in zip(cand_blocks, eager_blocks)]
                pair_ratios[blocks].append(statistics.median(per))
                pair = f"; median of block ratios {pair_ratios[blocks][-1]:.3f}x"
            print(f"evaluation {k} [{r.candidate_time.convention}]: eager {r.eager_time.median_ms:.4f} ms, candidate "
                  f"(the same model) {r.candidate_time.median_ms:.4f} ms: {r.speedup_eager:.3f}x{pair}{faults}", flush=True)
    if not any(ratios.values()):
        return 1
    for blocks, got in ratios.items():
        if not got:
            continue
        label = "default blocks" if blocks is None else f"{blocks} block(s)"
        extra = ""
        if pair_ratios[blocks]:
            pr = pair_ratios[blocks]
            extra = (f"; median of block ratios: median {statistics.median(pr):.3f}x, "
                     f"range {min(pr):.3f}-{max(pr):.3f}x")
        print(f"A/A on {args.device}, {spec.name}, {label}: median {statistics.median(got):.3f}x, "
              f"range {min(got):.3f}-{max(got):.3f}x over {len(got)} evaluations (unbiased: about 1.0x){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
