"""Every timed run checked: a secret sample of each timed output against the reference's.

A candidate that skips its work on some timed runs (returns its previous output, or a cheap
decoy) moves the median while passing the trials; the full comparisons of two timed runs
(``sandbox.checks``' spot checks) catch it only by luck. So every timed run is checked, at a
cost far below a second timing:

* in the candidate's worker, after each timed run's clock stopped, ``Sampler`` draws
  ``SAMPLE`` positions of every output from fresh OS entropy (bound before the candidate's code
  ran; the positions do not exist before the output does, so a candidate cannot know which
  elements will be read) and gathers them on the device: ``SAMPLE`` elements per output and run,
  nothing copied through host memory until the timing is over. The positions and values go into
  buffers allocated at the first timed run for all of them (``Sampler.runs_expected``), so after
  that run the sampler allocates nothing that outlives its call: samples kept in fresh small
  allocations after each run's output sat between the forward's freed buffers in the candidate
  worker's heap, the next run's buffers went to fresh heap pages, and each timed forward paid
  their first-touch page faults on the clock (28 per run at a seed task's CPU sizes, about 15% of
  the forward's time), which the reference worker, keeping nothing, never paid: the CPU A/A
  check read the task's own ``Model`` at 0.82-0.94x (``docs/judge.md``);
* the candidate is timed before the reference; the trusted reference worker reads the positions
  and the candidate's values (``weights_only``), and while the reference is timed on the same
  inputs (the same secret seeds), ``SampleCheck`` gathers the reference's outputs at those
  positions after each run's clock stopped and compares them with ``sandbox.compare``'s rule and
  the run's ``Numerics`` tolerance (``sandbox.numerics`` is where tolerances come from);
* a run whose sample fails the tolerance is looked at again with the float64 rule (the reference
  run of that seed in float32 and float64, as in a trial), so an honest kernel is not failed for
  elements the float64 rule accepts; a run that still fails makes the candidate ``incorrect``.

Neither worker does more forward calls than before except for such a recheck.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from sandbox.harness import flatten_outputs, is_plain_tensor

SAMPLE = 1024                      # elements per output and timed run
MAX_RECHECKS = 20                  # runs rechecked with the float64 rule before giving up on the candidate

_urandom = os.urandom              # bound before candidate code runs (sandbox.worker imports this first)
_randint = torch.randint
_arange = torch.arange
_empty = torch.empty
_index_select = torch.index_select
_as_strided = torch.as_strided
_zeros_like = torch.zeros_like
_Generator = torch.Generator


def gather(x: torch.Tensor, pos: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x``'s elements at flat positions ``pos`` (row-major over its shape, as ``x.reshape(-1)[pos]``),
    into ``out`` where given. A non-contiguous ``x`` (a channels-last output, a permuted or expanded
    view) is read where its elements lie, through their strides, instead of being copied whole: the
    copy ``reshape(-1)`` makes of such an output took its size again on the device after every
    timed run (126 MB a run for level2/100's channels-last candidate, session ag), and on the CPU a
    fresh allocation of that size, first-touch page faults included."""
    x = x.detach()
    if x.is_contiguous() or x.numel() == 0:
        flat = x.reshape(-1)
    else:
        offsets, rest = _zeros_like(pos), pos
        for size, stride in zip(reversed(x.shape), reversed(x.stride())):
            offsets = offsets + (rest % size) * stride
            rest = rest // size
        span = 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
        flat, pos = _as_strided(x, (span,), (1,), x.storage_offset()), offsets
    return _index_select(flat, 0, pos, out=out) if out is not None else _index_select(flat, 0, pos)


class Sampler:
    """Candidate side: a secret sample of every output of every timed run, kept on the device.

    ``runs``: the timed runs to come (the worker's ``time`` request). The first sampled run
    allocates, per output, one buffer of positions and one of values for all ``runs`` runs; every
    later run draws its positions and gathers its values into its rows (``out=``), so nothing it
    keeps is allocated between the timed forwards (see the module's docstring: kept allocations
    there moved the candidate's forward onto fresh, faulting heap pages). A run whose outputs do
    not match the first run's layout (count, dtype, size class), or beyond ``runs``, is kept in
    allocations of its own, as before."""

    def __init__(self, device: str, sample: int = SAMPLE, runs: Optional[int] = None):
        self.device, self.sample = device, sample
        self.runs_expected = runs
        self.gen = _Generator(device=device)
        self.runs: dict[int, list[list[torch.Tensor]]] = {}
        self.bad: dict[int, str] = {}
        # per output of the first sampled run: (numel, dtype, positions [runs, k], values [runs, k])
        self._buffers: Optional[list[tuple[int, torch.dtype, torch.Tensor, torch.Tensor]]] = None

    def positions(self, numel: int, device: torch.device) -> torch.Tensor:
        if numel <= self.sample:
            return _arange(numel, device=device)
        self.gen.manual_seed(int.from_bytes(_urandom(8), "little") >> 1)
        return _randint(0, numel, (self.sample,), generator=self.gen, device=device)

    def _allocate(self, flat: list[torch.Tensor]) -> None:
        rows = self.runs_expected or 0
        if rows <= 0:
            self._buffers = []
            return
        bufs = []
        for x in flat:
            k = min(x.numel(), self.sample)
            pos = _empty((rows, k), dtype=torch.int64, device=x.device)
            if x.numel() <= self.sample:
                pos.copy_(_arange(k, device=x.device).expand(rows, k))
            bufs.append((x.numel(), x.dtype, pos, _empty((rows, k), dtype=x.dtype, device=x.device)))
        self._buffers = bufs

    def _fits(self, i: int, flat: list[torch.Tensor]) -> bool:
        bufs = self._buffers
        return (bufs is not None and 0 <= i < (self.runs_expected or 0) and len(bufs) == len(flat)
                and all(x.dtype == dt and (x.numel() == n or min(x.numel(), n) > self.sample)
                        and x.device == pos.device for x, (n, dt, pos, _) in zip(flat, bufs)))

    def __call__(self, i: int, out: Any) -> None:
        flat = flatten_outputs(out)
        if not all(is_plain_tensor(x) for x in flat):
            self.bad[i] = "the output is not a plain torch.Tensor"
            return
        for x in flat:
            if x.device.type != torch.device(self.device).type:
                self.bad[i] = f"an output is on {x.device}, not {self.device}"
                return
        if self._buffers is None:
            self._allocate(flat)
        if self._fits(i, flat):
            kept = []
            for x, (_, _, pos, vals) in zip(flat, self._buffers or []):
                p, v = pos[i], vals[i]
                if x.numel() > self.sample:
                    self.gen.manual_seed(int.from_bytes(_urandom(8), "little") >> 1)
                    _randint(0, x.numel(), (self.sample,), generator=self.gen, device=x.device, out=p)
                gather(x, p, out=v)
                kept.append([p, v])
            self.runs[i] = kept
            return
        kept = []
        for x in flat:
            pos = self.positions(x.numel(), x.device)
            kept.append([pos, gather(x, pos)])
        self.runs[i] = kept

    def save(self, path: Path, save: Callable[[Any, Any], None]) -> None:
        # each run's rows copied out on their own (a view would save its whole buffer with it)
        data = {"runs": {i: [[p.cpu().clone(), v.cpu().clone()] for p, v in outs] for i, outs in self.runs.items()},
                "bad": dict(self.bad)}
        save(data, path)
        self.runs, self.bad, self._buffers = {}, {}, None


class SampleCheck:
    """Reference side: the candidate's samples of ``runs`` timed runs, checked against the
    reference's outputs of the same runs as its own timed runs produce them."""

    def __init__(self, path: str, device: str, runs: int, config: Any):
        self.runs, self.config, self.device = runs, config, device
        self.failed: dict[int, str] = {}
        self.checked: set[int] = set()
        self.recheck: dict[int, list[tuple[torch.Tensor, torch.Tensor, Any]]] = {}
        self.samples, why = _load(path, device)
        if self.samples is None:
            self.failed = {i: why for i in range(runs)}
            return
        runs_, bad = self.samples
        for i in range(runs):
            if i in bad:
                self.failed[i] = bad[i]
            elif i not in runs_:
                self.failed[i] = "no sample of its output was taken"

    def __call__(self, i: int, out: Any) -> None:
        from sandbox.compare import compare_tensor

        if self.samples is None or i in self.failed or i >= self.runs:
            return
        flat = flatten_outputs(out)
        cand = self.samples[0][i]
        self.checked.add(i)
        if len(cand) != len(flat):
            self.failed[i] = f"{len(cand)} output(s), the reference {len(flat)}"
            return
        for j, (r, (pos, vals)) in enumerate(zip(flat, cand)):
            if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= r.numel()):
                self.failed[i] = f"output {j} has another size than the reference's ({r.numel()} elements)"
                return
            ref_vals = gather(r, pos)
            if vals.dtype != ref_vals.dtype or vals.shape != ref_vals.shape:
                self.failed[i] = f"output {j} has dtype {vals.dtype}, the reference {ref_vals.dtype}"
                return
            check = compare_tensor(j, ref_vals, vals, self.config)
            if check.nan_count or check.inf_count or check.mismatched:
                self.recheck.setdefault(i, []).append((pos, vals, check))

    def finish(self, worker: Any) -> dict[str, Any]:
        """Recheck the runs whose samples failed the tolerance with the float64 rule (``worker`` is
        the reference ``sandbox.worker.Worker``: its task, model and float64 copy); the verdict."""
        for n, (i, outs) in enumerate(sorted(self.recheck.items())):
            if n >= MAX_RECHECKS:
                self.failed[i] = _why(outs[0][2], self.config, rechecked=False)
                continue
            why = self._recheck(worker, i, outs)
            if why:
                self.failed[i] = why
        checked = len(self.checked - set(self.failed))
        return {"checked": checked, "failed": [[i, why] for i, why in sorted(self.failed.items())]}

    def _recheck(self, worker: Any, i: int, outs: list[tuple[torch.Tensor, torch.Tensor, Any]]) -> Optional[str]:
        from sandbox.compare import Fp64Bound, compare_tensor, fp64_bounds

        first = outs[0][2]
        numerics = self.config.numerics
        if not numerics.fp64_check or first.nan_count or first.inf_count:
            return _why(first, self.config, rechecked=False)
        from sandbox.harness import make_inputs

        inputs = make_inputs(worker.task, worker.timing_seed + i, self.device, worker.numerics)
        with torch.no_grad():
            ref = [x.detach() for x in flatten_outputs(worker.model(*inputs))]
        ref64, _ = worker._run_fp64(worker._inputs64(inputs))
        if ref64 is None:
            return _why(first, self.config, rechecked=False)
        bounds = fp64_bounds(ref, ref64, numerics)
        for pos, vals, check in outs:
            bound = bounds[check.index] if check.index < len(bounds) else None
            if bound is None:
                return _why(check, self.config, rechecked=False)
            sampled = Fp64Bound(bound.ref64[pos], bound.ref_max_abs, numerics)
            again = compare_tensor(check.index, gather(ref[check.index], pos), vals, self.config, sampled)
            if again.mismatched or again.nan_count or again.inf_count:
                return _why(again, self.config, rechecked=True)
        return None


def _why(check: Any, config: Any, rechecked: bool) -> str:
    tol = config.numerics.tolerance
    if check.nan_count or check.inf_count:
        return f"output {check.index}: {check.nan_count} NaN and {check.inf_count} Inf where the reference is finite"
    rule = " and farther from float64 than the float64 rule allows" if rechecked else ""
    return (f"output {check.index}: {check.mismatched} of {check.numel} sampled elements outside "
            f"atol={tol.atol:g}, rtol={tol.rtol:g}{rule} (max abs error {check.max_abs_err:.3g})")


def _load(path: str, device: str) -> tuple[Optional[tuple[dict, dict]], str]:
    """The candidate's samples file, validated: ({run: [(positions, values)]}, {run: why bad})."""
    try:
        data = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001
        return None, f"its samples could not be read ({type(exc).__name__})"
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    ok = isinstance(data, dict) and isinstance(data.get("runs"), dict) and isinstance(data.get("bad"), dict)
    runs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    if ok:
        for i, outs in data["runs"].items():
            if not isinstance(i, int) or not isinstance(outs, list):
                ok = False
                break
            pairs = []
            for pair in outs:
                if not (isinstance(pair, list) and len(pair) == 2 and all(type(t) is torch.Tensor for t in pair)
                        and pair[0].dtype == torch.int64 and pair[0].dim() == 1 and pair[1].dim() == 1
                        and pair[0].numel() == pair[1].numel() <= SAMPLE):
                    ok = False
                    break
                pairs.append((pair[0], pair[1]))
            runs[i] = pairs
    if not ok:
        return None, "its samples are malformed"
    bad = {int(i): str(why)[:300] for i, why in data["bad"].items() if isinstance(i, int)}
    return (runs, bad), ""
