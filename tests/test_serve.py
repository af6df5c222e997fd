"""The HTTP server on a mock engine: response shapes, streaming format, every kind of bad
input answered with its status and an OpenAI error object, API keys, metrics."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from nsd.api import GenerationConfig
from nsd.cli import main
from nsd.serve import ServerConfig
from serve_support import mock_engine, running_server, sse_events

DEFAULTS = GenerationConfig(method="nsd", max_new_tokens=12, k=3)


@pytest.fixture(scope="module")
def server():
    engine = mock_engine(n_ctx=128)
    with running_server(engine, ServerConfig(model_name="mock", defaults=DEFAULTS)) as (url, app):
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client, engine


def _completion(client, **body):
    return client.post("/v1/completions", json={"model": "mock", "prompt": "abcabc", **body})


def test_completion_matches_the_library_and_reports_stats(server) -> None:
    client, engine = server
    r = _completion(client, max_tokens=10, seed=3)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "mock"
    expected = engine.generate("abcabc", GenerationConfig(**{**DEFAULTS.__dict__, "max_new_tokens": 10,
                                                              "seed": 3}))
    choice = body["choices"][0]
    assert choice["text"] == expected.text and choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 10 == usage["nsd"]["new_tokens"]
    assert usage["prompt_tokens"] == 6 and usage["total_tokens"] == 16
    for key in ("method", "tau", "acceptance_rate", "acceptance_by_position", "relaxed_accepts",
                "deviation", "deviation_per_token", "wall_s", "prefill_s"):
        assert key in usage["nsd"]
    assert usage["nsd"]["method"] == "nsd"
    assert usage["nsd"]["accepted_per_pass"] == expected.stats.accepted_per_pass


def test_chat_uses_the_template_with_all_roles(server) -> None:
    client, engine = server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    r = client.post("/v1/chat/completions", json={"model": "mock", "messages": messages,
                                                  "max_completion_tokens": 8})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else "more"} for m in messages]
    ids = engine.encode(flat)
    expected = engine.generate(ids, GenerationConfig(**{**DEFAULTS.__dict__, "max_new_tokens": 8}))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    assert body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("path, prompt", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "  "}]}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": ""},
                                           {"role": "user", "content": ""}]}),
    ("/v1/completions", {"prompt": "   "}),
])
def test_a_prompt_is_empty_only_without_tokens(server, path, prompt) -> None:
    # Empty messages still render the chat template's tokens, and whitespace is tokens: the
    # model has something to continue, as with a system message beside them.
    client, engine = server
    r = client.post(path, json={"model": "mock", "max_tokens": 3, **prompt})
    assert r.status_code == 200, r.text
    expected = engine.encode(prompt.get("messages") or prompt.get("prompt"))
    assert r.json()["usage"]["prompt_tokens"] == len(expected) > 0


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_chunks_and_done(server, chat: bool) -> None:
    client, _ = server
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "mock", "max_tokens": 12, "temperature": 0.8, "seed": 11}
    body.update({"messages": [{"role": "user", "content": "abcab"}]} if chat else {"prompt": "abcab"})
    whole = client.post(path, json=body).json()
    with client.stream("POST", path, json={**body, "stream": True,
                                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    # The same prompt again: its cached part differs (the live cache holds it now).
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        **whole["usage"], "nsd": {**usage_chunk["usage"]["nsd"]},
        "prompt_tokens_details": usage_chunk["usage"]["prompt_tokens_details"]}
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        usage_chunk["usage"]["prompt_tokens"] - 1
    assert usage_chunk["usage"]["nsd"]["new_tokens"] == whole["usage"]["nsd"]["new_tokens"]
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_stream_without_usage_has_none(server) -> None:
    client, _ = server
    with client.stream("POST", "/v1/completions", json={"model": "mock", "prompt": "ab",
                                                         "max_tokens": 4, "stream": True}) as r:
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]" and all(e["usage"] is None for e in events[:-1])


def test_stop_string_and_nsd_knobs(server) -> None:
    client, _ = server
    text = _completion(client, max_tokens=12).json()["choices"][0]["text"]
    stop = text[4:6]
    r = _completion(client, max_tokens=12, stop=[stop, "zz"])
    assert r.json()["choices"][0]["text"] == text[:text.find(stop)]
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    for method in ("ar", "sd", "typical"):
        stats = _completion(client, max_tokens=6, nsd={"method": method}).json()["usage"]["nsd"]
        assert stats["method"] == method
    stats = _completion(client, max_tokens=6, nsd={"theta": 0.0}).json()["usage"]["nsd"]
    # θ = 0 is exactly SD: reported as asked, with what ran beside it
    assert stats["method"] == "nsd" and stats["effective_method"] == "sd"
    assert stats["theta"] == 0.0 and stats["deviation"] == 0.0
    stats = _completion(client, max_tokens=12, nsd={"budget": 0.5, "k": 2}).json()["usage"]["nsd"]
    assert stats["deviation"] <= 0.5


def test_budget_zero_is_reported_as_the_method_asked_for(server) -> None:
    client, _ = server
    body = {"model": "mock", "prompt": "abcabc", "max_tokens": 6, "nsd": {"budget": 0}}
    stats = client.post("/v1/completions", json=body).json()["usage"]["nsd"]
    # nsd with budget 0 never relaxes, so it decodes as SD: both are said, and the budget.
    assert stats["method"] == "nsd" and stats["effective_method"] == "sd"
    assert stats["budget"] == 0.0 and stats["cap"] is None and stats["deviation"] == 0.0
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
        streamed = sse_events(r.read().decode())[-2]["usage"]["nsd"]
    assert {k: streamed[k] for k in ("method", "effective_method", "budget")} == {
        "method": "nsd", "effective_method": "sd", "budget": 0.0}
    plain = client.post("/v1/completions", json={**body, "nsd": {"method": "sd"}}).json()
    assert plain["usage"]["nsd"]["method"] == "sd" and "budget" not in plain["usage"]["nsd"]
    metrics = client.get("/metrics").text
    assert 'nsd_completion_tokens_total{method="nsd"}' in metrics


def test_k_auto_is_passed_to_the_library(server) -> None:
    client, _ = server
    r = _completion(client, max_tokens=6, nsd={"k": "auto", "k_max": 3})
    assert r.status_code == 200
    stats = r.json()["usage"]["nsd"]
    assert stats["new_tokens"] == 6 and all(k <= 3 for k in stats["k_per_pass"])


def test_draft_context_is_passed_to_the_library(server) -> None:
    client, _ = server
    card = client.get("/v1/models").json()["data"][0]
    assert card["nsd"]["defaults"]["draft_context"] == 0
    # This server drafts by prompt lookup alone, which reads no draft context: refused.
    r = _completion(client, max_tokens=6, nsd={"method": "sd", "draft_context": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "nsd.draft_context"
    assert "does nothing on this server: it drafts with the ngram proposer" in r.json()["error"]["message"]
    # With a draft model the request's value is the generation's.
    from nsd.api import GenerationConfig
    from nsd.serve.protocol import CompletionRequest, generation_config

    request = CompletionRequest.model_validate({"model": "mock", "prompt": "ab",
                                                "nsd": {"method": "sd", "draft_context": 7}})
    for proposer in ("draft", "hybrid", None):
        assert generation_config(request, GenerationConfig(), 4, proposer=proposer).draft_context == 7


BAD = [
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", {"prompt": "ab"}, 400, "model", "missing_field"),
    ("/v1/completions", {"model": "mock"}, 400, "prompt", "missing_field"),
    ("/v1/chat/completions", {"model": "mock"}, 400, "messages", "missing_field"),
    ("/v1/chat/completions", {"model": "mock", "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "tool", "content": "x"}]},
     400, "messages[0].role", None),
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": 5}]},
     400, "messages[0].content", None),
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "x", "foo": 1}]},
     400, "messages[0].foo", None),
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "x"},
                                                            {"role": "user", "content": "y", "nme": "b"}]},
     400, "messages[1].nme", None),
    # The mock's chat template shows no names: a name would be dropped unseen.
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "x", "name": "bob"}]},
     400, "messages[0].name", None),
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "x", "name": 5}]},
     400, "messages[0].name", None),
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "assistant", "content": "x",
                                                             "refusal": "no"}]},
     400, "messages[0].refusal", None),
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "x"}],
                              "stream": True, "stream_options": {"include_usage": True, "foo": 1}},
     400, "stream_options.foo", None),
    ("/v1/chat/completions", {"model": "mock", "messages": "hi"}, 400, "messages", None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "ab"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": 7, "prompt": "ab"}, 400, "model", None),
    ("/v1/completions", {"model": "mock", "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": "mock", "prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {"model": "mock", "prompt": ["a", "b"]}, 400, "prompt", None),
    ("/v1/completions", {"model": "mock", "prompt": [1, 99]}, 400, "prompt", None),
    ("/v1/completions", {"model": "mock", "prompt": "a" * 200}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "max_tokens": 127}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "max_tokens": -3}, 400, "max_tokens", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "max_tokens": 2.5}, 400, "max_tokens", None),
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "stop": 5}, 400, "stop", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "seed": "x"}, 400, "seed", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "n": 2}, 400, "n", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "n": 0}, 400, "n", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"theta": 1.5}}, 400, "nsd.theta", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"theta": -0.1}}, 400, "nsd.theta", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"budget": -1}}, 400, "nsd.budget", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"k": 0}}, 400, "nsd.k", None),
    # A knob the request's method does not use is refused, not ignored.
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"method": "sd", "theta": 0.5}}, 400,
     "nsd.theta", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"method": "ar", "k": 4}}, 400,
     "nsd.k", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"method": "nsd", "typical_delta": 0.2}},
     400, "nsd.typical_delta", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"k": "fast"}}, 400, "nsd.k", None),
    # k_max bounds k auto and adaptive_k; with a fixed k it would change nothing.
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"k": 4, "k_max": 4}}, 400,
     "nsd.k_max", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"k_max": 0}}, 400, "nsd.k_max", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"draft_context": -5}}, 400,
     "nsd.draft_context", None),
    # Past the option's range (64), and past the k_max whose step costs the batched server
    # measured (8): both named before queueing.
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"k": "auto", "k_max": 1000}}, 400,
     "nsd.k_max", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"k": "auto", "k_max": 9}}, 400,
     "nsd.k_max", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "stream": True,
                         "nsd": {"k": "auto", "k_max": 9}}, 400, "nsd.k_max", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"k": 6, "adaptive_k": True,
                                                                  "k_max": 3}}, 400, "nsd.k_max", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"method": "greedy"}}, 400,
     "nsd.method", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": {"thta": 0.5}}, 400, "nsd.thta", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "nsd": "fast"}, 400, "nsd", None),
    ("/v1/completions", {"model": "mock", "prompt": "ab", "min_p": 2}, 400, "min_p", None),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD)
def test_bad_input_gets_an_error_object(server, path, body, status, param, code) -> None:
    client, _ = server
    r = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    if code is not None:
        assert error["code"] == code
    if param:
        assert param.split("[")[0].split(".")[-1] in error["message"]
    assert "Traceback" not in r.text
    assert client.get("/health").json()["status"] == "ok"  # still serving


def test_oversized_body_and_unknown_routes(server) -> None:
    client, _ = server
    r = client.post("/v1/completions", content=b" " * (5 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_models_health_metrics(server) -> None:
    client, _ = server
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["mock"]
    assert client.get("/health").json() == {"status": "ok", "model": "mock", "busy": False,
                                            "running": 0, "parallel": 4, "queue_depth": 0}
    _completion(client, max_tokens=5)
    text = client.get("/metrics").text
    for name in ("nsd_requests_total", "nsd_completion_tokens_total", "nsd_prompt_tokens_total",
                 "nsd_time_to_first_token_seconds_bucket", "nsd_tokens_per_second_bucket",
                 "nsd_tau_bucket", "nsd_acceptance_by_position", "nsd_position_accepts_total",
                 "nsd_relaxed_accepts_total", "nsd_deviation_per_token_bucket", "nsd_queue_depth",
                 "nsd_requests_in_progress", "nsd_queue_wait_seconds_bucket",
                 # the prompt cache's bytes beside its limit, and the process's memory
                 "nsd_prefix_cache_bytes_held", "nsd_prefix_cache_budget_bytes 1.073741824e+09",
                 "process_resident_memory_bytes"):
        assert name in text, name
    assert 'nsd_requests_total{endpoint="/v1/completions",status="200"}' in text


@pytest.fixture(scope="module")
def keyed():
    config = ServerConfig(model_name="secret-model", defaults=DEFAULTS, api_key="k3y")
    with running_server(mock_engine(), config) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"},
                                     {"Authorization": "Basic k3y"}])
@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/completions", {"model": "secret-model", "prompt": "ab", "max_tokens": 2}),
    ("POST", "/v1/completions", {"bad": True}),  # auth comes before validation
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/unknown", None),  # not even which paths exist
])
def test_api_key_required(keyed, headers, method, path, body) -> None:
    r = keyed.request(method, path, json=body, headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key" and "secret-model" not in r.text
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("header", ["bearer k3y", "BEARER k3y", "BeArEr k3y"])
def test_bearer_scheme_is_case_insensitive(keyed, header) -> None:
    # RFC 7235: the auth-scheme is case-insensitive; the key itself is not.
    r = keyed.post("/v1/completions", json={"model": "secret-model", "prompt": "ab", "max_tokens": 2},
                   headers={"Authorization": header})
    assert r.status_code == 200, r.text
    assert keyed.get("/v1/models", headers={"Authorization": header.upper()}).status_code == 401


def test_api_key_accepted_and_health_open(keyed) -> None:
    auth = {"Authorization": "Bearer k3y"}
    r = keyed.post("/v1/completions", json={"model": "secret-model", "prompt": "ab", "max_tokens": 2},
                   headers=auth)
    assert r.status_code == 200
    assert keyed.get("/v1/models", headers=auth).status_code == 200
    assert keyed.get("/health").status_code == 200


def test_usage_is_json_serialisable_numbers(server) -> None:
    client, _ = server
    body = _completion(client, max_tokens=4).json()
    json.dumps(body, allow_nan=False)


@pytest.mark.parametrize("flags, message", [
    (["--theta", "1.5"], "theta"),
    (["--queue-size", "-1"], "argument --queue-size: must be >= 0, got -1"),
    (["--request-timeout", "0"], "request timeout"),
    (["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
    (["--parallel", "0"], "--parallel must be a whole number in [1, 64], got 0"),
])
def test_cli_serve_bad_flags_exit_2(flags, message, capsys) -> None:
    try:
        code = main(["serve", "--target", "smollm2-135m-instruct", *flags])
    except SystemExit as exc:  # argparse's own errors (a flag's type) exit from the parser
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_cli_serve_port_in_use_fails_before_loading(capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--target", "no-such-model-would-fail-later", "--port", str(port)]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_engine_encodes_a_conversation() -> None:
    from nsd.errors import NSDError

    engine = mock_engine()
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert engine.encode(convo) == engine.tokenizer.encode("<system>s<user>u<assistant>")
    assert engine.encode("u", chat=True, system="s") == engine.encode(convo)
    with pytest.raises(NSDError, match="role"):
        engine.encode([{"role": "tool", "content": "x"}])
    # Emptiness is decided on the tokens: empty messages still render the template's.
    assert engine.encode([{"role": "user", "content": ""}]) == engine.tokenizer.encode("<user><assistant>")
    assert engine.encode(" ") == [ord(" ") % 16]
    with pytest.raises(NSDError, match="empty"):
        engine.encode("")
    # A name goes to the template (which may show it or not).
    seen = []
    engine.tokenizer.apply_chat_template = lambda messages, **_: seen.append(messages) or "x"
    engine.encode([{"role": "user", "content": "u", "name": "bob"}, {"role": "user", "content": "v"}])
    assert seen == [[{"role": "user", "content": "u", "name": "bob"}, {"role": "user", "content": "v"}]]


def test_models_report_the_nsd_defaults_under_the_option_names() -> None:
    """/v1/models and /v1/models/{id} carry the server's defaults for every knob of the
    request's ``nsd`` object, keyed as that object takes them (one definition, nsd.options)."""
    from nsd import options as optspec

    defaults = GenerationConfig(method="nsd", theta=0.7, budget=2.0, k=3)
    with running_server(mock_engine(), ServerConfig(model_name="mock", defaults=defaults)) as (url, _):
        listed = httpx.get(f"{url}/v1/models").json()["data"][0]
        one = httpx.get(f"{url}/v1/models/{listed['id']}")
        assert one.status_code == 200 and one.json() == listed
        assert set(listed["nsd"]["defaults"]) == {*optspec.RULE, *optspec.DRAFT_LENGTH}
        assert listed["nsd"]["defaults"]["theta"] == 0.7 and listed["nsd"]["defaults"]["k"] == 3
        assert listed["nsd"]["defaults"]["cap"] is None  # unlimited: JSON has no infinity
        missing = httpx.get(f"{url}/v1/models/not-this-one")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
