"""Throughput on real KernelBench tasks: the fixed mix (``evals.kernelbench.MIX``, published
level-2 tasks) x N builtin candidates each, every check on (5 trials with the float64 check,
timing of reference eager, reference torch.compile and candidate, spot checks, profiles, the
roofline floor), evaluated twice in one run:

* ``pipelined``: one Sandbox as the loop uses it: candidates in flight together (builds on the
  CPU cores while the device checks and times others), candidate workers started and warmed
  ahead (``sandbox.pool``), trial 0's reference outputs computed while each candidate loads;
* ``one-at-a-time``: one candidate at a time, each worker started when its candidate is ready,
  no precompute (the path as it was).

Each mode starts with an empty build cache of its own (every build is a real build; the
inductor cache and the device probe are shared), starts its own reference workers and stops
a task's references after its last candidate. Each task's memory footprint is measured once
before the modes (``--footprints first``, timed and printed apart: a run over tasks whose
footprints are stored, as ``tasks check --device cuda`` and every earlier run on the device
store them, skips it), or inside each mode's wall time (``--footprints in-run``, a first run);
with ``first`` the pipelined mode's rate with the measurement counted is printed too. Prints candidates per minute, median seconds per
phase (``EvalResult.phases``), the fraction of wall time the device was held for checks and
timing, and the ratio of the two modes' rates; the last line is JSON.

    python scripts/bench_kernelbench.py --device cuda                       # 10 tasks x 4 candidates
    python scripts/bench_kernelbench.py --device cpu --tasks 3 --candidates 2
    python scripts/bench_kernelbench.py --device cpu --tasks 2 --set batch_size=1
    python scripts/bench_kernelbench.py --device cuda --modes pipelined --executor ray   # on a Ray cluster

``--executor ray`` (``RAY_ADDRESS`` or ``--ray-address``) evaluates through the Ray executor
(``executors.ray_executor``): builds as Ray tasks, one slot actor per GPU; the fresh build cache
is handed to the nodes (``KERNELLOOP_CACHE`` in the tasks' and actors' environment).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evals.kernelbench import MIX, kernelbench_paths  # noqa: E402
from sandbox.evaluate import Sandbox  # noqa: E402
from sandbox.footprint import FootprintBook  # noqa: E402
from sandbox.result import EvalConfig, EvalResult  # noqa: E402
from sandbox.tasks import TaskSpec, parse_overrides, read_spec  # noqa: E402

# KernelBench files have no CPU_SIZES preset; these make each task of the mix run in a fraction
# of a second on a CPU (shapes derived from other constants at import are overridden too).
CPU_SIZES: dict[str, dict[str, Any]] = {
    "12_Gemm_Multiply_LeakyReLU": {"batch_size": 16, "in_features": 256, "out_features": 256},
    "81_Gemm_Swish_Divide_Clamp_Tanh_Clamp": {"batch_size": 16, "in_features": 256, "out_features": 256},
    "1_Conv2D_ReLU_BiasAdd": {"batch_size": 2, "in_channels": 8, "out_channels": 16, "height": 16, "width": 16,
                              "bias_shape": (16, 1, 1)},
    "35_Conv2d_Subtract_HardSwish_MaxPool_Mish": {"batch_size": 2, "in_channels": 8, "out_channels": 16,
                                                  "height": 16, "width": 16},
    "5_ConvTranspose2d_Subtract_Tanh": {"batch_size": 2, "in_channels": 8, "out_channels": 8, "height": 16,
                                        "width": 16, "bias_shape": (8, 1, 1)},
    "16_ConvTranspose2d_Mish_Add_Hardtanh_Scaling": {"batch_size": 2, "in_channels": 8, "out_channels": 8,
                                                     "height": 16, "width": 16},
    "17_Conv2d_InstanceNorm_Divide": {"batch_size": 2, "in_channels": 8, "out_channels": 16, "height": 16,
                                      "width": 16},
    "33_Gemm_Scale_BatchNorm": {"batch_size": 32, "in_features": 256, "out_features": 256, "scale_shape": (256,)},
    "23_Conv3d_GroupNorm_Mean": {"batch_size": 2, "out_channels": 8, "D": 8, "H": 12, "W": 12},
    "99_Matmul_GELU_Softmax": {"batch_size": 16, "in_features": 256, "out_features": 256},
}
# Phases during which a candidate holds its slot's device (checks, timing, evidence).
HELD = ("trials", "timing", "spot_checks", "profile", "floor")
# What a candidate waits for before or between its held phases (a GPU idles meanwhile unless
# another candidate holds it): build slots and builds, memory admission, its reference's start,
# its worker, the device behind other candidates, background work at the gate.
WAITS = ("build_wait", "build", "memory_wait", "reference", "worker", "load_wait", "load", "device_wait", "gate_wait")


def per_gpu(results: list[EvalResult], wall: float) -> dict[str, dict[str, Any]]:
    """Per GPU the candidates run there: how many, the fraction of the wall time the GPU was held for
    checks and timing, and the seconds its candidates waited, per kind of wait (sum and median)."""
    out: dict[str, dict[str, Any]] = {}
    for gpu in sorted({str(r.gpu) for r in results}):
        mine = [r for r in results if str(r.gpu) == gpu]
        held = sum(r.phases.get(k, 0.0) for r in mine for k in HELD)
        out[gpu] = {"candidates": len(mine), "busy_fraction": round(held / wall, 3) if wall > 0 else 0.0,
                    "held_s": round(held, 1),
                    "waited_s": {k: round(sum(r.phases.get(k, 0.0) for r in mine), 1) for k in WAITS
                                 if any(k in r.phases for r in mine)},
                    "waited_median_s": {k: round(statistics.median(r.phases.get(k, 0.0) for r in mine), 2)
                                        for k in WAITS if any(k in r.phases for r in mine)}}
    return out


def task_specs(device: str, tasks: int, sets: dict[str, Any]) -> list[TaskSpec]:
    specs = []
    for name, path in zip(MIX[:tasks], kernelbench_paths(MIX[:tasks])):
        spec = read_spec(path, name=name.removesuffix(".py"))
        overrides = dict(CPU_SIZES.get(path.stem, {})) if device == "cpu" else {}
        # --set applies to the tasks that define the name (a task without it is left alone)
        overrides.update({k: v for k, v in sets.items() if _defines(spec.source, k)})
        specs.append(TaskSpec(name=spec.name, path=spec.path, source=spec.source, overrides=overrides))
    return specs


def _defines(source: str, name: str) -> bool:
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                names = [t] if isinstance(t, ast.Name) else list(getattr(t, "elts", []))
                if any(isinstance(n, ast.Name) and n.id == name for n in names):
                    return True
    return False


def candidates(specs: list[TaskSpec], device: str, n: int, cfg: EvalConfig) -> list[tuple[TaskSpec, str]]:
    """Up to ``n`` builtin candidates per task, sample-major (sample 0 of every task, then sample 1,
    ...): a run cut by ``--max-seconds`` has evaluated a like share of every task. A repeated
    candidate with a C++ source gets a comment at its end, so that it is a real build (at the end:
    the leading include block, precompiled, stays the same); a repeat without one (PyTorch
    fallback, nothing to build) is left out."""
    asks = [(spec, sample) for sample in range(n) for spec in specs]
    # the builtin traces each task: about 0.85 s a candidate, so proposed in processes of their own
    with ProcessPoolExecutor(max_workers=max(1, min(len(asks), len(os.sched_getaffinity(0)) // 2))) as pool:
        sources = list(pool.map(_propose, [(spec, device, sample, cfg.numerics) for spec, sample in asks]))
    out = []
    seen: dict[str, set[str]] = {spec.key: set() for spec in specs}
    for (spec, sample), src in zip(asks, sources):
        if src in seen[spec.key]:
            if '_CPP_SOURCE = r"""' not in src:
                print(f"note: {spec.name} sample {sample} repeats an earlier candidate with nothing to build: "
                      "left out", file=sys.stderr)
                continue
            start = src.index('_CPP_SOURCE = r"""') + len('_CPP_SOURCE = r"""')
            end = src.index('"""', start)
            src = src[:end] + f"// bench: sample {sample}\n" + src[end:]
        seen[spec.key].add(src)
        out.append((spec, src))
    return out


def _propose(ask: tuple[TaskSpec, str, int, Any]) -> str:
    from agent.builtin import propose

    spec, device, sample, numerics = ask
    return propose(spec, device, 0, sample, [], numerics=numerics).source


class FreshBuildCache:
    """KERNELLOOP_CACHE pointed at an empty folder for one mode (so every build is real), with
    the device probe copied in and the inductor cache left where it is."""

    def __enter__(self) -> "FreshBuildCache":
        from kernelloop.paths import cache_dir

        real = cache_dir()
        self.saved = {k: os.environ.get(k) for k in ("KERNELLOOP_CACHE", "TORCHINDUCTOR_CACHE_DIR")}
        self.dir = Path(tempfile.mkdtemp(prefix="kl-bench-cache-"))
        for f in real.iterdir():
            if f.is_file():
                shutil.copy2(f, self.dir / f.name)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(real / "inductor"))
        os.environ["KERNELLOOP_CACHE"] = str(self.dir)
        return self

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.dir, ignore_errors=True)


def _driver_sees(device: str) -> bool:
    """Whether this process can measure footprints on ``device`` itself (a Ray driver may have no GPU)."""
    if device != "cuda":
        return True
    import torch

    return torch.cuda.is_available()


def measure_footprints(specs: list[TaskSpec], device: str, cfg: EvalConfig,
                       db: Optional[str] = None) -> tuple[FootprintBook, float, list[str]]:
    """Each task's footprint measured once (as a first run on the device would, and stores),
    for both modes; the seconds it took; the tasks too large to run. ``db``: a kernelloop store
    whose stored footprints (of this GPU and torch) are used, and which keeps those measured."""
    if db is not None:
        import torch

        from sandbox.evaluate import _device_name
        from store import Store
        from store.repo import footprint_book

        book = footprint_book(Store(db), _device_name(device), torch.__version__)   # as executors.local reads it
    else:
        book = FootprintBook()
    t0 = time.monotonic()
    too_large = []
    with Sandbox(device, cfg, footprints=book, warm_workers=0) as sb:
        for spec in specs:
            big = sb.too_large(spec)
            if big is not None:
                too_large.append(f"{spec.name}: {big.reason}")
    return book, time.monotonic() - t0, too_large


def open_sandbox(executor: str, device: str, cfg: EvalConfig, warm_workers: int, precompute: bool,
                 ray_address: Optional[str], footprints: Optional[FootprintBook] = None) -> Any:
    if executor == "local":
        return Sandbox(device, cfg, warm_workers=warm_workers, precompute=precompute, footprints=footprints)
    from executors import open_executor

    return open_executor(executor, device, cfg, address=ray_address, warm_workers=warm_workers,
                         precompute=precompute, node_env={"KERNELLOOP_CACHE": os.environ["KERNELLOOP_CACHE"]},
                         footprints=footprints)     # measured before the modes, as the local run reads them


def run_mode(mode: str, work: list[tuple[TaskSpec, str]], device: str, cfg: EvalConfig, parallel: int,
             warm_workers: int, executor: str = "local", ray_address: Optional[str] = None,
             footprints: Optional[FootprintBook] = None, max_seconds: Optional[float] = None) -> dict[str, Any]:
    """``max_seconds``: no candidate starts after that many seconds (those started finish); the
    rate is then over the candidates that finished, the wall time until the last of them ended."""
    pipelined = mode == "pipelined"
    skipped = [0]
    results: list[EvalResult] = []
    finished_at: list[float] = []       # seconds from the start at which each verdict came
    errors: list[str] = []
    left = {}
    for spec, _ in work:
        left[spec.key] = left.get(spec.key, 0) + 1
    lock = threading.Lock()
    with FreshBuildCache():
        sb = open_sandbox(executor, device, cfg, warm_workers if pipelined else 0, pipelined, ray_address, footprints)
        try:
            def one(item: tuple[TaskSpec, str]) -> Optional[EvalResult]:
                spec, src = item
                try:
                    if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                        skipped[0] += 1
                        return None
                    return sb.evaluate(spec, src)
                except Exception as exc:  # noqa: BLE001 - one failure does not end the benchmark
                    errors.append(f"{spec.name}: {type(exc).__name__}: {exc}")
                    traceback.print_exc()
                    return None
                finally:
                    with lock:
                        left[spec.key] -= 1
                        last = left[spec.key] == 0
                    if last:
                        sb.release(spec)        # as the loop does at a task's end

            def keep(r: Optional[EvalResult]) -> None:
                if r is not None:
                    results.append(r)
                    finished_at.append(time.monotonic() - t0)
                    _line(mode, r, finished_at[-1])

            t0 = time.monotonic()
            interrupted = False
            try:
                if pipelined:
                    pool = ThreadPoolExecutor(max_workers=parallel)
                    try:
                        futures = [pool.submit(one, item) for item in work]
                        for fut in as_completed(futures):
                            keep(fut.result())
                    finally:
                        pool.shutdown(wait=False, cancel_futures=True)
                else:
                    for item in work:
                        keep(one(item))
            except KeyboardInterrupt:
                # Ctrl-C or a time box's SIGINT: the candidates finished so far, over the time until now
                interrupted = True
                sb.abort()
            wall = time.monotonic() - t0
            stats = getattr(sb, "pool_stats", {})
            build_stats = getattr(sb, "build_pool_stats", {})
            gates = getattr(sb, "gate_account", {})
        finally:
            sb.close()
    summary = summarize(mode, results, errors, wall, len(sb.slots), stats)
    summary["executor"] = executor
    summary["build_pool"] = build_stats
    summary["gate"] = gates
    summary["not_started"] = skipped[0]
    summary["interrupted"] = interrupted
    # the rate once the first verdict came: without the start (references and their compiles, cold
    # caches, pools filling), which a short bench weighs more than a long run does
    if len(finished_at) >= 2 and finished_at[-1] > finished_at[0]:
        summary["first_done_s"] = round(finished_at[0], 1)
        summary["per_min_after_first"] = round((len(finished_at) - 1) / (finished_at[-1] - finished_at[0]) * 60, 2)
    return summary


def _line(mode: str, r: EvalResult, at: float) -> None:
    print(f"  [{mode}] +{at:.0f} s {r.task}: {_verdict(r)} in {r.seconds:.1f} s "
          + " ".join(f"{k}={v:.2f}" for k, v in r.phases.items()), flush=True)


def summarize(mode: str, results: list[EvalResult], errors: list[str], wall: float, slots: int,
              pool: dict[str, int]) -> dict[str, Any]:
    names = [k for r in results for k in r.phases]
    names = list(dict.fromkeys(names))
    phases = {k: round(statistics.median(r.phases.get(k, 0.0) for r in results), 3) for k in names}
    held = sum(r.phases.get(k, 0.0) for r in results for k in HELD)
    return {"mode": mode, "candidates": len(results), "errors": errors, "wall_s": round(wall, 1),
            "per_min": round(len(results) / wall * 60, 2) if wall > 0 else 0.0,
            "correct": sum(r.correct for r in results), "clean": sum(r.clean for r in results),
            "statuses": {s: sum(r.status.value == s for r in results) for s in sorted({r.status.value for r in results})},
            "phases_median_s": phases, "device_held_s": round(held, 1),
            "device_busy_fraction": round(held / (wall * slots), 3) if wall > 0 else 0.0, "slots": slots,
            "per_gpu": per_gpu(results, wall),
            "pool": pool,
            # each candidate's verdict, to compare two runs of the same work (executors, modes)
            # (keyed by task and candidate hash, and the repeat's number where a hash repeats)
            "verdicts": {k: _verdict(r) for k, r in _keyed(results)},
            # and why each flag was raised (a `contended` names the process and the window)
            "flag_reasons": {k: [f"{f.kind.value}: {f.reason}" for f in r.flags] for k, r in _keyed(results) if r.flags}}


def _keyed(results: list[EvalResult]) -> list[tuple[str, EvalResult]]:
    seen: dict[str, int] = {}
    out = []
    for r in results:
        key = f"{r.task}|{r.candidate_sha256[:12]}"
        seen[key] = seen.get(key, 0) + 1
        out.append((key if seen[key] == 1 else f"{key}#{seen[key]}", r))
    return out


def _verdict(r: EvalResult) -> str:
    """Status and flag kinds: ``correct``, ``correct+contended,suspicious``."""
    kinds = sorted({f.kind.value for f in r.flags})
    return r.status.value + ("+" + ",".join(kinds) if kinds else "")


def report(s: dict[str, Any]) -> None:
    print(f"{s['mode']}: {s['candidates']} candidates in {s['wall_s']} s: {s['per_min']} candidates/min "
          f"({s['correct']} correct, {s['clean']} clean; {s['statuses']}); device held for checks and timing "
          f"{s['device_busy_fraction'] * 100:.0f}% of wall time over {s['slots']} slot(s)"
          + (f"; {len(s['errors'])} evaluation(s) raised" if s["errors"] else "")
          + (f"; {s['not_started']} not started within --max-seconds" if s.get("not_started") else "")
          + ("; INTERRUPTED: the rate is over the candidates finished before it" if s.get("interrupted") else ""))
    if s.get("footprints_s") is not None:
        print(f"  with the footprint step's {s['footprints_s']} s counted (a first run on this device, where none is stored): "
              f"{s['per_min_with_footprints']} candidates/min")
    if s.get("per_min_after_first") is not None:
        print(f"  after the first verdict (+{s['first_done_s']} s; the start's references, compiles and cold caches "
              f"left out): {s['per_min_after_first']} candidates/min")
    print("  median phase seconds: " + ", ".join(f"{k} {v}" for k, v in s["phases_median_s"].items()))
    for gpu, g in s.get("per_gpu", {}).items():
        print(f"  GPU {gpu}: {g['candidates']} candidates, held {g['busy_fraction'] * 100:.0f}% of wall time; "
              "its candidates waited (median s): " + ", ".join(f"{k} {v}" for k, v in g["waited_median_s"].items()))
    if s["pool"]:
        print(f"  warm workers: {s['pool']}")
    if s.get("build_pool"):
        print(f"  warm build workers: {s['build_pool']}")
    if s.get("gate"):
        print("  device gate, by what held or waited for it (count, seconds waited, seconds held; summed over "
              "slots): " + "; ".join(f"{k} {v['n']:.0f}, {v['wait_s']} s, {v['held_s']} s" for k, v in s["gate"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tasks", type=int, default=len(MIX), help=f"the first N tasks of the mix (at most {len(MIX)})")
    ap.add_argument("--candidates", type=int, default=4, help="builtin candidates per task")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="size override for every task that defines NAME (after the CPU sizes on cpu)")
    ap.add_argument("--parallel", type=int, default=12, help="candidates in flight in the pipelined mode")
    ap.add_argument("--footprints", choices=("first", "in-run"), default="first",
                    help="measure each task's memory footprint once before the modes (timed apart), or in each "
                         "mode's wall time; --executor ray reads those measured first (on its slots in-run where "
                         "the driver sees no GPU)")
    ap.add_argument("--warm-workers", type=int, default=2, help="warm candidate workers per slot (pipelined)")
    ap.add_argument("--modes", default="pipelined,one-at-a-time",
                    help="comma-separated: pipelined, one-at-a-time (in this order; the first runs on a colder host)")
    ap.add_argument("--no-compile", action="store_true", help="do not time the reference under torch.compile")
    ap.add_argument("--db", default=None,
                    help="with --footprints first: a kernelloop store whose footprints are read (and measured ones kept)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no candidate after this many seconds of a mode (the rate is over those that finished)")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    ap.add_argument("--executor", choices=("local", "ray"), default="local",
                    help="where candidates are evaluated (ray: builds as Ray tasks, one slot actor per GPU)")
    ap.add_argument("--ray-address", default=None, help="the Ray cluster to join [default: RAY_ADDRESS]")
    args = ap.parse_args()

    cfg = EvalConfig(time_compile=not args.no_compile)
    specs = task_specs(args.device, max(1, min(args.tasks, len(MIX))), parse_overrides(args.set))
    t0 = time.monotonic()
    work = candidates(specs, args.device, args.candidates, cfg)
    print(f"{len(work)} candidates ({len(specs)} tasks x {args.candidates}) proposed in {time.monotonic() - t0:.1f} s; "
          f"config: {cfg.trials} trials (float64 check {'on' if cfg.numerics.fp64_check else 'off'}), "
          f"{cfg.timed_runs} timed runs, compile {'on' if cfg.time_compile else 'off'}, profile "
          f"{'on' if cfg.profile else 'off'}; numerics {cfg.numerics.describe()}", flush=True)
    if args.device == "cpu":
        from sandbox.slots import cpu_timing_note

        print(cpu_timing_note(), flush=True)
    book, measured_s = None, None
    if args.footprints == "first" and args.executor == "ray" and not _driver_sees(args.device):
        print(f"footprints: measured in-run on the cluster's slots (this driver sees no {args.device} device)", flush=True)
    elif args.footprints == "first":
        # Ray's slots read the book the driver passes (executors.ray_executor._known_footprint), so both
        # executors start with the same footprints and neither mode's rate carries their measurement.
        book, measured_s, big = measure_footprints(specs, args.device, cfg, args.db)
        print(f"footprints: {len(specs)} tasks {'read or ' if args.db else ''}measured in {measured_s:.1f} s, before the modes and apart from their "
              f"wall time (once per task, device and numerics: stored, a later run skips it)"
              + "".join(f"\n  {b}" for b in big), flush=True)
    summaries = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in ("pipelined", "one-at-a-time"):
            ap.error(f"unknown mode {mode!r}")
        print(f"{mode} ...", flush=True)
        summaries.append(run_mode(mode, work, args.device, cfg, args.parallel, args.warm_workers, args.executor,
                                  args.ray_address, book, args.max_seconds))
        if measured_s is not None:
            s = summaries[-1]
            s["footprints_s"] = round(measured_s, 1)
            s["per_min_with_footprints"] = round(s["candidates"] / (s["wall_s"] + measured_s) * 60, 2)
        if summaries[-1]["interrupted"]:
            print(f"{mode} interrupted: the modes after it are not run", flush=True)
            break
    print()
    for s in summaries:
        report(s)
    out: dict[str, Any] = {"device": args.device, "executor": args.executor, "tasks": [s.name for s in specs],
                           "candidates_per_task": args.candidates, "modes": summaries}
    rates = {s["mode"]: s["per_min"] for s in summaries}
    if rates.get("pipelined") and rates.get("one-at-a-time"):
        out["ratio"] = round(rates["pipelined"] / rates["one-at-a-time"], 2)
        print(f"pipelined / one-at-a-time: {out['ratio']}x (goal on an H100: >= 10 candidates/min)")
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
