"""``scripts/kb_harness.py``'s CPU side: the reason it prints where KernelBench's harness refuses a candidate."""
from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import kb_harness  # noqa: E402


def test_kernelbenchs_refusal_is_named_from_its_metadata():
    """Session af: level2/14's best (split-TF32 GEMM, correct by the float64 rule) was refused with
    no reason recorded; the row now says why (KernelBench's mismatch figures or its error)."""
    mismatch = types.SimpleNamespace(correctness=False, metadata={
        "correctness_issue": "Output mismatch", "max_difference": ["0.031250"], "avg_difference": ["0.002197"]})
    why = kb_harness._kb_why(mismatch)
    assert why == "correctness_issue: Output mismatch; max_difference: ['0.031250']; avg_difference: ['0.002197']"
    crashed = types.SimpleNamespace(correctness=False, metadata={"runtime_error": RuntimeError("x" * 1000)})
    assert kb_harness._kb_why(crashed).startswith("runtime_error: xxx") and len(kb_harness._kb_why(crashed)) == 300
    assert kb_harness._kb_why(types.SimpleNamespace(correctness=False, metadata={})) == "no reason in its metadata"
