"""The data model that flows out of the sandbox: one typed ``EvalResult`` per evaluation.

Everything the critic, the loop's prompts and the reports say about an attempt comes
from these fields, so each figure carries its unit in its name (``_ms``, ``_s``, ``_us``).
"""
from __future__ import annotations

import hashlib
import json
from enum import Enum
from typing import Any, Optional

from pydantic import BaseModel, Field, model_validator

from sandbox.locations import MismatchMap
from sandbox.numerics import Numerics, Tolerance


class Status(str, Enum):
    compile_error = "compile_error"
    load_error = "load_error"
    runtime_error = "runtime_error"
    timeout = "timeout"
    incorrect = "incorrect"
    correct = "correct"
    # The harness failed (sandbox.failures), not the candidate: no verdict. Left out of metrics,
    # feedback and the critic; `optimize --resume` evaluates the attempt again.
    infra_error = "infra_error"


class FlagKind(str, Enum):
    no_custom_kernel = "no_custom_kernel"   # no kernel of the candidate's own ran
    fallback = "fallback"                   # a path back to PyTorch (try/except, reference Model)
    precision = "precision"                 # the source asks for lower precision (half, bf16, tf32): a note
    inaccurate = "inaccurate"               # measured: further from float64 than the float32 reference
    suspicious = "suspicious"               # evidence of tampering with the harness or the timer
    impossible = "impossible"               # faster than the roofline floor allows
    inputs_mutated = "inputs_mutated"
    contended = "contended"                 # the device (or host) was busy while timing: no speedup to trust


# The flags that cast doubt on a verdict or a timing: a result carrying one is not ``clean``.
# Everything else (``precision``) is a note.
DISQUALIFYING_FLAGS = frozenset({FlagKind.suspicious, FlagKind.impossible, FlagKind.no_custom_kernel,
                                 FlagKind.fallback, FlagKind.inputs_mutated, FlagKind.inaccurate,
                                 FlagKind.contended})


class Flag(BaseModel):
    kind: FlagKind
    reason: str


class EvalConfig(BaseModel):
    """Everything that changes a verdict or a timing; its hash keys the evaluation cache."""

    trials: int = Field(5, ge=1)
    warmup_runs: int = Field(3, ge=0)
    timed_runs: int = Field(20, ge=1)
    # precision, math mode, tolerance and the float64 rules: sandbox.numerics
    numerics: Numerics = Numerics()
    build_timeout_s: float = 600.0
    run_timeout_s: float = 300.0
    memory_limit_mb: Optional[int] = None      # address-space limit of the candidate worker (cpu)
    time_compile: bool = True                  # also time the reference under torch.compile
    profile: bool = True
    flush_l2: bool = True
    # what candidates are written in (sandbox.backends): cuda | cpu | triton; None: the device's
    # load_inline backend (every config stored before backends existed)
    backend: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_numerics(cls, data: Any) -> Any:
        # Configs stored before numerics existed ran IEEE fp32 (TF32 off) at tolerance 1e-4.
        if isinstance(data, dict) and "trials" in data and "numerics" not in data:
            data = {**data, "numerics": {"precision": "fp32", "math": "strict",
                                         "fp64_check": data.get("fp64_check", True),
                                         "rms_factor": data.get("fp64_factor", 2.0),
                                         "rms_slack_eps": data.get("fp64_slack_eps", 4.0)}}
        return data

    def hash(self) -> str:
        data = self.model_dump(mode="json")
        if data.get("backend") is None:
            data.pop("backend", None)       # the load_inline backends keep the keys they had before backends
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class BuildInfo(BaseModel):
    ok: bool
    seconds: float = 0.0
    cached: bool = False
    extensions: list[str] = []               # content-hashed extension names
    log: str = ""                            # capped
    first_error: Optional[str] = None        # first compiler error line, verbatim
    first_error_line: Optional[int] = None   # its line within the candidate's source file
    notes: list[str] = []                    # how it was built (e.g. the lighter torch header)


class OutputCheck(BaseModel):
    index: int
    shape: list[int]
    dtype: str
    ref_shape: list[int]
    ref_dtype: str
    max_abs_err: Optional[float] = None
    max_rel_err: Optional[float] = None
    mismatched: int = 0                      # elements that fail (outside tolerance, and not rescued by float64)
    outside_tolerance: int = 0               # elements outside atol/rtol of the reference (KernelBench's count)
    ref_fp64_max_abs: Optional[float] = None # the reference's largest distance from its float64 run, where it was needed
    numel: int = 0
    nan_count: int = 0                       # NaN in the candidate where the reference is finite
    inf_count: int = 0
    ref_nonfinite: int = 0
    mismatch_pattern: Optional[str] = None   # everywhere | some_rows | tile_edges | scattered
    bad_rows: Optional[list[int]] = None     # first few rows (leading dims) with mismatches
    locations: Optional[MismatchMap] = None  # where the wrong elements sit, per axis (sandbox.locations)
    tolerance: Tolerance
    # the float64 check (first trial only): relative RMS errors against the reference in float64
    fp64_rel_rms: Optional[float] = None     # the candidate's
    ref_fp64_rel_rms: Optional[float] = None # the float32 reference's own


class Trial(BaseModel):
    index: int
    candidate_first: bool
    passed: bool
    reason: Optional[str] = None             # first failing check, in words
    outputs: list[OutputCheck] = []


class Timing(BaseModel):
    median_ms: float
    iqr_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    runs: int
    clock: str                               # cuda_event | perf_counter
    samples_ms: list[float] = []             # every timed run, in order (intervals are bootstrapped from these)
    host_load: Optional[float] = None        # 1-minute load average per usable CPU when the runs ended
    page_faults: Optional[float] = None      # cpu: median minor page faults per timed call (the process's;
                                             # with blocks, the median of the blocks' medians)
    # How the runs were sequenced against the other side's (sandbox.checks): None (every Timing
    # before blocks, and every cuda one) or 1: one block of consecutive runs in its worker, the other
    # side's block before or after it; k > 1 (cpu): k short blocks interleaved with the other side's,
    # the order alternating (ABBA), the median over all runs. See ``convention``.
    blocks: Optional[int] = None
    # The timing thread's own account of the window (warm-up included; sandbox.timing.time_runs): its
    # CPU time, the wall time, and how often the kernel preempted it. A launch-bound forward's host
    # thread is busy the whole window, so CPU time well below the wall time, or many preemptions, say
    # the host's other work took its core (quiet.host_contended).
    host_cpu_ms: Optional[float] = None
    host_wall_ms: Optional[float] = None
    host_preempted: Optional[int] = None
    # The clocks when the window ended (sandbox.timing.clocks): the frequency of the core the timing
    # thread last ran on, and the GPU's SM clock (NVML, cuda only). Slow yet steady reference windows
    # (session w: one task's eager 1.9-5.2 ms on a quiet host, its thread on the CPU throughout) are
    # read against them.
    host_cpu_mhz: Optional[float] = None
    gpu_sm_mhz: Optional[float] = None
    # cuda: the caching allocator over the window (sandbox.timing.allocator_counts): the blocks it took
    # from the driver (``cudaMalloc``) and the times an allocation failed, the cache was freed and it
    # tried again (the GPU's memory short). Either costs host time no event sees, on the parent's clock
    # (sandbox.clock_check); session af's level2/100 channels-last candidate spent 589 ms of its thread's
    # wall time on 23 runs of 4.8 ms each.
    device_allocs: Optional[int] = None
    alloc_retries: Optional[int] = None
    # A reference window measured earlier in the run, standing in for this evaluation's (sandbox.checks
    # ``_steady``: this one was far above the task's fastest twice; the fastest is used, so the
    # speedup is the lower one)
    from_earlier: bool = False

    @property
    def convention(self) -> str:
        """The timing convention, in words, as reports print it."""
        if (self.blocks or 1) > 1:
            return (f"median of {self.runs} runs in {self.blocks} blocks interleaved with the other side's "
                    f"(ABBA), {self.clock}")
        return f"median of {self.runs} runs in one block, {self.clock}"


class KernelStat(BaseModel):
    name: str
    count: int
    total_us: float
    share: float                             # of all device (or CPU op) time
    own: bool = False                        # declared in the candidate's source


class EvalResult(BaseModel):
    status: Status
    task: str
    task_sha256: str = ""
    candidate_sha256: str = ""
    device: str                              # cuda | cpu
    device_name: str = ""
    torch_version: str = ""
    config: EvalConfig = EvalConfig()
    seconds: float = 0.0                     # wall time of the whole evaluation
    phases: dict[str, float] = {}            # seconds per stage (build_wait, build, reference, load, device_wait, trials, ...)
    gpu: Optional[str] = None                # the slot's GPU it ran on (its CUDA_VISIBLE_DEVICES entry); None: cpu

    build: Optional[BuildInfo] = None
    error_type: Optional[str] = None
    error_message: Optional[str] = None
    traceback: Optional[str] = None
    stdout: str = ""
    stderr: str = ""
    infra_retries: list[str] = []            # causes of harness failures retried before this result

    trials: list[Trial] = []
    candidate_time: Optional[Timing] = None
    eager_time: Optional[Timing] = None
    compile_time: Optional[Timing] = None
    speedup_eager: Optional[float] = None
    speedup_compile: Optional[float] = None
    # torch.compile's own output against eager's at the precision's tolerance (KernelBench's rule), on
    # the first timed run's inputs: False where the baseline of speedup_compile computes something else
    compile_within_tolerance: Optional[bool] = None
    compile_max_abs_error: Optional[float] = None
    # why torch.compile's output fails the float64 rule applied to candidates (``inaccurate``), on
    # the same inputs; None where it passes or no float64 run was made
    compile_fp64_note: Optional[str] = None

    flags: list[Flag] = []
    custom_calls_per_forward: Optional[float] = None   # calls into the candidate's own extensions
    profile: list[KernelStat] = []                     # candidate
    reference_profile: list[KernelStat] = []

    floor_ms: Optional[float] = None                   # max(bytes / bandwidth, flops / rate) on this device
    floor_fraction: Optional[float] = None             # floor_ms / candidate median
    floor_basis: Optional[str] = None                  # the arithmetic the floor assumed (hardware.floors)
    floor_flops: Optional[float] = None                # FLOPs of one forward (FlopCounterMode)
    floor_bytes: Optional[float] = None                # fewest bytes one forward must move

    # Containment (sandbox.keeper): how the candidate's processes were contained, and the processes
    # it left behind that the sandbox killed (its build's and run's; described as found)
    containment: Optional[str] = None                  # cgroup | subreaper | none
    stray_processes_killed: int = 0
    stray_processes: list[str] = []
    # sandbox.runcheck: timed runs whose outputs were checked (a secret sample of each against the reference)
    timed_runs_checked: int = 0
    # sandbox.quiet: how often the reference was timed again because its time jumped
    reference_retimed: int = 0

    @property
    def correct(self) -> bool:
        return self.status is Status.correct

    @property
    def infra(self) -> bool:
        """No verdict: the harness failed (see ``sandbox.failures``)."""
        return self.status is Status.infra_error

    @property
    def clean(self) -> bool:
        """Correct and carrying no flag that casts doubt on the verdict or the timing."""
        return self.correct and not any(f.kind in DISQUALIFYING_FLAGS for f in self.flags)

    @property
    def contended_only(self) -> bool:
        """Correct, and its only doubt its timing (``contended``: the machine was disturbed, the
        harness's condition, not the candidate's): the candidate to measure again, or to improve on."""
        return self.correct and {f.kind for f in self.flags if f.kind in DISQUALIFYING_FLAGS} == {FlagKind.contended}

    @property
    def fp64_measured(self) -> bool:
        """Whether the float64 check measured an output (then ``inaccurate`` is its verdict)."""
        return any(o.fp64_rel_rms is not None for t in self.trials for o in t.outputs)

    def has_flag(self, kind: FlagKind | str) -> bool:
        return any(f.kind == FlagKind(kind) for f in self.flags)

    def add_flag(self, kind: FlagKind | str, reason: str) -> None:
        self.flags.append(Flag(kind=FlagKind(kind), reason=reason))

    def add_strays(self, strays: list[str], when: str) -> None:
        """Processes the candidate left running, killed by the sandbox: counted, named, flagged."""
        if not strays:
            return
        self.stray_processes_killed += len(strays)
        self.stray_processes = (self.stray_processes + list(strays))[:10]
        self.add_flag(FlagKind.suspicious, f"left {len(strays)} process(es) running {when}, killed by the sandbox: "
                      + "; ".join(strays[:3])[:300])

    def first_failed_trial(self) -> Optional[Trial]:
        return next((t for t in self.trials if not t.passed), None)


class BuildCheck(BaseModel):
    """What ``kernelloop eval --build-only`` reports: the static scan and the build, nothing run.

    Needs no GPU: CUDA candidates build wherever nvcc and a CUDA build of torch are installed,
    for the architecture named (``--arch``/``TORCH_CUDA_ARCH_LIST``) or the visible GPU's."""
    task: str
    device: str
    arch: Optional[str] = None
    torch_version: str = ""
    ok: bool
    status: Optional[Status] = None          # where not ok: compile_error, load_error or timeout
    error_type: Optional[str] = None
    error_message: Optional[str] = None
    build: Optional[BuildInfo] = None
    flags: list[Flag] = []
    seconds: float = 0.0

