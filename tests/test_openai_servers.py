"""The openai backend against what real servers do: their overflow refusals, their windows
and slots, silent prompt truncation, stalled streams, reasoning apart from the answer."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fakeserver import FakeOpenAI, Scripted, fake_openai  # noqa: F401  (fixture)

from agent.backends.base import get_backend
from agent.backends.errors import parse_overflow
from agent.fitting import PromptTooLarge, fit, Fitted

MESSAGES = [{"role": "system", "content": "You write kernels."}, {"role": "user", "content": "Fuse add+relu."}]


def backend(**options):
    options.setdefault("backoff_initial_s", 0.02)
    options.setdefault("backoff_max_s", 0.1)
    return get_backend("openai:tiny", **options)


# ---------------------------------------------------------------- overflow refusals

@pytest.mark.parametrize("server", ["openai", "llamacpp", "sglang_input"])
def test_prompt_overflow_is_this_calls_error_and_teaches_the_window(fake_openai, server):
    {"openai": lambda: fake_openai.overflow_openai(2048, 2103),
     "llamacpp": lambda: fake_openai.overflow_llamacpp(2048, 2103),
     "sglang_input": lambda: fake_openai.overflow_sglang(2048, 2103)}[server]()
    fake_openai.reply("never asked")
    b = backend()
    c = b.chat(MESSAGES)
    assert c.overflow and "too long" in c.error and "2048" in c.error
    assert len(fake_openai.requests) == 1            # not retried unchanged
    assert b.window().tokens == 2048 and b.window().source == "overflow error"
    assert b.prompt_budget().window == 2048           # the loop fits the next prompt to it


@pytest.mark.parametrize("server", ["vllm", "sglang_total"])
def test_answer_share_overflow_is_asked_again_with_max_tokens_lowered(fake_openai, server):
    if server == "vllm":
        fake_openai.overflow_vllm(4096, 300, 8192)
    else:
        fake_openai.overflow_sglang(4096, 300, 8192)
    fake_openai.reply("fits now", usage=(300, 40))
    c = backend().chat(MESSAGES)
    assert c.error is None and c.text == "fits now"
    first, second = fake_openai.requests
    assert first.body["max_tokens"] == 8192
    assert second.body["max_tokens"] == 4096 - 300 - 16
    assert c.context["window"] == 4096 and c.context["max_tokens_sent"] == second.body["max_tokens"]


def test_overflow_parsing_of_each_servers_body():
    o = parse_overflow(400, {"type": "exceed_context_size_error", "n_prompt_tokens": 9031, "n_ctx": 8192},
                       "request (9031 tokens) exceeds the available context size (8192 tokens), try increasing it")
    assert (o.window, o.prompt_tokens) == (8192, 9031)
    o = parse_overflow(400, {"code": "context_length_exceeded"}, "This model's maximum context length is 128000 "
                       "tokens. However, your messages resulted in 130001 tokens.")
    assert (o.window, o.prompt_tokens) == (128000, 130001)
    o = parse_overflow(400, {}, "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
                       "context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778).")
    assert (o.window, o.prompt_tokens, o.completion_tokens) == (4096, 2778, 8000)
    assert parse_overflow(400, {}, "Unsupported value: 'temperature'") is None
    assert parse_overflow(500, {}, "maximum context length is 5") is None


def test_other_bad_request_fails_the_call_not_the_run(fake_openai):
    fake_openai.bad_request("prompt contains a forbidden sequence").reply("next one works")
    b = backend()
    first = b.chat(MESSAGES)
    assert first.error and "forbidden" in first.error
    assert b.chat(MESSAGES).text == "next one works"


# ---------------------------------------------------------------- windows and slots from the server

def test_llamacpp_props_give_window_slots_and_lowered_max_tokens(fake_openai):
    fake_openai.props = {"default_generation_settings": {"n_ctx": 4096}, "total_slots": 2}
    fake_openai.tokenize = "llama.cpp"
    for i in range(4):
        fake_openai.reply(f"answer {i}", delay_s=0.3)
    b = backend(max_tokens=8192, concurrency=4)
    assert b.window().tokens == 4096 and b.window().source == "llama.cpp /props"
    assert b.max_concurrency == 2
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda _: b.chat(MESSAGES), range(4)))
    assert all(c.error is None for c in done)
    assert fake_openai.max_in_flight == 2            # never more than the server's slots
    prompt, how = b.count_prompt(MESSAGES)
    assert how == "llama.cpp /tokenize"
    assert {r.body["max_tokens"] for r in fake_openai.requests} == {4096 - prompt - 16}


def test_vllm_models_give_the_window(fake_openai):
    fake_openai.models = [{"id": "tiny", "object": "model", "max_model_len": 2048}]
    fake_openai.tokenize = "vllm"
    b = backend(max_tokens=1024)
    w = b.window()
    assert (w.tokens, w.source) == (2048, "/v1/models max_model_len")
    budget = b.prompt_budget()
    assert budget.preferred == 2048 - 1024 - 16 and budget.hard == 2048 - 256 - 16
    assert b.count_prompt(MESSAGES)[1] == "vllm /tokenize"


def test_context_tokens_option_wins_and_too_large_prompt_names_sizes(fake_openai):
    fake_openai.props = {"default_generation_settings": {"n_ctx": 65536}, "total_slots": 1}
    b = backend(context_tokens=300)
    assert b.window().tokens == 300 and b.window().source == "context_tokens"
    big = [{"role": "user", "content": "x" * 3000}]
    c = b.chat(big)
    assert c.overflow and "300" in c.error and "min_answer_tokens" in c.error
    assert fake_openai.requests == []                # not sent at all


def test_silent_truncation_is_flagged(fake_openai):
    fake_openai.silently_truncating("ok", kept_prompt_tokens=100)
    long = [{"role": "user", "content": "y" * 9000}]     # about 3000 tokens by any count
    c = backend().chat(long)
    assert c.error is None and c.prompt_truncated
    fake_openai.reply("ok", usage=(2500, 10))
    assert not backend().chat(long).prompt_truncated


# ---------------------------------------------------------------- streams

def test_stalled_stream_keeps_the_partial_answer_and_is_not_retried(fake_openai):
    fake_openai.stalling("Plan.\n```python\nimport torch\nclass ModelNew", after_chunks=4, stall_s=5.0)
    fake_openai.reply("a second try must not happen")
    start = time.monotonic()
    c = backend(stall_timeout_s=0.5).chat(MESSAGES)
    assert time.monotonic() - start < 3.0
    assert c.error is None and c.text.startswith("Plan.\n```py")
    assert c.finish_reason == "length" and c.finish_cause == "stall"
    assert len(fake_openai.requests) == 1


def test_call_budget_keeps_the_partial_answer(fake_openai):
    fake_openai.push(Scripted(text="x" * 400, chunk_chars=10, chunk_delay_s=0.05))
    c = backend(call_budget_s=0.6).chat(MESSAGES)
    assert c.finish_cause == "time_budget" and 0 < len(c.text) < 400
    assert len(fake_openai.requests) == 1


def test_no_first_token_in_time_is_retried(fake_openai):
    fake_openai.slow(3.0).reply("in time")
    c = backend(first_token_timeout_s=0.4).chat(MESSAGES)
    assert c.text == "in time" and len(fake_openai.requests) == 2


def test_finish_cause_says_which_limit(fake_openai):
    fake_openai.props = {"default_generation_settings": {"n_ctx": 1000}, "total_slots": 1}
    fake_openai.push(Scripted(text="cut", finish_reason="length", usage=(900, 84)))
    b = backend(max_tokens=50)
    assert b.chat(MESSAGES).finish_cause == "max_tokens"
    fake_openai.push(Scripted(text="cut", finish_reason="length", usage=(990, 9)))
    assert backend(max_tokens=0).chat(MESSAGES).finish_cause == "window"
    fake_openai.reply("done")
    assert b.chat(MESSAGES).finish_cause == "stop"


# ---------------------------------------------------------------- reasoning

@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_is_kept_apart_and_effort_passes_through(fake_openai, field):
    fake_openai.push(Scripted(text="```python\nx = 1\n```", reasoning="First, think about tiles.",
                              reasoning_field=field, reasoning_tokens=7))
    c = backend(reasoning_effort="high").chat(MESSAGES)
    assert c.text == "```python\nx = 1\n```"
    assert c.reasoning == "First, think about tiles." and c.reasoning_tokens == 7
    assert fake_openai.requests[0].body["reasoning_effort"] == "high"


def test_think_tags_are_split_off(fake_openai):
    fake_openai.reply("<think>tiles of 32</think>\nThe answer.")
    c = backend(stream=False).chat(MESSAGES)
    assert c.text.strip() == "The answer." and c.reasoning == "tiles of 32"
    assert "stream" not in fake_openai.requests[0].body


# ---------------------------------------------------------------- a server that never streams

def test_a_server_that_never_streams_is_read_then_asked_without_streaming(fake_openai, capsys):
    """A 200 to a streamed request carrying a whole JSON completion (no events) is that
    completion, not an empty stream to retry; the backend then stops asking to stream, says so
    once, keeps the words for the run, and marks each call so asked."""
    fake_openai.streams = False
    fake_openai.push(Scripted(text="```python\nx = 1\n```", reasoning="tiles first", usage=(40, 9)))
    fake_openai.reply("<think>tiles of 32</think>\nsecond", usage=(41, 3)).reply("third")
    b = backend()
    assert b.stream is True
    first = b.chat(MESSAGES)
    second, third = b.chat(MESSAGES), b.chat(MESSAGES)
    assert first.error is None and first.text == "```python\nx = 1\n```" and first.reasoning == "tiles first"
    assert (first.prompt_tokens, first.completion_tokens, first.finish_cause) == (40, 9, "stop")
    assert second.text.strip() == "second" and second.reasoning == "tiles of 32" and third.text == "third"
    assert len(fake_openai.requests) == 3                            # nothing asked twice
    bodies = [r.body for r in fake_openai.requests]
    assert bodies[0]["stream"] is True and all("stream" not in body for body in bodies[1:])
    assert b.stream is False and b.stream_off and "does not stream" in b.stream_off
    assert "stream = false" in b.stream_off and b.run_notes == [b.stream_off]
    assert capsys.readouterr().err.count("does not stream") == 1
    assert [c.context.get("stream") for c in (first, second, third)] == ["off"] * 3


def test_a_streaming_server_is_still_streamed(fake_openai):
    fake_openai.reply("one").reply("two")
    b = backend()
    assert b.chat(MESSAGES).text == "one" and b.chat(MESSAGES).text == "two"
    assert all(r.body["stream"] is True for r in fake_openai.requests)
    assert b.stream is True and b.stream_off is None and b.run_notes == []


# ---------------------------------------------------------------- fitting

class _Budget:
    window, window_source, preferred, hard, min_answer_tokens = 1000, "test", 500, 800, 100


def _variant(tokens: int, left: list[str]):
    return lambda: Fitted(value=tokens, messages=[{"role": "user", "content": "x" * tokens}], left_out=left)


def test_fit_takes_the_fullest_variant_that_fits_else_the_barest_within_hard():
    count = lambda m: (len(m[0]["content"]), "len")   # noqa: E731
    assert fit([_variant(900, []), _variant(450, ["a"]), _variant(10, ["a", "b"])], _Budget(), count).value == 450
    assert fit([_variant(900, []), _variant(700, ["a"])], _Budget(), count).left_out == ["a"]
    with pytest.raises(PromptTooLarge) as err:
        fit([_variant(900, []), _variant(850, ["a"])], _Budget(), count)
    assert "850 tokens" in str(err.value) and "1000-token window" in str(err.value)


def test_logs_db_given_to_the_group_holds_for_show(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kernelloop.cli import app
    from store import Store
    from store.models import ModelCall

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KERNELLOOP_DB", raising=False)
    db = tmp_path / "elsewhere.db"
    store = Store(db)
    with store.session() as s:
        s.add(ModelCall(purpose="propose", model="openai:tiny", template="propose_first", prompt_sha256="0" * 64,
                        messages=[{"role": "user", "content": "hi"}], response_text="answer text",
                        reasoning="thought it through", finish_cause="max_tokens",
                        context={"window": 2048, "window_source": "llama.cpp /props", "left_out": ["the analysis"]}))
    store.close()
    result = CliRunner().invoke(app, ["logs", "--db", str(db), "show", "1"])
    assert result.exit_code == 0, result.output
    assert "thought it through" in result.output and "answer text" in result.output
    assert "ended by max_tokens" in result.output and "the analysis" in result.output
    assert not (tmp_path / "kernelloop.db").exists()
