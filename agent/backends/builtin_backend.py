"""``--model builtin``: the offline fusion generator as a model backend.

Its answers look like a model's: one sentence, then the generated module in a ```python
block, so they go through the same parsing, storage and evaluation as any other model's.
"""
from __future__ import annotations

import time
from typing import Any

from agent.backends.base import register
from agent.types import Completion, ProposalRequest


class BuiltinBackend:
    name = "builtin"
    default_critic = "grounded"
    max_concurrency = 4

    def __init__(self, **options: Any):
        self.options = dict(options)

    def complete(self, request: ProposalRequest, sample: int) -> Completion:
        from agent.builtin import propose

        t0 = time.perf_counter()
        device = request.device.device
        try:
            cand = propose(request.task, device, request.round, sample, list(request.history or []),
                           numerics=request.numerics, backend=request.kernel_backend)
        except Exception as exc:  # noqa: BLE001 - reported as a failed completion
            return Completion(text="", model="builtin", finish_reason="error",
                              latency_s=time.perf_counter() - t0,
                              error=f"builtin generator failed: {type(exc).__name__}: {exc}")
        text = f"{_sentence(cand, 'triton' if request.kernel_backend == 'triton' else device)}\n\n```python\n{cand.source.rstrip()}\n```\n"
        return Completion(text=text, model="builtin", finish_reason="stop", prompt_tokens=None,
                          completion_tokens=None, latency_s=time.perf_counter() - t0)


def _sentence(cand, device: str) -> str:
    groups = cand.choices.get("groups") or []
    target = {"cuda": "CUDA", "triton": "Triton"}.get(device, "C++/OpenMP")
    if cand.choices.get("fallback") == "untraceable":
        return "The reference could not be traced with torch.fx, so this candidate keeps its computation on PyTorch."
    if cand.choices.get("fallback") == "generator_error":
        return ("The builtin generator failed on this reference "
                f"({cand.choices.get('reason', '')}), so this candidate keeps its computation on PyTorch.")
    tc = cand.choices.get("tc3") or []
    gemms = f"running the GEMM(s) {', '.join(tc)} as split-TF32 tensor-core GEMMs with K-chunked accumulation"
    if not groups:
        if tc:
            return f"No operator of this model can be fused, so this candidate is {gemms}."
        return "No operator of this model can be fused, so this candidate keeps the library operators on PyTorch."
    chains = "; ".join(" -> ".join(g["ops"]) for g in groups)
    knobs = cand.choices.get("knobs") or {}
    knob_text = ", ".join(f"{k}={v}" for k, v in sorted(knobs.items()))
    keeping = f"{gemms} and keeping the other library operators on PyTorch" if tc else \
        "keeping library operators on PyTorch"
    return f"This candidate fuses {len(groups)} group(s) into generated {target} kernels ({chains}), {keeping} ({knob_text})."


@register("builtin")
def make_builtin_backend(arg: str = "", **options: Any) -> BuiltinBackend:
    return BuiltinBackend(**options)
