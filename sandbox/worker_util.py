"""Helpers of the sandbox worker (``sandbox.worker``), imported before any candidate code runs:
the functions they call are bound here at import, so a candidate that patches ``torch.save`` or
``torch.equal`` later does not change what the harness calls."""
from __future__ import annotations

import errno
import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from hardware import clock
from sandbox.compare import compare_outputs, fp64_errors, fp64_verdict
from sandbox.harness import flatten_outputs, is_plain_tensor
from sandbox.result import EvalConfig

# devices whose profiler was warmed up in this worker (before its candidate was known)
_PREWARMED: dict[str, bool] = {}

_save = torch.save
_equal = torch.equal
_memory_reserved = torch.cuda.memory_reserved
_mem_get_info = torch.cuda.mem_get_info


def _memory_held(device: str) -> int:
    """Bytes this process holds where the harness's buffers live (the device's, else host RSS)."""
    if device == "cuda":
        return int(_memory_reserved())
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _exc_payload(exc: BaseException) -> dict[str, Any]:
    payload = {"error_type": type(exc).__name__, "error_message": str(exc)[:4000],
               "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:]}
    if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_initialized():
        # what this process held and what the device had free when it ran out: the parent
        # tells the candidate's own excess from other processes holding more than admitted
        # (sandbox.failures.candidate_oom)
        payload["memory_held"] = _memory_held("cuda")
        payload["device_free"] = int(_mem_get_info()[0])
    return payload


def _save_to(obj: Any, path: Path) -> None:
    # Through a Python file object: a full file system then raises OSError(ENOSPC), where
    # torch.save(obj, str) raises an "unexpected pos" RuntimeError that names no cause.
    # The zip writer's own clean-up then raises a RuntimeError over it: the OSError is its context.
    try:
        with open(path, "wb") as f:
            _save(obj, f)
    except RuntimeError as exc:
        cause = exc.__context__ or exc.__cause__
        if isinstance(cause, OSError):
            raise cause from None
        raise


_nan_to_num = torch.nan_to_num
_isnan = torch.isnan
# _equal_nan compares in flat chunks of this many elements: whole-tensor nan_to_num copies of
# both sides took twice the inputs' bytes (16 GiB for an 8 GiB KernelBench level-1 input).
EQUAL_CHUNK = 1 << 26


def _copies(tensors: list[torch.Tensor], device: Optional[str] = None) -> list[torch.Tensor]:
    """Copies of ``tensors`` on their own device, or on ``device`` (compared chunk by chunk on the
    tensors' device: ``_equal_nan``)."""
    if device is None:
        return [x.clone() for x in tensors]
    return [x.to(device, copy=True) for x in tensors]


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and values, NaN equal to NaN; temporaries of at most ``EQUAL_CHUNK`` elements
    (``b`` may be in host memory: each chunk of it is brought to ``a``'s device)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    exact = not (a.dtype.is_floating_point or a.dtype.is_complex)
    fa, fb = a.reshape(-1), b.reshape(-1)
    for start in range(0, fa.numel(), EQUAL_CHUNK):
        ca, cb = fa[start:start + EQUAL_CHUNK], fb[start:start + EQUAL_CHUNK].to(a.device)
        if exact:
            if not _equal(ca, cb):
                return False
        elif not (_equal(_nan_to_num(ca, nan=0.0), _nan_to_num(cb, nan=0.0)) and _equal(_isnan(ca), _isnan(cb))):
            return False
    return True


def _send(conn: Any, payload: dict[str, Any]) -> None:
    """One message to the parent on the worker's socket (JSON, never pickle)."""
    conn.send_bytes(json.dumps(payload, default=str).encode())


def _recv(conn: Any) -> dict[str, Any]:
    return json.loads(conn.recv_bytes().decode())


class DeviceTurns:
    """The parent's device gate (``sandbox.pool.DeviceGate``), asked for in the middle of one
    request (``WorkerProcess.ask``'s ``device_turns``): ``want`` sends ``{"interim": "device"}``
    and waits for ``{"go": true}`` (the parent then holds the gate for this worker until ``done``
    or the request's reply). Without turns (``enabled`` False) both are no-ops: the parent holds
    the gate around the whole request, or none."""

    def __init__(self, conn: Any, enabled: bool):
        self.conn, self.enabled, self.held = conn, enabled, False

    def want(self, why: str) -> None:
        if not self.enabled or self.held:
            return
        _send(self.conn, {"interim": "device", "why": why})
        answer = _recv(self.conn)
        if not answer.get("go"):
            raise RuntimeError(f"the device was not given for {why}: {answer}")
        self.held = True

    def done(self) -> None:
        if self.enabled and self.held:
            _send(self.conn, {"interim": "device_done"})
            self.held = False


def warm_up(init: dict[str, Any], turns: DeviceTurns) -> dict[str, Any]:
    """What every candidate worker pays before its candidate matters: the build hook's imports,
    the device's context, the profiler's first session. Best effort: a failure here shows again,
    and is reported, when the candidate loads.

    Only its CUDA context's creation and the kernels it launches need the device to itself
    (``turns``; on an H200 NVML counted a context's creation as SM use, 1%): the rest (the
    imports, CUPTI's start-up in a first profiler session: 4-5 s) held the device gate, and
    timings and loads queued behind warm-ups (a median 6-13 s each)."""
    import time

    t0 = time.monotonic()
    device = str(init.get("device", "cpu"))
    import sandbox.build  # noqa: F401 - torch.utils.cpp_extension and the hook
    try:
        if device == "cuda":
            turns.want("the worker's CUDA context")
            torch.empty(1, device=device)       # an allocation, no kernel: the context is made
            turns.done()
        if init.get("profile"):
            from sandbox.profiling import warm_up as profiler_warm_up

            profiler_warm_up(device, kernels=False)     # the profiler's start-up, no kernel run
        turns.want("the worker's first kernels")
        torch.zeros(1, device=device).add_(1)
        clock.device_sync(device)
        if init.get("profile"):
            profiler_warm_up(device)
            _PREWARMED[device] = True
    except Exception as exc:  # noqa: BLE001
        return {"ok": True, "warm_error": f"{type(exc).__name__}: {exc}"[:500], "pid": os.getpid()}
    finally:
        turns.done()
    return {"ok": True, "pid": os.getpid(), "seconds": round(time.monotonic() - t0, 3)}




def save_outputs(tensors: list[torch.Tensor], out_dir: Path, name: str) -> Path:
    """Into the outputs folder (memory-backed where it has room), else, where that file system is
    full, into the worker's own working directory on disk."""
    path = out_dir / name
    try:
        _save_to(tensors, path)
        return path
    except OSError as exc:
        try:
            path.unlink()
        except OSError:
            pass
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        print(f"[kernelloop worker] {out_dir} is full ({exc}): outputs go to {Path.cwd()}", file=sys.stderr, flush=True)
    path = Path.cwd() / name
    _save_to(tensors, path)
    return path


def cap_allocator(init: dict[str, Any], device: str) -> int:
    """The caching allocator capped as the worker's first message asks: a candidate's memory limit
    (``memory_fraction``), or a footprint measured beside running work (``memory_cap_bytes``,
    ``sandbox.footprint.Beside``). Returns the cap in bytes that ``memory_cap_bytes`` set (0: none)."""
    if device != "cuda":
        return 0
    cap = int(init.get("memory_cap_bytes") or 0)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cap else 0
    fraction = init.get("memory_fraction") or (cap / total if cap else None)
    if fraction:
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(fraction)))
    return cap


def double_copy(model: Any) -> Any:
    """A float64 copy of the reference model (same weights, same state), or the reason why not."""
    import copy

    try:
        return copy.deepcopy(model).double()
    except Exception as exc:  # noqa: BLE001 - the float64 check then does not apply
        return f"the reference model could not be copied to float64 ({type(exc).__name__}: {exc})"[:300]


def run_fp64(model64: Any, inputs64: list[Any], device: str) -> tuple[Any, Any]:
    """The reference's outputs in float64 (the float64 check's yardstick), or (None, why not);
    ``model64``: ``double_copy``'s answer."""
    if isinstance(model64, str):
        return None, model64
    try:
        with torch.no_grad():
            out = model64(*inputs64)
        clock.device_sync(device)
    except Exception as exc:  # noqa: BLE001
        return None, f"the reference did not run in float64 ({type(exc).__name__}: {exc})"[:300]
    return [x.detach() if isinstance(x, torch.Tensor) else x for x in flatten_outputs(out)], None


def _fp64_note(want: list[Any], got: list[Any], outs64: Any, numerics: Any) -> Optional[str]:
    """Why ``got`` (torch.compile's outputs) fails the float64 rule against ``outs64`` where eager's
    ``want`` passes it (``sandbox.compare.fp64_verdict``), or None (passes, or no float64 run)."""
    if outs64 is None or len(outs64) != len(want):
        return None
    for i, (w, g, x) in enumerate(zip(want, got, outs64)):
        errs = fp64_errors(w, g, x) if isinstance(x, torch.Tensor) else None
        why = errs and fp64_verdict(SimpleNamespace(index=i, ref_fp64_rel_rms=errs[0], fp64_rel_rms=errs[1]), numerics)
        if why:
            return why
    return None


def compiled_check(model: Any, compiled: Any, inputs: Any, numerics: Any, device: str,
                   fp64: Optional[Callable[[list[Any]], tuple[Any, Any]]] = None,
                   memo: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """torch.compile's output against the eager reference's on ``inputs()``, by KernelBench's rule
    (the judge's own comparison, ``sandbox.compare.compare_outputs``, at the precision's tolerance,
    without the float64 rule): the compiled baseline a speedup is quoted against may itself compute
    something else (channels-last TF32 convolutions where the reference's are full fp32).
    ``within``: every output within; ``max_abs``: the largest absolute difference (None where the
    outputs are not plain tensors of the same shapes); ``error``, and neither, where the extra
    forwards failed (out of memory on a large task: the timing stands).

    ``fp64`` (the reference's float64 run of these inputs: outputs, or None and why not): where
    given, ``fp64_note`` says why the float64 rule the judge applies to candidates (relative RMS
    error against float64 at most ``rms_factor`` times eager's plus a few epsilons) would flag the
    compiled output ``inaccurate``, else None. On an H200 channels-last TF32 convolutions passed
    1e-4 on level2/65, 67 and 92 but were 100-4000 times farther from float64 than eager's NCHW ones:
    a candidate computing so is not clean there, and compile was timed so (session ad). ``memo``
    (the reference worker's): the float64 run made once a worker, its answer kept for the next
    evaluations (the same model and compiled code; a float64 forward of a large convolution is not free)."""
    tol = numerics.tolerance.atol
    try:
        with torch.no_grad():
            xs = inputs()
            want, got = flatten_outputs(model(*xs)), flatten_outputs(compiled(*xs))
        if (len(want) != len(got) or not all(is_plain_tensor(x) for x in want + got)
                or any(w.shape != g.shape for w, g in zip(want, got))):
            return {"within": False, "max_abs": None, "tolerance": tol}
        within, _, checks = compare_outputs(want, got, EvalConfig(numerics=numerics))
        found = {"within": within, "max_abs": max((c.max_abs_err or 0.0 for c in checks), default=0.0),
                 "tolerance": tol}
        if fp64 is None:
            return found
        if memo is None or "fp64_note" not in memo:
            note = _fp64_note(want, got, fp64(xs)[0], numerics)
            if memo is None:
                return {**found, "fp64_note": note}
            memo["fp64_note"] = note
        return {**found, "fp64_note": memo["fp64_note"]}
    except Exception as exc:  # noqa: BLE001 - reported, never the candidate's fault
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
