"""Check the builtin's fused pooling kernels (agent/builtin/pool.py, cuda_pool.cu.j2) on a GPU.

For tests/fixtures/builtin/conv_pool.py (max, avg with padding 1, max with padding 1; small)
and, where KernelBench is present, every level-2 task whose cuda candidate has a pooling kernel
(or those given with --tasks), at their published sizes, in each layout (nchw, nhwc): the fused
candidate and its library-pooling twin (``fusion=elementwise``: the same chains, PyTorch's pool)
are generated, built and run beside the reference (the same seed's weights and inputs).

* correctness, with cuDNN's TF32 off (so the convolutions are float32 in both and a difference
  is the kernels'): every output against the float32 reference (1e-4 absolute + relative) and
  against the reference run in float64; an output that fails the tolerance passes where the
  candidate is within 2x of the float32 reference's own distance to float64;
* time, under PyTorch's defaults (TF32 convolutions, as the judge's fp32/default): the
  reference, the fused candidate, the library-pooling twin and torch.compile of the reference,
  CUDA events, median of 20 after 3 warm-up calls.

One line per task and layout; exits 1 where an output fails both comparisons. The CUDA pool kernels
are on in cuda candidates since this check passed on an H200 (session q; ``agent.builtin.pool.fused_on``,
``KERNELLOOP_CUDA_POOL=0`` switches them off): the script sets ``KERNELLOOP_CUDA_POOL=1`` whatever the
environment says.

    source scripts/gpu_env.sh && python3 scripts/gpu_pool_check.py --kb .kb [--tasks 35_Conv2d_Subtract_HardSwish_MaxPool_Mish,...]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from builtin_candidate import (compare_with_references, compiled_median_ms, cuda_event_median_ms as _time,  # noqa: E402
                               flat_outputs as _flat, reference_and_candidate)

from agent.builtin import Knobs, generate  # noqa: E402
from agent.builtin.pool import CUDA_POOL_ENV  # noqa: E402

os.environ[CUDA_POOL_ENV] = "1"      # the CUDA pool kernels (on by default since session q; =0 switches them off)
from sandbox.tasks import read_spec  # noqa: E402



def _pools(cand) -> list[str]:
    return [op for g in cand.choices["groups"] if g["kind"] == "pool" for op in g["ops"] if "pool" in op]


def pooled_tasks(kb: Path) -> list[str]:
    """The level-2 tasks whose default cuda candidate has a pooling kernel (rendered, not built)."""
    found = []
    for path in sorted((kb / "level2").glob("*.py"), key=lambda p: int(p.stem.split("_")[0])):
        try:
            if _pools(generate(read_spec(path, name=f"level2/{path.stem}"), "cuda")):
                found.append(path.stem)
        except Exception as exc:  # noqa: BLE001 - a task the generator cannot handle is listed, not fatal
            print(f"level2/{path.stem}: not rendered ({type(exc).__name__}: {exc})", flush=True)
    return found


def check(path: Path, name: str, layout: str, seen: set[str]) -> bool:
    """``seen``: the task's candidates checked already (a graph that stays NCHW renders one code for both)."""
    spec = read_spec(path, name=name)
    cand = generate(spec, "cuda", Knobs(layout=layout))
    if not _pools(cand) or cand.source in seen:
        print(f"{name:48s} {layout}: {'no pooling kernel' if not _pools(cand) else 'the same code as the other layout'}",
              flush=True)
        return True
    seen.add(cand.source)
    lib = generate(spec, "cuda", Knobs(fusion="elementwise", layout=layout))
    task, ref, new = reference_and_candidate(spec, cand.source)
    _, _, twin = reference_and_candidate(spec, lib.source)
    ref, new, twin = ref.cuda(), new.cuda(), twin.cuda()
    torch.manual_seed(1)
    inputs = [x.cuda() if torch.is_tensor(x) else x for x in task.get_inputs()]
    tf32 = torch.backends.cudnn.allow_tf32
    with torch.no_grad():
        torch.backends.cudnn.allow_tf32 = False
        want, got = _flat(ref(*inputs)), _flat(new(*inputs))
        ref64 = _flat(ref.double()(*[x.double() if torch.is_tensor(x) else x for x in inputs]))
        ref.float()
        torch.backends.cudnn.allow_tf32 = tf32
        ok, worst32, worst64, ref_err = compare_with_references(want, got, ref64)
        t_ref, t_new, t_lib = _time(ref, inputs), _time(new, inputs), _time(twin, inputs)
        t_comp = compiled_median_ms(ref, inputs)
    print(f"{name:48s} {layout} kernels {_pools(cand)}: max |cand - ref32| {worst32:.2e}, |cand - ref64| "
          f"{worst64:.2e} (ref32 - ref64 {ref_err:.2e}) {'OK' if ok else 'FAIL'}; reference {t_ref:.3f} ms, "
          f"fused {t_new:.3f} ms ({t_ref / t_new:.2f}x), library pool {t_lib:.3f} ms ({t_ref / t_lib:.2f}x), "
          f"torch.compile {t_comp:.3f} ms (fused {t_comp / t_new:.2f}x compile)", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", default=None, help="a KernelBench checkout (its level2/ pooling tasks are checked too)")
    ap.add_argument("--tasks", default=None, help="level-2 task stems, or level1/STEM (comma-separated; default: "
                                                  "every level-2 task whose candidate has a pooling kernel)")
    ap.add_argument("--layouts", default="nchw,nhwc")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        return 2
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    layouts = args.layouts.split(",")
    ok = True
    seen: set[str] = set()
    for layout in layouts:
        ok &= check(ROOT / "tests/fixtures/builtin/conv_pool.py", "fixtures/conv_pool", layout, seen)
    if args.kb:
        kb = Path(args.kb)
        stems = args.tasks.split(",") if args.tasks else pooled_tasks(kb)
        for stem in stems:
            rel = stem if "/" in stem else f"level2/{stem}"      # level1/42_Max_Pooling_2D works too
            seen = set()
            for layout in layouts:
                ok &= check(kb / f"{rel}.py", rel, layout, seen)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
