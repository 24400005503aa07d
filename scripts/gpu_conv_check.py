"""Check the builtin's direct convolution kernels (agent/builtin/conv.py, cuda_conv.cu.j2) on a GPU.

For tests/fixtures/builtin/conv_direct.py (small: bias/no bias, stride 2, dilation 2, a prologue, 3-D), conv_tail.py, conv_bn.py
and, with --kb, every level-2 task whose cuda candidate gets a direct convolution (or those given
with --tasks), at their published sizes: the direct-convolution candidate in each tile variant
(``conv_tile``: by default the default tile (c8x8) and the FMA tile 4x8, ``--tiles`` for others, ``--quick``: the default only) and its cuDNN twin (``layout=nchw, conv=library``:
the same chains as an epilogue kernel after cuDNN) are generated, built (in parallel, before any
timing) and run beside the reference (the same seed's weights and inputs). Where a candidate's convolution
group ends in a tail reduction (conv_tail.py, level2/67), the same tile with the reduction as its own
kernel (``fusion=no_prologue``) is timed beside it ("untailed"); where a batch norm takes its statistics from
the convolution (conv_bn.py, level2/73: conv_stats.py), the same tile with the norm's own statistics pass
("unlinked").

* correctness: every output against the float32 reference with cuDNN's TF32 off (a difference is
  the kernel's), against the reference under PyTorch's defaults (what the judge compares with)
  and against the reference in float64 (``compare_with_references``: 1e-4 absolute + relative,
  or within 2x of the float32 reference's own distance to float64);
* time, under PyTorch's defaults: eager reference, torch.compile of the reference (unless
  ``--no-compile``), the cuDNN twin and each variant, CUDA events, median of ``--reps`` after 3
  warm-up calls.

One line per task and candidate (ms, x eager, x compile), then geometric means; exits 1 where an
output fails. The CUDA kernels are on in cuda candidates since this check passed on an H200
(session q; ``conv.direct_on``, ``KERNELLOOP_CUDA_CONV=0`` switches them off): the script sets
``KERNELLOOP_CUDA_CONV=1`` whatever the environment says.

    source scripts/gpu_env.sh && python3 scripts/gpu_conv_check.py --kb .kb [--quick] [--no-compile] [--tasks 57_Conv2d_ReLU_HardSwish,...]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from builtin_candidate import (compare_with_references, compiled_median_ms, cuda_event_median_ms,  # noqa: E402
                               flat_outputs, reference_and_candidate)

from agent.builtin import Knobs, generate  # noqa: E402
from agent.builtin.conv import CUDA_CONV_ENV, DEFAULT_TILE, FALLBACK_TILE, MMA_TILE, SLIDE_TILES, TILES  # noqa: E402

os.environ[CUDA_CONV_ENV] = "1"      # the CUDA direct convolutions (on by default since session q; =0 switches them off)
from sandbox.tasks import read_spec  # noqa: E402

LIBRARY = Knobs(layout="nchw")
DEFAULT_TILES = (DEFAULT_TILE, FALLBACK_TILE)     # the register-blocked default and the FMA tile before it


def direct(tile: str) -> Knobs:
    return Knobs(layout="nchw", conv="direct", conv_tile=tile)


def _convs(cand) -> list[str]:
    return [g["ops"][0] for g in cand.choices["groups"] if g["kind"] == "conv"]


def _tailed(cand) -> bool:
    """Whether a conv group of the candidate ends in a tail reduction (plan.tail_reduction)."""
    return any(g["kind"] == "conv" and g["kinds"][-1] == "reduce" for g in cand.choices["groups"])


def _linked(cand) -> bool:
    """Whether a batch norm of the candidate takes its statistics from its convolution (conv_stats.py)."""
    return any("stats_from" in g for g in cand.choices["groups"])


def direct_tasks(kb: Path) -> list[str]:
    """The level-2 tasks whose cuda candidate has a direct convolution (rendered, not built)."""
    found = []
    for path in sorted((kb / "level2").glob("*.py"), key=lambda p: int(p.stem.split("_")[0])):
        try:
            if _convs(generate(read_spec(path, name=f"level2/{path.stem}"), "cuda", direct(DEFAULT_TILE))):
                found.append(path.stem)
        except Exception as exc:  # noqa: BLE001 - a task the generator cannot handle is listed, not fatal
            print(f"level2/{path.stem}: not rendered ({type(exc).__name__}: {exc})", flush=True)
    return found


def _build(source: str) -> None:
    ns: dict = {"__name__": "kl_prebuild"}
    exec(compile(source, "c.py", "exec"), ns)          # _ext = _build(): load_inline, cached on disk


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def check(name: str, spec, sources: dict[str, str], reps: int, use_compile: bool, ratios: dict) -> bool:
    task, ref, _ = reference_and_candidate(spec, sources["cudnn"])
    ref = ref.cuda()
    torch.manual_seed(1)
    inputs = [x.cuda() if torch.is_tensor(x) else x for x in task.get_inputs()]
    ok = True
    with torch.no_grad():
        tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        strict = flat_outputs(ref(*inputs))
        ref64 = flat_outputs(ref.double()(*[x.double() if torch.is_tensor(x) else x for x in inputs]))
        ref.float()
        torch.backends.cudnn.allow_tf32 = tf32
        default = flat_outputs(ref(*inputs))
        t_eager = cuda_event_median_ms(ref, inputs, reps)
        t_comp = compiled_median_ms(ref, inputs, reps) if use_compile else float("nan")
        print(f"{name:44s} eager {t_eager:.3f} ms, torch.compile {t_comp:.3f} ms", flush=True)
        for label, source in sources.items():
            _, _, new = reference_and_candidate(spec, source)
            new = new.cuda()
            got = flat_outputs(new(*inputs))
            ok_strict, w_strict, w64, ref_err = compare_with_references(strict, got, ref64)
            ok_default, w_default, _, _ = compare_with_references(default, got, ref64)
            t = cuda_event_median_ms(new, inputs, reps)
            good = ok_strict and ok_default
            ok &= good
            if not name.startswith("fixtures/"):
                ratios.setdefault(label, []).append((t_eager / t, t_comp / t))
            print(f"  {label:10s} {t:.3f} ms ({t_eager / t:.2f}x eager, {t_comp / t:.2f}x compile); max |cand - "
                  f"ref32| {w_strict:.2e} (TF32 off), {w_default:.2e} (defaults), |cand - ref64| {w64:.2e} "
                  f"(ref32 - ref64 {ref_err:.2e}) {'OK' if good else 'FAIL'}", flush=True)
            del new
        del ref
        torch.cuda.empty_cache()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", default=None, help="a KernelBench checkout (its level-2 tasks with a direct convolution)")
    ap.add_argument("--tasks", default=None, help="level-2 task stems (comma-separated; default: every level-2 task "
                                                  "whose cuda candidate gets a direct convolution)")
    ap.add_argument("--quick", action="store_true", help=f"the default tile ({DEFAULT_TILE}) only")
    ap.add_argument("--tiles", default=None, help=f"tiles to check (default: {','.join(DEFAULT_TILES)}; any of "
                                                  f"{','.join([*TILES, *SLIDE_TILES, MMA_TILE])}: {MMA_TILE} is the 3xTF32 tensor-core tile)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the references (~20 s each)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=12, help="parallel candidate builds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        return 2
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    tiles = [DEFAULT_TILE] if args.quick else (args.tiles.split(",") if args.tiles else list(DEFAULT_TILES))
    jobs = [(f"fixtures/{n}", ROOT / f"tests/fixtures/builtin/{n}.py") for n in ("conv_direct", "conv_tail", "conv_bn")]
    if args.kb:
        kb = Path(args.kb)
        stems = args.tasks.split(",") if args.tasks else direct_tasks(kb)
        jobs += [(f"level2/{s}", kb / "level2" / f"{s}.py") for s in stems]
    plans = []
    for name, path in jobs:
        spec = read_spec(path, name=name)
        sources = {"cudnn": generate(spec, "cuda", LIBRARY).source}
        for tile in tiles:
            cand = generate(spec, "cuda", direct(tile))
            if _convs(cand):
                sources[f"direct {tile}"] = cand.source
            # and the same with the reduction its own kernel, the norm's own statistics pass (one twin for both)
            twin = "/".join(w for w, on in (("untailed", _tailed(cand)), ("unlinked", _linked(cand))) if on)
            if twin:
                sources[f"{twin} {tile}"] = generate(spec, "cuda", replace(direct(tile), fusion="no_prologue")).source
        plans.append((name, spec, sources))
    start = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(_build, [s for _, _, sources in plans for s in sources.values()]))
    print(f"built {sum(len(s) for _, _, s in plans)} candidates in {time.time() - start:.0f} s", flush=True)
    ok = True
    ratios: dict[str, list[tuple[float, float]]] = {}
    for name, spec, sources in plans:
        if len(sources) == 1:
            print(f"{name:44s} no direct convolution", flush=True)
            continue
        ok &= check(name, spec, sources, args.reps, not args.no_compile, ratios)
    for label, rs in ratios.items():
        print(f"geomean {label:10s} {_geomean([a for a, _ in rs]):.3f}x eager, "
              f"{_geomean([b for _, b in rs]):.3f}x compile over {len(rs)} tasks", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
