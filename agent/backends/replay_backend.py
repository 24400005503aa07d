"""``replay:<run_id>``: the completions an earlier run stored, served again without a network.

For a request (task, round) and a sample, the backend finds the attempt of run
``<run_id>`` with the same task (matched by the task source's sha256), round and sample,
and serves the ``response_text`` of the ``propose`` model call that produced it. A
stored call that had failed is served as the same failure. Where nothing matches, the
answer is ``Completion(error="no stored completion for ...")``; the loop records it like
any failed call. Replayed calls cost nothing: ``cost_usd`` is 0 and ``latency_s`` is the
lookup's own time; the stored token counts are kept (they describe the text).
"""
from __future__ import annotations

import time
from typing import Any, Optional

import sqlalchemy as sa

from agent.backends.base import BackendError, register
from agent.types import Completion, ProposalRequest


@register("replay")
class ReplayBackend:
    default_critic = "grounded"

    def __init__(self, run_id: str | int, *, store: Any = None, db: Optional[str] = None,
                 concurrency: int = 4, **_ignored: Any):
        """``store``: an open ``store.Store`` (or ``db``: a store to open). ``**_ignored``: options
        meant for other backends (temperature...) are accepted and unused."""
        try:
            self.run_id = int(run_id)
        except (TypeError, ValueError):
            raise BackendError(f"replay backend needs a run id: --model replay:<run id>, not replay:{run_id}") from None
        if store is None:
            if db is None:
                raise BackendError(f"replay:{self.run_id} needs the store that holds run {self.run_id} "
                                   "(pass store= or db=)")
            from store import Store, StoreError
            try:
                store = Store(db)
            except StoreError as exc:
                raise BackendError(str(exc)) from None
        self.store = store
        self.name = f"replay:{self.run_id}"
        self.max_concurrency = max(1, int(concurrency))
        from store.models import Run
        with store.reader() as session:
            if session.get(Run, self.run_id) is None:
                raise BackendError(f"replay:{self.run_id}: no run {self.run_id} in the store {store.url}")

    def complete(self, request: ProposalRequest, sample: int) -> Completion:
        from store.models import Attempt, ModelCall, Task

        start = time.monotonic()
        what = (f"run {self.run_id}, task {request.task.name} (sha256 {request.task.sha256[:12]}), "
                f"round {request.round}, sample {sample}")
        with self.store.reader() as session:
            call = session.scalar(
                sa.select(ModelCall)
                .join(Attempt, Attempt.model_call_id == ModelCall.id)
                .join(Task, Task.id == Attempt.task_id)
                .where(Attempt.run_id == self.run_id, Task.sha256 == request.task.sha256,
                       Attempt.round == request.round, Attempt.sample == sample,
                       ModelCall.purpose == "propose")
                .limit(1))
            if call is None:
                return Completion(text="", model=self.name, error=f"no stored completion for {what}",
                                  latency_s=time.monotonic() - start, cost_usd=0.0)
            return Completion(text=call.response_text or "", model=self.name, finish_reason=call.finish_reason,
                              prompt_tokens=call.prompt_tokens, completion_tokens=call.completion_tokens,
                              latency_s=time.monotonic() - start, cost_usd=0.0,
                              error=(f"stored call {call.id} had failed: {call.error}" if call.error else None))

    def chat(self, messages: list[dict[str, str]], purpose: str = "critique") -> Completion:
        """A replay serves stored proposals only; any other call is answered with an error."""
        return Completion(text="", model=self.name, cost_usd=0.0,
                          error=f"{self.name} serves stored proposals only, not {purpose} calls "
                                "(use the grounded critic)")
