"""Build a generated candidate and check it against its reference (a developer tool, not the sandbox).

    python -m agent.builtin.selfcheck --device cuda --jobs 8 tasks/seeds tasks/level2
    python -m agent.builtin.selfcheck --device cpu --variants 2 tasks/seeds/conv2d_divide_leakyrelu.py
    python -m agent.builtin.selfcheck --device cuda --precision bf16 --math default tasks/level2

Each candidate is built (load_inline) and run in a subprocess of its own; both models are
built as the sandbox builds them (``sandbox.harness.make_model``: the same seed before each,
cast to the precision) and fed the same fresh inputs (``make_inputs``), both run under the
numerics' TF32 switches (``Numerics.enforced``) and are compared at its tolerance; under
fp16/bf16 or TF32 math an element off by more also passes when it is no farther from a
float64 run of the reference than ``elem_factor`` times the reference's largest distance
from it, plus the tolerance (the elementwise part of the sandbox's float64 rule). The default
numerics is ``fp32/strict`` (IEEE fp32, TF32 off, 1e-4, no float64 rule): it compares the
kernels, not TF32 convolutions (a TF32 convolution fed by a kernel's output amplifies 1e-7
input differences into ~1e-4 output differences). The real verdicts come from the sandbox;
this is for developing the generator's templates.

Before any of this, ``propose`` has already replayed the candidate's plan in eager PyTorch
against the reference in training mode, buffers included (``agent.builtin.replay``): a group
whose plan is not the reference's computation, or whose correctly rounded result the judge
would still reject (an ill-conditioned reference), is left to PyTorch; the report shows it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Optional


def check_source(task_path: str, device: str, source: str, seeds: tuple[int, ...] = (1, 2),
                 atol: Optional[float] = None, rtol: Optional[float] = None, time_it: bool = False,
                 numerics: Any = None) -> dict[str, Any]:
    """Build ``source`` and compare its ``ModelNew`` with the reference under ``numerics``
    (default ``fp32/strict``); ``atol``/``rtol`` default to the numerics' tolerance."""
    import copy

    import torch

    from sandbox.harness import make_inputs, make_model
    from sandbox.numerics import STRICT_FP32
    from sandbox.tasks import load_task, read_spec, with_device_sizes

    numerics = numerics if numerics is not None else STRICT_FP32
    tol = numerics.tolerance
    atol = tol.atol if atol is None else atol
    rtol = tol.rtol if rtol is None else rtol
    spec = with_device_sizes(read_spec(task_path, name=Path(task_path).stem), device)
    task = load_task(spec)
    report: dict[str, Any] = {"task": task_path, "device": device, "ok": False, "numerics": numerics.label}
    ns: dict[str, Any] = {"__name__": "kl_selfcheck_candidate"}
    t0 = time.perf_counter()
    exec(compile(source, "candidate.py", "exec"), ns)
    report["build_s"] = round(time.perf_counter() - t0, 2)
    from agent.builtin.rng import isolated_rng

    with isolated_rng():        # both draw the same weights, whatever other threads do
        ref = make_model(task.Model, task, seeds[0], device, numerics)
        new = make_model(ns["ModelNew"], task, seeds[0], device, numerics)
    # the float64 copy of the reference (same state, run on the same, already cast, inputs)
    use64 = numerics.fp64_check and (numerics.precision != "fp32" or numerics.math != "strict")
    ref64 = copy.deepcopy(ref).double() if use64 else None
    worst = 0.0
    ok = True
    for seed in seeds:
        inputs = make_inputs(task, seed, device, numerics)
        with torch.no_grad(), numerics.enforced():
            r = ref(*[x.clone() if torch.is_tensor(x) else x for x in inputs])
            n = new(*[x.clone() if torch.is_tensor(x) else x for x in inputs])
            r64 = _run64(ref64, inputs)
        rs = list(r) if isinstance(r, (tuple, list)) else [r]
        nn_ = list(n) if isinstance(n, (tuple, list)) else [n]
        rs64 = (list(r64) if isinstance(r64, (tuple, list)) else [r64]) if r64 is not None else [None] * len(rs)
        if len(rs) != len(nn_):
            ok = False
        for a, b, a64 in zip(rs, nn_, rs64):
            if not torch.is_tensor(a):
                ok &= a == b
                continue
            if a.shape != b.shape:
                ok = False
                report["shape"] = [list(a.shape), list(b.shape)]
                continue
            if a.dtype != b.dtype:
                ok = False
                report["dtype"] = [str(a.dtype), str(b.dtype)]
                continue
            if a.numel():
                worst = max(worst, (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item())
            if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
                passed = _fp64_rule(a, b, a64, atol, rtol, numerics.elem_factor)
                report["fp64_rule"] = report.get("fp64_rule", True) and passed
                ok &= passed
    report["max_abs_err"] = worst
    report["ok"] = bool(ok)
    if time_it:
        inputs = make_inputs(task, 0, device, numerics)
        with numerics.enforced():
            report["ref_ms"] = _time(ref, inputs, device)
            report["new_ms"] = _time(new, inputs, device)
        report["speedup"] = round(report["ref_ms"] / report["new_ms"], 3) if report["new_ms"] else None
    return report


def _run64(ref64: Any, inputs: list[Any]) -> Any:
    """The float64 reference's outputs, or None (no copy, or a forward that cannot run in float64)."""
    import torch

    if ref64 is None:
        return None
    try:
        return ref64(*[x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs])
    except Exception:  # noqa: BLE001 - then the tolerance alone decides
        return None


def _fp64_rule(ref: Any, out: Any, ref64: Any, atol: float, rtol: float, factor: float) -> bool:
    """Every element within the tolerance of the reference, or no farther from the float64
    result than ``factor`` times the reference's largest distance from it, plus the tolerance."""
    import torch

    if not torch.is_tensor(ref64) or ref64.shape != ref.shape:
        return False
    r, o = ref.double(), out.double()
    if not bool((torch.isfinite(r) & torch.isfinite(ref64)).all()):
        return False
    tol = atol + rtol * ref64.abs()
    near_ref = (o - r).abs() <= atol + rtol * r.abs()
    bound = factor * float((r - ref64).abs().max()) + tol
    return bool((near_ref | ((o - ref64).abs() <= bound)).all())


def _time(model, inputs, device: str, runs: int = 20) -> float:
    import torch

    times = []
    with torch.no_grad():
        for _ in range(3):
            model(*inputs)
        for _ in range(runs):
            if device == "cuda":
                torch.cuda.synchronize()
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                model(*inputs)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                model(*inputs)
                times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 4)


def _job(args: tuple) -> dict[str, Any]:
    task_path, device, variant, time_it, precision, math = args
    try:
        from agent.builtin import propose
        from sandbox.numerics import STRICT_FP32, parse_numerics
        from sandbox.tasks import read_spec

        numerics = parse_numerics(precision, math, base=STRICT_FP32)
        spec = read_spec(task_path, name=Path(task_path).stem)
        cand = propose(spec, device, 0, variant, [], numerics=numerics)
        rep = check_source(task_path, device, cand.source, time_it=time_it, numerics=numerics)
        rep["groups"] = [" -> ".join(g["ops"]) for g in cand.choices.get("groups", [])]
        rep["knobs"] = cand.choices.get("knobs")
        rep["tc3"] = cand.choices.get("tc3") or []
        rep["replay"] = cand.choices.get("replay")      # what the plan replay left to PyTorch, and why
        rep["variant"] = variant
        return rep
    except Exception as exc:  # noqa: BLE001 - reported
        return {"task": task_path, "device": device, "variant": variant, "ok": False,
                "error": f"{type(exc).__name__}: {str(exc)[-3000:]}", "traceback": traceback.format_exc()[-4000:]}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--variants", type=int, default=1, help="samples 0..N-1 of round 0")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"],
                    help="the run's precision: model and inputs cast as the sandbox casts them (default fp32)")
    ap.add_argument("--math", default="strict", choices=["default", "strict"],
                    help="TF32 switches both models run under (default strict: IEEE fp32, see the docstring)")
    a = ap.parse_args(argv)
    files: list[str] = []
    for p in a.paths:
        path = Path(p)
        files += sorted(str(f) for f in path.glob("*.py")) if path.is_dir() else [str(path)]
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    jobs = [(f, a.device, v, False, a.precision, a.math) for f in files for v in range(a.variants)]
    with ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=ctx) as pool:
        reports = list(pool.map(_job, jobs))      # build and check in parallel
    if a.time:
        # time one at a time (the extensions are cached by now)
        again = [(r["task"], a.device, r["variant"], True, a.precision, a.math) for r in reports if r.get("ok")]
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            timed = {(r["task"], r.get("variant")): r for r in pool.map(_job, again)}
        reports = [timed.get((r["task"], r.get("variant")), r) for r in reports]
    bad = 0
    for r in reports:
        status = "OK " if r.get("ok") else "BAD"
        bad += not r.get("ok")
        extra = r.get("error", "") or f"err={r.get('max_abs_err', 0):.2e} build={r.get('build_s')}s"
        if "speedup" in r:
            extra += f" ref={r['ref_ms']}ms new={r['new_ms']}ms x{r['speedup']}"
        if r.get("replay"):
            extra += f" replay={r['replay']}"
        print(f"{status} {r['task']} v{r.get('variant')} {extra} {r.get('groups', '')}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(reports, indent=1))
    print(f"{len(reports) - bad}/{len(reports)} ok ({a.precision}/{a.math})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
