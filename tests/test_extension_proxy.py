"""The build hook's proxy around a candidate's extension (sandbox.build.ExtensionProxy): every
call counted; a profiler label only while a profiler records (the label cost ~6 us a call on
the clock, a level-3 network calls its extension a hundred times a forward)."""
from __future__ import annotations

import types

import torch

from sandbox.build import CallCounter, ExtensionProxy


def _proxy():
    module = types.SimpleNamespace(scale=lambda x: x * 2)
    counter = CallCounter()
    return ExtensionProxy(module, "ext", counter), counter


def test_calls_are_counted_and_labelled_only_under_a_profiler():
    ext, counter = _proxy()
    x = torch.ones(4)
    assert torch.equal(ext.scale(x), x * 2)
    assert counter.calls == 1 and counter.by_function == {"scale": 1}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ext.scale(x)
    names = [e.name for e in prof.events()]
    assert "kernelloop_ext::scale" in names
    assert counter.calls == 2


def test_an_unprofiled_call_records_no_range(monkeypatch):
    ext, _ = _proxy()
    entered = []
    monkeypatch.setattr("sandbox.build._record_function", lambda label: entered.append(label))
    ext.scale(torch.ones(2))
    assert entered == []
