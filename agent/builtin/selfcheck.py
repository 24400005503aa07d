"""Build a generated candidate and check it against its reference (a developer tool, not the sandbox).

    python -m agent.builtin.selfcheck --device cuda --jobs 8 tasks/seeds tasks/level2
    python -m agent.builtin.selfcheck --device cpu --variants 2 tasks/seeds/conv2d_divide_leakyrelu.py

Each candidate is built (load_inline) and run in a subprocess of its own; both models are
constructed after ``torch.manual_seed(s)`` and fed the same fresh inputs. The real verdicts
come from the sandbox; this is for developing the generator's templates.
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
                 atol: float = 1e-4, rtol: float = 1e-4, time_it: bool = False) -> dict[str, Any]:
    import torch

    from sandbox.tasks import load_task, read_spec, with_device_sizes

    # compare the kernels, not TF32 convolutions: a conv fed by a kernel's output amplifies
    # 1e-7 input differences through TF32 rounding into ~1e-4 output differences
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    spec = with_device_sizes(read_spec(task_path, name=Path(task_path).stem), device)
    task = load_task(spec)
    report: dict[str, Any] = {"task": task_path, "device": device, "ok": False}
    ns: dict[str, Any] = {"__name__": "kl_selfcheck_candidate"}
    t0 = time.perf_counter()
    exec(compile(source, "candidate.py", "exec"), ns)
    report["build_s"] = round(time.perf_counter() - t0, 2)
    init = task.get_init_inputs()
    torch.manual_seed(seeds[0])
    ref = task.Model(*init).to(device)
    torch.manual_seed(seeds[0])
    new = ns["ModelNew"](*init).to(device)
    worst = 0.0
    ok = True
    for seed in seeds:
        torch.manual_seed(seed)
        inputs = [x.to(device) if torch.is_tensor(x) else x for x in task.get_inputs()]
        with torch.no_grad():
            r = ref(*[x.clone() if torch.is_tensor(x) else x for x in inputs])
            n = new(*[x.clone() if torch.is_tensor(x) else x for x in inputs])
        rs = list(r) if isinstance(r, (tuple, list)) else [r]
        nn_ = list(n) if isinstance(n, (tuple, list)) else [n]
        if len(rs) != len(nn_):
            ok = False
        for a, b in zip(rs, nn_):
            if not torch.is_tensor(a):
                ok &= a == b
                continue
            if a.shape != b.shape:
                ok = False
                report["shape"] = [list(a.shape), list(b.shape)]
                continue
            if a.numel():
                worst = max(worst, (a - b).abs().nan_to_num(float("inf")).max().item())
            ok &= torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True)
    report["max_abs_err"] = worst
    report["ok"] = bool(ok)
    if time_it:
        torch.manual_seed(0)
        inputs = [x.to(device) if torch.is_tensor(x) else x for x in task.get_inputs()]
        report["ref_ms"] = _time(ref, inputs, device)
        report["new_ms"] = _time(new, inputs, device)
        report["speedup"] = round(report["ref_ms"] / report["new_ms"], 3) if report["new_ms"] else None
    return report


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
    task_path, device, variant, time_it = args
    try:
        from agent.builtin import propose
        from sandbox.tasks import read_spec

        spec = read_spec(task_path, name=Path(task_path).stem)
        cand = propose(spec, device, 0, variant, [])
        rep = check_source(task_path, device, cand.source, time_it=time_it)
        rep["groups"] = [" -> ".join(g["ops"]) for g in cand.choices.get("groups", [])]
        rep["knobs"] = cand.choices.get("knobs")
        rep["tc3"] = cand.choices.get("tc3") or []
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
    a = ap.parse_args(argv)
    files: list[str] = []
    for p in a.paths:
        path = Path(p)
        files += sorted(str(f) for f in path.glob("*.py")) if path.is_dir() else [str(path)]
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    jobs = [(f, a.device, v, False) for f in files for v in range(a.variants)]
    with ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=ctx) as pool:
        reports = list(pool.map(_job, jobs))      # build and check in parallel
    if a.time:
        # time one at a time (the extensions are cached by now)
        again = [(r["task"], a.device, r["variant"], True) for r in reports if r.get("ok")]
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
        print(f"{status} {r['task']} v{r.get('variant')} {extra} {r.get('groups', '')}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(reports, indent=1))
    print(f"{len(reports) - bad}/{len(reports)} ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
