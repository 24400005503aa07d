"""Work that starts before the clock's start event: a side stream must wait for the caller's
stream (fork) and be waited for by it (join). The static scan reads the source as Python (comments
and strings never count) and C++ without its comments; the runtime check runs the clock's preamble
before each profiled forward and finds the forward's device work that started before it ended."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sandbox import anticheat
from sandbox.profiling import ahead_of_clock, split_preamble
from sandbox.anticheat import UNFORKED, UNJOINED, side_stream_flags

SIDE = "s = torch.cuda.Stream()\nwith torch.cuda.stream(s):\n    y = f(x)\n"
FORK = "s.wait_stream(torch.cuda.current_stream())\n"
JOIN = "torch.cuda.current_stream().wait_stream(s)\n"


def test_a_side_stream_needs_both_a_fork_and_a_join():
    assert side_stream_flags(FORK.join(["", SIDE]) + JOIN) == []
    assert side_stream_flags(SIDE + JOIN) == [UNFORKED]          # joined, not forked: runs ahead of the clock
    assert side_stream_flags(FORK.join(["", SIDE])) == [UNJOINED]
    assert side_stream_flags("y = f(x)\n" + JOIN) == []           # no side stream of its own: nothing to say
    # through a name bound to the current stream, and a fork through an event recorded on it
    named = ("cur = torch.cuda.current_stream()\ns = torch.cuda.Stream()\nev = torch.cuda.Event()\nev.record(cur)\n"
             "s.wait_event(ev)\nwith torch.cuda.stream(s):\n    y = f(x)\ncur.wait_stream(s)\n")
    assert side_stream_flags(named) == []


def test_a_fork_or_join_in_a_comment_or_a_string_does_not_count():
    commented = SIDE + "# " + FORK + "# " + JOIN
    assert side_stream_flags(commented) == [UNJOINED, UNFORKED]
    quoted = SIDE + f"NOTE = {FORK + JOIN!r}\n"
    assert side_stream_flags(quoted) == [UNJOINED, UNFORKED]
    reasons = {f.reason for f in anticheat.scan(commented)}
    assert UNJOINED in reasons and UNFORKED in reasons


def test_cpp_streams_are_read_without_their_comments():
    body = ("auto side = at::cuda::getStreamFromPool();\n"
            "{fork}cudaEventRecord(ready, at::cuda::getCurrentCUDAStream());\n{fork}cudaStreamWaitEvent(side, ready, 0);\n"
            "k<<<1, 1, 0, side>>>(p);\ncudaEventRecord(done, side);\n"
            "{join}cudaStreamWaitEvent(at::cuda::getCurrentCUDAStream(), done, 0);\n")
    source = 'CUDA = r"""\n{}"""\n'
    assert side_stream_flags(source.format(body.format(fork="", join=""))) == []
    assert side_stream_flags(source.format(body.format(fork="", join="// "))) == [UNJOINED]
    assert side_stream_flags(source.format(body.format(fork="/* ", join="").replace("0);\n", "0); */\n", 2))) \
        == [UNFORKED]
    raw = "cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);\nk<<<1, 1, 0, s>>>(p);\n"
    assert side_stream_flags(source.format(raw)) == [UNJOINED, UNFORKED]


def test_the_adversarial_side_stream_cases_read_as_their_headers_say():
    from pathlib import Path

    cuda = Path(__file__).parent / "adversarial" / "cuda"
    for legit in ("legit_cuda_graph", "legit_joined_side_stream"):
        assert side_stream_flags((cuda / f"{legit}.py").read_text()) == [], legit
    assert UNJOINED in side_stream_flags((cuda / "join_in_comment.py").read_text())
    # its only fork is in __init__: the static scan is satisfied, the runtime check is what catches it
    assert side_stream_flags((cuda / "side_stream_before_start.py").read_text()) == []


# ------------------------------------------------------------------ the runtime check, on a recorded profile
CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _evt(name, start, end, device=CUDA, id=0, linked=0, stream=7):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device, id=id,
                           linked_correlation_id=linked, device_resource_id=stream, is_user_annotation=False)


def _profile(side_start: float):
    """Two runs: each a preamble range (CPU), its flush linked to an op inside it, its spin linked to
    nothing, then a forward with one kernel on the caller's stream and one on a side stream."""
    events = []
    for run, t in enumerate((0.0, 1000.0)):
        rid, zid = 100 + 10 * run, 101 + 10 * run
        events += [_evt("preamble", t, t + 20, CPU, id=rid), _evt("aten::zero_", t + 5, t + 8, CPU, id=zid),
                   _evt("fill_kernel", t + 30, t + 90, linked=zid),
                   _evt("at::cuda::spin_kernel(long)", t + 91, t + 291),
                   _evt("gemm", t + 300, t + 400, linked=200 + run),
                   _evt("my_kernel", t + side_start, t + side_start + 50, linked=300 + run, stream=13)]
    events.append(_evt("spin_kernel_of_mine", 1100.0, 1120.0, stream=13))     # a name is no disguise
    return events


def test_a_side_stream_kernel_starting_during_the_preamble_ran_ahead_of_the_clock():
    spans, work = split_preamble(_profile(side_start=120.0))
    assert spans == [(30, 291), (1030, 1291)]
    assert sorted({e.name for e in work}) == ["gemm", "my_kernel", "spin_kernel_of_mine"]
    ahead = ahead_of_clock(spans, work)
    # most early first: the disguised one (started 191 us before its run's spin ended), then each run's
    assert [(w["name"], w["stream"], w["early_us"]) for w in ahead] == [
        ("spin_kernel_of_mine", 13, 191.0), ("my_kernel", 13, 171.0), ("my_kernel", 13, 171.0)]


def test_a_forked_side_stream_starts_after_the_preamble_and_is_no_evidence():
    spans, work = split_preamble(_profile(side_start=292.0))
    assert [w["name"] for w in ahead_of_clock(spans, work)] == ["spin_kernel_of_mine"]
    # the forward's kernels are the profile's rows; the preamble's flush and spin are not
    assert "fill_kernel" not in {e.name for e in work} and not any("spin_kernel(" in e.name for e in work)


def test_no_preamble_in_the_profile_checks_nothing():
    spans, work = split_preamble([_evt("gemm", 0, 10)])
    assert spans == [] and ahead_of_clock(spans, work) == []


# ------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
def test_profile_finds_a_joined_but_unforked_side_stream_and_passes_a_forked_one():
    from sandbox.profiling import profile_forward

    w = torch.randn(2048, 2048, device="cuda")

    class Unforked(torch.nn.Module):
        def __init__(self, fork: bool):
            super().__init__()
            self.side, self.fork = torch.cuda.Stream(), fork

        def forward(self, x):
            if self.fork:
                self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                y = x @ w
                for _ in range(3):
                    y = y @ w
            torch.cuda.current_stream().wait_stream(self.side)
            return y

    def make_args(i):
        return (torch.randn(2048, 2048, device="cuda"),)

    rows, ahead = profile_forward(Unforked(fork=False), make_args, "cuda", runs=3)
    assert ahead["runs_checked"] == 3, ahead
    assert ahead["work"] and ahead["work"][0]["early_us"] > 10, ahead
    rows, ahead = profile_forward(Unforked(fork=True), make_args, "cuda", runs=3)
    assert ahead["runs_checked"] == 3 and ahead["work"] == [], ahead
    assert rows and not any("spin_kernel" in r["name"] for r in rows), rows


def test_a_profile_holds_one_input_set_for_every_run_once_the_sets_are_large(monkeypatch):
    """Three sets while they are small (each run its own inputs); past PROFILE_SETS_BYTES together,
    one set for all three runs, as the timing keeps one set alive (three 8 GiB sets put a big
    level-1 task's reference past an 80 GB H100)."""
    from sandbox import profiling

    made: list[int] = []

    def make_args(seed: int):
        made.append(seed)
        return [torch.full((256,), float(seed)), 3]         # 1 KiB of tensor and a scalar

    small = profiling.input_sets(make_args, 3)
    assert made == [10_000, 10_001, 10_002] and [s[0][0].item() for s in small] == [10_000, 10_001, 10_002]
    made.clear()
    monkeypatch.setattr(profiling, "PROFILE_SETS_BYTES", 2 * 1024)     # three 1 KiB sets no longer fit
    large = profiling.input_sets(make_args, 3)
    assert made == [10_000] and all(s is large[0] for s in large)
    calls: list[float] = []
    rows, _ = profiling.profile_forward(lambda x, k: calls.append(x[0].item()) or x * k, make_args, "cpu")
    assert calls == [10_000.0] * 4 and rows                  # the warm run and three profiled, one set
