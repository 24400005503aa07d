"""A reference's start on cuda with the device held only where the reference runs on it.

A reference worker starts by building its model on the device and, where compile timings are
wanted, by a warm-up ``torch.compile`` of it: dynamo's trace, inductor's code generation and
Triton's builds (CPU work, about 10 s of each start at KernelBench's level-2 sizes), then the
compiled forward's first run. The parent's device gate (``sandbox.pool.DeviceGate``) keeps the
harness's own device work out of other candidates' timed windows; held around the whole start,
it held their timings back for the CPU part too (session u's one-GPU bench: reference starts held
the gate 239 s over 23 starts, and timings waited 170 s for it).

Here the worker asks for the device in turns (``sandbox.worker_util.DeviceTurns``) and gives it
back while it only computes on the CPU:

* the model's construction and the warm-up inputs: one turn;
* the compiled call: held, except inside each dynamo compilation (``torch._dynamo.callback``'s
  start and end callbacks, which run around the trace and inductor's code generation, before
  the compiled code first runs); Triton's autotuning at the first run happens inside the turn;
* a GPU benchmark inductor runs while it compiles (``pad_mm``'s: through the benchmark lock
  hook torch 2.13 gives harnesses, ``set_gpu_benchmark_lock_context``, or before it through its
  ``benchmarker`` object) takes a turn of its own.

Each turn ends with a device synchronisation, so nothing launched in it runs in another's
timed window. Where a hook is missing (another torch), the turn is held across that part, as
before: slower, never less quiet.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from hardware import clock
from sandbox.worker_util import DeviceTurns


class ReferenceTurns:
    """``DeviceTurns`` for a reference's start: each ``give_back`` synchronises the device
    first, and a nested ``turn`` inside a held one changes nothing."""

    def __init__(self, turns: DeviceTurns, device: str):
        self.turns, self.device = turns, device

    def take(self, why: str) -> None:
        self.turns.want(why)

    def give_back(self) -> None:
        if self.turns.held:
            clock.device_sync(self.device)
            self.turns.done()

    @contextlib.contextmanager
    def turn(self, why: str) -> Iterator[None]:
        if self.turns.held:
            yield
            return
        self.take(why)
        try:
            yield
        finally:
            self.give_back()


def _gate_benchmarks(turns: ReferenceTurns) -> Optional[Callable[[], None]]:
    """Inductor's GPU benchmarks (``pad_mm``'s, while it compiles) each in a turn of their own;
    what undoes it, or None where this torch offers no way to (the turn is then held across the
    compilation). torch 2.13 gives harnesses a hook for it (``set_gpu_benchmark_lock_context``);
    before it, every GPU benchmark goes through the ``benchmarker`` object's ``benchmark_gpu``,
    replaced on that object for the warm-up."""
    try:
        from torch._inductor.runtime import benchmarking
    except ImportError:
        return None
    hook = getattr(benchmarking, "set_gpu_benchmark_lock_context", None)
    if hook is not None:
        previous = hook(lambda: turns.turn("a benchmark of inductor's compilation"))
        return lambda: hook(previous)
    bench = getattr(benchmarking, "benchmarker", None)
    original = getattr(bench, "benchmark_gpu", None)
    if original is None:
        return None

    def benchmark_gpu(*args: Any, **kwargs: Any) -> Any:
        with turns.turn("a benchmark of inductor's compilation"):
            return original(*args, **kwargs)

    bench.benchmark_gpu = benchmark_gpu
    return lambda: vars(bench).pop("benchmark_gpu", None)


@contextlib.contextmanager
def _hooks(turns: ReferenceTurns) -> Iterator[None]:
    """The turn given back around each dynamo compilation, where inductor's GPU benchmarks can
    be put in turns of their own (else it is held across, as before)."""
    undo: list[Callable[[], None]] = []
    ungate = _gate_benchmarks(turns)
    if ungate is not None:
        undo.append(ungate)
        try:
            from torch._dynamo.callback import callback_handler

            def start(_args: Any) -> None:
                turns.give_back()

            def end(_args: Any) -> None:
                turns.take("the reference's compiled forward")

            callback_handler.register_start_callback(start)
            callback_handler.register_end_callback(end)
            undo += [lambda: callback_handler.remove_start_callback(start),
                     lambda: callback_handler.remove_end_callback(end)]
        except (ImportError, AttributeError):
            pass                # held across the compilation too
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def warm_compiled(model: torch.nn.Module, make_inputs: Callable[[], tuple], device: str,
                  turns: ReferenceTurns) -> torch.nn.Module:
    """``torch.compile(model)`` after its first call (the compiled module, as torch.compile
    returns it: the compile timings use it as is), the device held as the module docstring says.
    Exceptions propagate; the turn is given back either way."""
    compiled = torch.compile(model)
    turns.take("the reference's warm-up inputs")
    try:
        with _hooks(turns), torch.no_grad():
            compiled(*make_inputs())
        turns.take("the reference's warm-up end")      # given back by a compilation that raised
        clock.device_sync(device)
        if device == "cuda":
            torch.cuda.empty_cache()    # the warm-up's inputs and workspace
    finally:
        turns.give_back()
    return compiled
