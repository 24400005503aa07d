"""Check the builtin's recurrent kernels (agent/builtin/recurrent.py, cuda_rnn.cu.j2) on a GPU.

For tests/fixtures/builtin/recurrent_mix.py (every kind of layer, small) and, where KernelBench
is present, level3/36-42 at their published sizes (hidden 256, seq 512, batch 10, 6 layers):
the cuda candidate is generated, built and run beside the reference (the same seed's weights
and inputs) and each output is compared with the float32 reference (the sandbox's tolerance,
1e-4) and with the reference run in float64; both are then timed (CUDA events, median of 20).
One line per task; exits 1 where an output fails both comparisons.

    source scripts/gpu_env.sh && python3 scripts/gpu_recurrent_check.py [--kb .kb] [--tasks 38_LSTMBidirectional,...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from builtin_candidate import (compare_with_references, cuda_event_median_ms as _time,  # noqa: E402
                               flat_outputs as _flat, reference_and_candidate)

from agent.builtin import generate  # noqa: E402
from sandbox.tasks import read_spec  # noqa: E402

KB_TASKS = ["36_LSTMHn", "37_LSTMCn", "38_LSTMBidirectional", "39_GRU", "40_GRUHidden",
            "41_GRUBidirectional", "42_GRUBidirectionalHidden"]



def check(path: Path, name: str) -> bool:
    spec = read_spec(path, name=name)
    cand = generate(spec, "cuda")
    groups = [g["ops"][0] for g in cand.choices["groups"] if g["kind"] == "recurrent"]
    task, ref, new = reference_and_candidate(spec, cand.source)
    ref, new = ref.cuda(), new.cuda()
    torch.manual_seed(1)
    inputs = [x.cuda() for x in task.get_inputs()]
    with torch.no_grad():
        want, got = _flat(ref(*inputs)), _flat(new(*inputs))
        ref64 = _flat(ref.double()(*[x.double() for x in inputs]))
        ref.float()
        ok, worst32, worst64, ref_err = compare_with_references(want, got, ref64)
        t_ref, t_new = _time(ref, inputs), _time(new, inputs)
    print(f"{name:42s} kernels {groups}: max |cand - ref32| {worst32:.2e}, |cand - ref64| {worst64:.2e} "
          f"(ref32 - ref64 {ref_err:.2e}) {'OK' if ok else 'FAIL'}; reference {t_ref:.3f} ms, "
          f"candidate {t_new:.3f} ms ({t_ref / t_new:.2f}x)", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", default=None, help="a KernelBench checkout (its level3/ is checked too)")
    ap.add_argument("--tasks", default=",".join(KB_TASKS), help="the level-3 tasks to check (comma-separated)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        return 2
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    ok = check(ROOT / "tests/fixtures/builtin/recurrent_mix.py", "fixtures/recurrent_mix")
    if args.kb:
        for stem in args.tasks.split(","):
            ok &= check(Path(args.kb) / "level3" / f"{stem}.py", f"level3/{stem}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
