"""A small store with known values, for the metrics, report, export and compare tests.

Run A (``info.run_a``) over four tasks; speedups are set directly so the expected
figures can be computed by hand (``EXPECTED_A``):

==================  =====  =====================================================  =========
task                round  verdict                                                 vs eager / vs compile / floor
==================  =====  =====================================================  =========
level1/matmul       0      compile_error                                           -
level1/matmul       1      correct (clean), 2.0 ms                                 2.0 / 1.5 / 0.5
level1/matmul       2      correct (clean), 1.6 ms, parent = round 1               2.5 / 1.875 / 0.625
level1/relu         0      correct (clean), 1.0 ms                                 0.8 / 0.5 / 0.2
level1/relu         1      incorrect                                               -
level2/conv_gn      0      correct but flagged ``fallback`` (not a correct kernel) 3.0 / 2.0
level2/conv_gn      1      runtime_error                                           -
level2/lse          0      no code (parse_status no_code, not evaluated)           -
level2/lse          1      correct (clean), 5.0 ms, ``precision`` flag only        1.2 / 0.8 / 0.1
==================  =====  =====================================================  =========

Model calls of run A: one ``propose`` call per attempt (1000 prompt + 500 completion tokens,
$0.01), two ``critique`` calls (2000 + 300 tokens, $0.02) and one failed call with no counts.
A call of run B must not be counted in run A.

Run B (``info.run_b``) for compare: matmul correct 2.0x (was 2.5x), relu incorrect (newly
incorrect), conv_gn correct clean 1.5x (newly correct), lse correct 1.2x (unchanged).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sandbox.result import BuildInfo, EvalResult, Flag, OutputCheck, Status, Timing, Tolerance, Trial
from sandbox.tasks import TaskSpec
from store import Store
from store.models import Analysis, Attempt, ModelCall, Run
from store.repo import evaluation_row, upsert_task

TASKS = {
    "level1/matmul": "import torch\nclass Model(torch.nn.Module):\n    def forward(self, a, b):\n        return a @ b\n",
    "level1/relu": "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n",
    "level2/conv_gn": "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n",
    "level2/lse": "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x.logsumexp(-1)\n",
}

MATMUL_V1 = """import torch
from torch.utils.cpp_extension import load_inline

src = '''
__global__ void matmul_kernel(const float* a, const float* b, float* c, int n) {
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    float acc = 0.f;
    for (int k = 0; k < n; ++k) acc += a[row * n + k] * b[k * n + col];
    c[row * n + col] = acc;
}
'''

class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return ext.matmul(a, b)
"""

MATMUL_V2 = MATMUL_V1.replace(
    "    float acc = 0.f;\n",
    "    __shared__ float tile_a[16][16];\n    __shared__ float tile_b[16][16];\n    float acc = 0.f;\n")

EXPECTED_A = {
    "tasks": 4, "tasks_correct": 3, "tasks_flagged_only": 1, "attempts": 9, "correct_attempts": 4,
    "flagged_attempts": 1, "evaluated_attempts": 8,
    "fast_p_eager": {"0": 0.75, "0.5": 0.75, "0.8": 0.5, "1": 0.5, "1.5": 0.25, "2": 0.25},
    "fast_p_compile": {"0": 0.75, "0.5": 0.5, "0.8": 0.25, "1": 0.25, "1.5": 0.25, "2": 0.0},
    "geomean_speedup_eager": (2.5 * 0.8 * 1.2) ** (1 / 3),
    "geomean_speedup_compile": (1.875 * 0.5 * 0.8) ** (1 / 3),
    "median_floor_fraction": 0.2,
    "geomean_floor_fraction": (0.625 * 0.2 * 0.1) ** (1 / 3),
    "prompt_tokens": 9 * 1000 + 2 * 2000, "completion_tokens": 9 * 500 + 2 * 300,
    "tokens": 9 * 1500 + 2 * 2300, "cost_usd": 9 * 0.01 + 2 * 0.02,
    "tokens_per_correct_kernel": (9 * 1500 + 2 * 2300) / 3,
    "cost_per_correct_kernel": (9 * 0.01 + 2 * 0.02) / 3,
}

ANALYSIS_MATMUL = """## Matmul: what happened

- Round 0 failed to **compile**: `i` is not declared.
- Round 2 tiles the loads through shared memory.

| attempt | verdict | speedup |
|---|---|---|
| round 1 | correct | 2.0x |
| round 2 | correct | 2.5x |

```cuda
__shared__ float tile_a[16][16];
```

<script>alert("xss")</script>
"""


def timing(ms: float) -> Timing:
    return Timing(median_ms=ms, iqr_ms=ms * 0.01, mean_ms=ms, min_ms=ms * 0.99, max_ms=ms * 1.02,
                  runs=20, clock="cuda_event")


def make_result(task: str, status: str, *, cand: Optional[float] = None, speedup_eager: Optional[float] = None,
                speedup_compile: Optional[float] = None, floor_fraction: Optional[float] = None,
                flags: tuple[tuple[str, str], ...] = (), error_type: Optional[str] = None,
                error_message: Optional[str] = None, first_error: Optional[str] = None,
                trial_reason: Optional[str] = None, sha: str = "") -> EvalResult:
    r = EvalResult(status=Status(status), task=task, device="cuda", device_name="NVIDIA H100",
                   torch_version="2.13.0", candidate_sha256=sha, seconds=3.0)
    if status == "compile_error":
        r.build = BuildInfo(ok=False, seconds=12.0, log="error: identifier \"i\" is undefined",
                            first_error=first_error, first_error_line=7)
        r.error_type, r.error_message = "BuildError", "build failed"
    else:
        r.build = BuildInfo(ok=True, seconds=10.0)
    if error_type:
        r.error_type, r.error_message = error_type, error_message
    if status == "incorrect":
        tol = Tolerance(atol=1e-4, rtol=1e-4)
        r.trials = [Trial(index=0, candidate_first=True, passed=False, reason=trial_reason,
                          outputs=[OutputCheck(index=0, shape=[4], dtype="float32", ref_shape=[4],
                                               ref_dtype="float32", max_abs_err=0.5, mismatched=3, numel=4,
                                               tolerance=tol)])]
    if cand is not None:
        r.candidate_time = timing(cand)
        if speedup_eager is not None:
            r.eager_time = timing(cand * speedup_eager)
            r.speedup_eager = speedup_eager
        if speedup_compile is not None:
            r.compile_time = timing(cand * speedup_compile)
            r.speedup_compile = speedup_compile
        if floor_fraction is not None:
            r.floor_ms = cand * floor_fraction
            r.floor_fraction = floor_fraction
    for kind, reason in flags:
        r.flags.append(Flag(kind=kind, reason=reason))
    return r


@dataclass
class FixtureInfo:
    db_path: Path
    store: Store
    run_a: int
    run_b: int
    attempts: dict[str, int] = field(default_factory=dict)   # "task@round" -> attempt id (run A)
    attempts_b: dict[str, int] = field(default_factory=dict)
    task_ids: dict[str, int] = field(default_factory=dict)


def _add_attempt(session, info_map, run_id, task_id, task, rnd, *, source, result=None, parse_status="ok",
                 parse_error=None, parents=(), call_tokens=(1000, 500, 0.01)):
    call = ModelCall(run_id=run_id, task_id=task_id, round=rnd, purpose="propose", model="test-model",
                     template="propose.j2", prompt_sha256="0" * 64,
                     messages=[{"role": "system", "content": "You write CUDA kernels."},
                               {"role": "user", "content": f"Optimise {task} (round {rnd})."}],
                     response_text=f"Here is round {rnd}:\n```python\n{source or ''}```\n",
                     finish_reason="stop", prompt_tokens=call_tokens[0], completion_tokens=call_tokens[1],
                     latency_s=2.5, cost_usd=call_tokens[2])
    session.add(call)
    session.flush()
    att = Attempt(run_id=run_id, task_id=task_id, round=rnd, sample=0, model_call_id=call.id,
                  parse_status=parse_status, parse_error=parse_error, source=source,
                  sha256=(hashlib.sha256(source.encode()).hexdigest() if source else None), parent_ids=list(parents))
    session.add(att)
    session.flush()
    if result is not None:
        result.candidate_sha256 = att.sha256 or ""
        session.add(evaluation_row(result, task_key=f"key-{task_id}", attempt_id=att.id, run_id=run_id))
        session.flush()
    info_map[f"{task}@{rnd}"] = att.id
    return att


def _run(session, model="test-model") -> Run:
    run = Run(model=model, critic="grounded", device="cuda", device_name="NVIDIA H100", torch_version="2.13.0",
              code_version="abc1234", config={"rounds": 3, "samples": 1}, status="finished")
    session.add(run)
    session.flush()
    return run


def build_fixture_store(tmp_path: Path) -> FixtureInfo:
    db_path = Path(tmp_path) / "fixture.db"
    store = Store(db_path)
    info = FixtureInfo(db_path=db_path, store=store, run_a=0, run_b=0)
    with store.session() as s:
        tids = {}
        for name, src in TASKS.items():
            tids[name] = upsert_task(s, TaskSpec(name=name, path=f"tasks/{name}.py", source=src)).id
        info.task_ids = dict(tids)

        # ------------------------------------------------------------------ run A
        run = _run(s)
        info.run_a = rid = run.id
        A = info.attempts
        mm = "level1/matmul"
        _add_attempt(s, A, rid, tids[mm], mm, 0, source=MATMUL_V1.replace("acc += a", "acc += a[i] + a"),
                     result=make_result(mm, "compile_error", first_error="kernel.cu(7): error: identifier \"i\" is undefined"))
        v1 = _add_attempt(s, A, rid, tids[mm], mm, 1, source=MATMUL_V1,
                          result=make_result(mm, "correct", cand=2.0, speedup_eager=2.0, speedup_compile=1.5,
                                             floor_fraction=0.5))
        _add_attempt(s, A, rid, tids[mm], mm, 2, source=MATMUL_V2, parents=[v1.id],
                     result=make_result(mm, "correct", cand=1.6, speedup_eager=2.5, speedup_compile=1.875,
                                        floor_fraction=0.625))
        rl = "level1/relu"
        relu0 = _add_attempt(s, A, rid, tids[rl], rl, 0, source="# relu v0\nclass ModelNew: pass\n",
                             result=make_result(rl, "correct", cand=1.0, speedup_eager=0.8, speedup_compile=0.5,
                                                floor_fraction=0.2))
        _add_attempt(s, A, rid, tids[rl], rl, 1, source="# relu v1\nclass ModelNew: pass\n", parents=[relu0.id],
                     result=make_result(rl, "incorrect", trial_reason="output 0: 3 of 4 elements outside tolerance"))
        cg = "level2/conv_gn"
        _add_attempt(s, A, rid, tids[cg], cg, 0, source="# conv_gn v0 falls back\nclass ModelNew: pass\n",
                     result=make_result(cg, "correct", cand=1.0, speedup_eager=3.0, speedup_compile=2.0,
                                        flags=(("fallback", "calls the reference Model in a try/except"),)))
        _add_attempt(s, A, rid, tids[cg], cg, 1, source="# conv_gn v1\nclass ModelNew: pass\n",
                     result=make_result(cg, "runtime_error", error_type="RuntimeError",
                                        error_message="CUDA error: an illegal memory access was encountered\nmore"))
        ls = "level2/lse"
        _add_attempt(s, A, rid, tids[ls], ls, 0, source=None, parse_status="no_code",
                     parse_error="the answer held no code block")
        _add_attempt(s, A, rid, tids[ls], ls, 1, source="# lse v1\nclass ModelNew: pass\n",
                     result=make_result(ls, "correct", cand=5.0, speedup_eager=1.2, speedup_compile=0.8,
                                        floor_fraction=0.1, flags=(("precision", "uses half"),)))

        # critique calls, a failed call
        crit_calls = []
        for task in (mm, rl):
            c = ModelCall(run_id=rid, task_id=tids[task], round=1, purpose="critique", model="test-model",
                          template="critique.j2", prompt_sha256="1" * 64, messages=[{"role": "user", "content": "?"}],
                          response_text="analysis", prompt_tokens=2000, completion_tokens=300, cost_usd=0.02)
            s.add(c)
            crit_calls.append(c)
        s.add(ModelCall(run_id=rid, task_id=tids[ls], round=0, purpose="propose", model="test-model",
                        template="propose.j2", prompt_sha256="2" * 64, messages=[], response_text=None,
                        error="rate limited"))
        s.flush()

        # analyses: matmul has two (the later one wins), relu one with a finding
        s.add(Analysis(run_id=rid, task_id=tids[mm], round=0, critic="grounded", markdown="## Old analysis\n\nstale",
                       findings=[]))
        s.flush()
        s.add(Analysis(run_id=rid, task_id=tids[mm], round=2, critic="grounded", markdown=ANALYSIS_MATMUL,
                       findings=[{"attempt_id": A[f"{mm}@0"], "category": "compile_error",
                                  "cause": "the loop index i is used outside its declaration", "evidence": [],
                                  "numbers": {}}],
                       model_call_id=crit_calls[0].id))
        s.add(Analysis(run_id=rid, task_id=tids[rl], round=1, critic="grounded",
                       markdown="### ReLU\n\nRound 1 is **wrong** at the tail.",
                       findings=[{"attempt_id": A[f"{rl}@1"], "category": "mismatch",
                                  "cause": "the tail elements beyond the last full block are never written"}]))
        s.flush()

        # ------------------------------------------------------------------ run B
        run_b = _run(s, model="other-model")
        info.run_b = rb = run_b.id
        B = info.attempts_b
        _add_attempt(s, B, rb, tids[mm], mm, 0, source=MATMUL_V1,
                     result=make_result(mm, "correct", cand=2.0, speedup_eager=2.0, speedup_compile=1.5,
                                        floor_fraction=0.5))
        _add_attempt(s, B, rb, tids[rl], rl, 0, source="# relu b\n",
                     result=make_result(rl, "incorrect", trial_reason="NaN in output 0"))
        _add_attempt(s, B, rb, tids[cg], cg, 0, source="# conv_gn b\n",
                     result=make_result(cg, "correct", cand=1.0, speedup_eager=1.5, speedup_compile=1.0,
                                        floor_fraction=0.3))
        _add_attempt(s, B, rb, tids[ls], ls, 0, source="# lse b\n",
                     result=make_result(ls, "correct", cand=5.0, speedup_eager=1.2, speedup_compile=0.8,
                                        floor_fraction=0.1))
    return info


def approx(a: Optional[float], b: Optional[float], tol: float = 1e-9) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
