"""The openai backend with the real ``openai`` client against a real local HTTP server."""
from __future__ import annotations

import email.utils
import time

import pytest
from fakeserver import FakeOpenAI, fake_openai  # noqa: F401  (fixture)

from agent.backends.base import BackendError, get_backend
from agent.backends.openai_backend import OpenAIBackend, retry_after_seconds
from agent.parse import parse_answer
from agent.pricing import cost_usd, price_of
from agent.types import DeviceFacts, ProposalRequest
from sandbox.tasks import TaskSpec

MESSAGES = [{"role": "system", "content": "You write kernels."}, {"role": "user", "content": "Fuse add+relu."}]
CODE = "```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    pass\n```\n"


def backend(**options) -> OpenAIBackend:
    """Fast retries for tests; everything else from the environment the fixture set."""
    options.setdefault("backoff_initial_s", 0.02)
    options.setdefault("backoff_max_s", 0.1)
    return get_backend("openai:gpt-4o", **options)


def test_success_records_text_tokens_latency_cost_and_sends_the_request(fake_openai):
    fake_openai.reply("Plan.\n" + CODE, usage=(1200, 340), delay_s=0.2)
    b = backend(temperature=0.3, max_tokens=1000)
    assert b.name == "openai:gpt-4o" and b.default_critic == "llm"
    c = b.chat(MESSAGES, purpose="critique")
    assert c.error is None
    assert c.text == "Plan.\n" + CODE
    assert c.finish_reason == "stop"
    assert (c.prompt_tokens, c.completion_tokens) == (1200, 340)
    assert 0.2 <= c.latency_s < 5
    assert c.cost_usd == pytest.approx((1200 * 2.50 + 340 * 10.00) / 1e6)
    assert c.model == "openai:gpt-4o"

    (req,) = fake_openai.requests
    assert req.path == "/v1/chat/completions"
    assert req.body["model"] == "gpt-4o"
    assert req.body["messages"] == MESSAGES
    assert req.body["temperature"] == 0.3
    assert req.body["max_tokens"] == 1000
    assert req.headers["authorization"] == "Bearer sk-fake-test-key"


def test_complete_sends_the_request_messages(fake_openai):
    fake_openai.reply(CODE)
    task = TaskSpec(name="t/add", path="/t/add.py", source="class Model: ...\n")
    device = DeviceFacts(device="cpu", name="cpu", torch_version="2.13")
    req = ProposalRequest(task=task, device=device, round=0, samples=1, messages=MESSAGES,
                          template="propose_first", prompt_sha256="0" * 64)
    c = backend().complete(req, sample=0)
    assert parse_answer(c.text, c.finish_reason).status == "ok"
    assert fake_openai.requests[0].body["messages"] == MESSAGES


def test_temperature_unset_is_not_sent(fake_openai):
    fake_openai.reply("hi")
    backend(max_tokens=0).chat(MESSAGES)       # 0: not sent (None means "the default")
    body = fake_openai.requests[0].body
    assert "temperature" not in body and "max_tokens" not in body


def test_429_waits_what_retry_after_asks(fake_openai):
    fake_openai.rate_limited(retry_after="1").reply("after the wait")
    c = backend().chat(MESSAGES)
    assert c.error is None and c.text == "after the wait"
    first, second = fake_openai.requests
    assert first.status == 429 and second.status == 200
    gap = second.at - first.at
    assert 0.95 <= gap < 3.0          # the backoff alone would have waited ~0.02 s
    assert c.latency_s >= 0.95        # latency covers the whole call, retries included


def test_retry_after_ms_is_honoured(fake_openai):
    fake_openai.rate_limited(retry_after=None, retry_after_ms="400").reply("ok")
    c = backend().chat(MESSAGES)
    assert c.text == "ok"
    first, second = fake_openai.requests
    assert second.at - first.at >= 0.38


def test_retry_after_parsing():
    now = time.time()
    assert retry_after_seconds({"retry-after": "2"}) == 2.0
    assert retry_after_seconds({"retry-after": "0.5"}) == 0.5
    assert retry_after_seconds({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert 28 <= retry_after_seconds({"retry-after": date}, now=now) <= 31
    past = email.utils.formatdate(now - 30, usegmt=True)
    assert retry_after_seconds({"retry-after": past}, now=now) == 0.0
    assert retry_after_seconds({"retry-after": "soon"}) is None
    assert retry_after_seconds({}) is None


def test_long_retry_after_is_capped(fake_openai):
    fake_openai.rate_limited(retry_after="30").reply("ok")
    start = time.monotonic()
    c = backend(retry_after_max_s=0.2).chat(MESSAGES)
    assert c.text == "ok"
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("status", [500, 503])
def test_server_error_then_success(fake_openai, status):
    fake_openai.server_error(status).reply("recovered", usage=(5, 6))
    c = backend().chat(MESSAGES)
    assert c.error is None and c.text == "recovered"
    assert (c.prompt_tokens, c.completion_tokens) == (5, 6)
    assert [r.status for r in fake_openai.requests] == [status, 200]


def test_concurrency_bounds_requests_in_flight(fake_openai):
    from concurrent.futures import ThreadPoolExecutor

    for i in range(4):
        fake_openai.reply(f"answer {i}", delay_s=0.3)
    b = backend(concurrency=2)
    assert b.max_concurrency == 2
    with ThreadPoolExecutor(4) as pool:
        texts = sorted(c.text for c in pool.map(lambda _: b.chat(MESSAGES), range(4)))
    assert texts == [f"answer {i}" for i in range(4)]
    assert fake_openai.max_in_flight == 2


def test_timeout_then_success(fake_openai):
    fake_openai.slow(3.0).reply("in time")
    start = time.monotonic()
    c = backend(timeout_s=0.4).chat(MESSAGES)
    assert c.error is None and c.text == "in time"
    assert len(fake_openai.requests) == 2
    assert time.monotonic() - start < 2.5     # it gave up on the slow answer at the timeout


def test_malformed_json_is_retried(fake_openai):
    fake_openai.malformed().reply("good json")
    c = backend().chat(MESSAGES)
    assert c.error is None and c.text == "good json"
    assert len(fake_openai.requests) == 2


def test_transient_failures_past_the_retries_become_an_error_completion(fake_openai):
    fake_openai.server_error(500).malformed().server_error(503)
    c = backend(max_retries=2).chat(MESSAGES)
    assert c.text == ""
    assert "503" in c.error and "3 tries" in c.error
    assert len(fake_openai.requests) == 3
    assert fake_openai.remaining == 0


def test_401_fails_fast_naming_the_key_variable(fake_openai):
    fake_openai.unauthorized().reply("never served")
    with pytest.raises(BackendError) as err:
        backend().chat(MESSAGES)
    assert "OPENAI_API_KEY" in str(err.value)
    assert "401" in str(err.value)
    assert len(fake_openai.requests) == 1


def test_404_model_not_found_names_the_model_and_base_url(fake_openai):
    fake_openai.model_not_found("gpt-4o")
    with pytest.raises(BackendError) as err:
        backend().chat(MESSAGES)
    msg = str(err.value)
    assert "'gpt-4o' not found" in msg
    assert f"OPENAI_BASE_URL={fake_openai.url}" in msg
    assert len(fake_openai.requests) == 1


def test_quota_fails_fast(fake_openai):
    fake_openai.quota_exceeded().reply("never served")
    start = time.monotonic()
    with pytest.raises(BackendError) as err:
        # a retry would first wait 600 s: failing in well under that is failing without one,
        # whatever the machine's load (a 1 s limit failed on a busy 2-core machine)
        backend(backoff_initial_s=600, backoff_max_s=600).chat(MESSAGES)
    assert "quota" in str(err.value)
    assert "OPENAI_API_KEY" in str(err.value)
    assert len(fake_openai.requests) == 1
    assert time.monotonic() - start < 60


def test_bad_request_fails_fast_naming_the_options(fake_openai):
    fake_openai.bad_request("Unsupported value: 'temperature' does not support 0.3 with this model.")
    with pytest.raises(BackendError) as err:
        backend(temperature=0.3).chat(MESSAGES)
    assert "temperature=0.3" in str(err.value)
    assert len(fake_openai.requests) == 1


def test_max_completion_tokens_is_used_when_the_model_asks_for_it(fake_openai):
    fake_openai.bad_request("Unsupported parameter: 'max_tokens' is not supported with this model. "
                            "Use 'max_completion_tokens' instead.").reply("ok").reply("again")
    b = backend(max_tokens=900)
    assert b.chat(MESSAGES).text == "ok"
    assert b.chat(MESSAGES).text == "again"
    first, second, third = (r.body for r in fake_openai.requests)
    assert first["max_tokens"] == 900 and "max_completion_tokens" not in first
    assert second["max_completion_tokens"] == 900 and "max_tokens" not in second
    assert third["max_completion_tokens"] == 900


def test_context_too_long_is_an_error_completion_not_retried(fake_openai):
    fake_openai.bad_request("This model's maximum context length is 128000 tokens.", code="context_length_exceeded")
    c = backend().chat(MESSAGES)
    assert "too long" in c.error
    assert len(fake_openai.requests) == 1


def test_truncated_code_parses_as_truncated(fake_openai):
    fake_openai.truncated("Plan.\n```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x.")
    c = backend().chat(MESSAGES)
    assert c.finish_reason == "length"
    assert c.completion_tokens == 4096
    assert parse_answer(c.text, c.finish_reason).status == "truncated"


def test_missing_key_fails_at_construction(fake_openai, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(BackendError) as err:
        get_backend("openai:gpt-4o")
    assert "OPENAI_API_KEY" in str(err.value)
    assert fake_openai.requests == []


def test_missing_model_name_fails():
    with pytest.raises(BackendError):
        get_backend("openai:", api_key="k", config={})


def test_config_file_supplies_key_url_and_settings(fake_openai, monkeypatch, tmp_path):
    monkeypatch.delenv("OPENAI_API_KEY")
    monkeypatch.delenv("OPENAI_BASE_URL")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[openai]\napi_key = "sk-from-file"\nbase_url = "{fake_openai.url}"\n'
                   'temperature = 0.1\nconcurrency = 7\n\n[pricing]\n"gpt-4o" = { input = 1.0, output = 2.0 }\n')
    monkeypatch.setenv("KERNELLOOP_CONFIG", str(cfg))
    fake_openai.reply("ok", usage=(1000, 1000))
    b = backend()
    assert b.max_concurrency == 7
    c = b.chat(MESSAGES)
    assert c.cost_usd == pytest.approx(0.003)
    req = fake_openai.requests[0]
    assert req.headers["authorization"] == "Bearer sk-from-file"
    assert req.body["temperature"] == 0.1


def test_environment_beats_config_file_and_options_beat_both(fake_openai, monkeypatch, tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('[openai]\napi_key = "sk-from-file"\nbase_url = "http://127.0.0.1:9/v1"\n')
    monkeypatch.setenv("KERNELLOOP_CONFIG", str(cfg))
    fake_openai.reply("a").reply("b")
    backend().chat(MESSAGES)
    assert fake_openai.requests[0].headers["authorization"] == "Bearer sk-fake-test-key"
    backend(api_key="sk-option").chat(MESSAGES)
    assert fake_openai.requests[1].headers["authorization"] == "Bearer sk-option"


def test_bad_config_is_a_backend_error(fake_openai, monkeypatch, tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("[openai]\ntemprature = 0.2\n")
    monkeypatch.setenv("KERNELLOOP_CONFIG", str(cfg))
    with pytest.raises(BackendError, match="temprature"):
        backend()
    cfg.write_text("[openai\n")
    with pytest.raises(BackendError, match="cannot be read"):
        backend()


def test_unreachable_endpoint_is_an_error_completion_naming_the_base_url(monkeypatch, tmp_path):
    with FakeOpenAI() as server:
        url = server.url               # a port that was free a moment ago and is closed now
    monkeypatch.setenv("KERNELLOOP_CONFIG", str(tmp_path / "none.toml"))
    b = OpenAIBackend("gpt-4o", api_key="k", base_url=url, max_retries=1, backoff_initial_s=0.01, timeout_s=2)
    c = b.chat(MESSAGES)
    assert f"OPENAI_BASE_URL={url}" in c.error


def test_pricing_table():
    assert price_of("gpt-4o-2024-08-06") == price_of("gpt-4o")
    assert price_of("gpt-4o-mini-2024-07-18") == price_of("gpt-4o-mini") != price_of("gpt-4o")
    assert price_of("openai/gpt-4.1") == price_of("gpt-4.1")
    assert price_of("my-local-llama") is None
    assert cost_usd("my-local-llama", 10, 10) is None
    assert cost_usd("gpt-4o", None, 10) is None
    assert cost_usd("my-local-llama", 1_000_000, 0, extra={"my-local-llama": (0.5, 1.0)}) == 0.5
