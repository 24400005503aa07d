"""Does a CUDA-graph candidate change the reference's eager timing beside it? (issue #39)

In session w's level-3 lanes the reference's eager median of a launch-bound network read up to 3.4x
slower in the evaluation of a graph-replay candidate (or a persistent recurrent kernel) than in its
twin's, seconds apart (28_VisionTransformer 13.3 against 3.9 ms). This evaluates each task's graph
candidate and its graph-free twin alternately, ``--repeats`` times each, in one sandbox (one
reference worker, as a run has), on a host with nothing else running, and prints per evaluation the
eager, compile and candidate medians with the timing thread's own account of its window (CPU ms /
wall ms, preemptions, the core's and the GPU's clocks: ``Timing.host_*``, ``Timing.gpu_sm_mhz``). Equal eager medians across the two kinds: the lanes' host
was the cause; slower beside graphs: the candidate's process was.

    source scripts/gpu_env.sh && python3 scripts/graph_eager_check.py --kb .kb 28_VisionTransformer 9_ResNet18
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tasks", nargs="+", help="level-3 task names (file stems)")
    ap.add_argument("--kb", default=str(ROOT.parent / "shared" / "KernelBench"), help="a KernelBench copy")
    ap.add_argument("--level", default="level3")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from agent.builtin import generate
    from agent.builtin.codegen import Knobs
    from sandbox.evaluate import Sandbox
    from sandbox.numerics import Numerics
    from sandbox.result import EvalConfig
    from sandbox.tasks import read_spec

    cfg = EvalConfig(numerics=Numerics())
    with Sandbox("cuda", cfg) as sandbox:
        for name in args.tasks:
            path = Path(args.kb) / args.level / f"{name}.py"
            spec = read_spec(path, {}, name=f"{args.level}/{name}")
            cands = {"graph": generate(spec, "cuda"), "off": generate(spec, "cuda", Knobs(graph="off"))}
            if cands["graph"].choices["knobs"].get("graph") != "replay":
                print(f"{name}: the graph variant does not apply")
                continue
            eager: dict[str, list[float]] = {"graph": [], "off": []}
            for i in range(args.repeats):
                for kind, cand in cands.items():
                    r = sandbox.evaluate(spec, cand.source)
                    e, c, t = r.eager_time, r.compile_time, r.candidate_time
                    if e is None or t is None:
                        print(f"{name} {kind} #{i}: {r.status.value} {r.error_message or ''}"[:300])
                        continue
                    eager[kind].append(e.median_ms)
                    print(f"{name} {kind:5s} #{i}: {r.status.value} eager {e.median_ms:.3f} ms "
                          f"(host cpu/wall {e.host_cpu_ms}/{e.host_wall_ms} ms, preempted {e.host_preempted}, "
                          f"CPU {e.host_cpu_mhz} MHz, SM {e.gpu_sm_mhz} MHz) "
                          f"compile {c.median_ms if c else float('nan'):.3f} cand {t.median_ms:.3f} "
                          f"(host cpu/wall {t.host_cpu_ms}/{t.host_wall_ms}) x{r.speedup_eager or 0:.2f} "
                          f"retimed {r.reference_retimed} flags {[f.kind.value for f in r.flags]}", flush=True)
            if eager["graph"] and eager["off"]:
                g, o = statistics.median(eager["graph"]), statistics.median(eager["off"])
                print(f"{name}: eager median beside graph {g:.3f} ms, beside its twin {o:.3f} ms: {g / o:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
