"""Build one builtin candidate for a task and run its forward a few times (GPU host): a target for
`ncu` or `compute-sanitizer`, with nothing else of the judge around it.

    source scripts/gpu_env.sh && ncu --clock-control none --kernel-name regex:kl_g0_kernel --launch-skip 1 \\
        --launch-count 1 python3 scripts/run_candidate.py .kb/level2/87_Conv2d_Subtract_Subtract_Mish.py \\
        --knobs layout=nchw,conv=direct,conv_tile=4x8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from builtin_candidate import reference_and_candidate  # noqa: E402

from agent.builtin import Knobs, generate  # noqa: E402
from sandbox.tasks import read_spec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", type=Path)
    ap.add_argument("--knobs", default="", help="comma-separated knob=value pairs (agent.builtin.Knobs)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    knobs = Knobs(**dict(kv.split("=", 1) for kv in args.knobs.split(",") if kv))
    spec = read_spec(args.task, name=f"{args.task.parent.name}/{args.task.stem}")
    source = generate(spec, "cuda", knobs).source
    task, _, new = reference_and_candidate(spec, source)
    new = new.cuda()
    inputs = [x.cuda() if torch.is_tensor(x) else x for x in task.get_inputs()]
    with torch.no_grad():
        for _ in range(args.runs):
            new(*inputs)
    torch.cuda.synchronize()
    print(f"ran {args.task.stem} {knobs} {args.runs} times")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
