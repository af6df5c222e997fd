"""OpenAI request fields: penalties and logit_bias as one logits transform for target and
draft (SD still samples the target's law, E is taken on the transformed p), logprobs from
the target distribution used, and a 400 naming every field nsd does not implement."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import httpx
import pytest
import torch

from mock import MockLM
from nsd.api import GenerationConfig
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.proposers.draft_model import DraftModelProposer
from nsd.rules.sampling import SamplingConfig, adjust_logits, logits_to_probs
from nsd.serve import ServerConfig
from nsd.rules.verify import RuleConfig
from serve_support import MockTokenizer, mock_engine, running_server, sse_events

PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, logit_bias=((0, 1.5), (3, -2.0)))


def _reference_adjusted(logits: torch.Tensor, history: list[int], presence: float,
                        frequency: float, bias: dict[int, float]) -> list[float]:
    """OpenAI's definition, written out: l[j] + bias[j] - frequency·c[j] - presence·[c[j] > 0]."""
    counts = Counter(history)
    return [float(x) + bias.get(j, 0.0) - frequency * counts[j] - presence * (counts[j] > 0)
            for j, x in enumerate(logits.double())]


def test_adjust_logits_follows_the_definition_row_by_row() -> None:
    config = SamplingConfig(temperature=1.0, **PENALTIES)
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    history, drafts = [1, 1, 2, 0], [2, 5]
    out = adjust_logits(logits, config, history, drafts)
    for i in range(3):  # row i follows history + drafts[:i]
        expected = _reference_adjusted(logits[i], history + drafts[:i], 0.8, 0.6, {0: 1.5, 3: -2.0})
        torch.testing.assert_close(out[i].double(), torch.tensor(expected, dtype=torch.float64),
                                   atol=1e-5, rtol=0)
    single = adjust_logits(logits[0], config, history)
    torch.testing.assert_close(single, out[0])
    assert adjust_logits(logits, SamplingConfig(temperature=1.0), history) is logits  # a no-op


def _law(target: MockLM, prompt: list[int], length: int, v: int, temperature: float) -> dict:
    """Every sequence's probability under AR sampling of the penalised, biased target."""
    bias = dict(PENALTIES["logit_bias"])
    probs = {}
    for seq in itertools.product(range(v), repeat=length):
        ctx, pr = list(prompt), 1.0
        for i, tok in enumerate(seq):
            adjusted = _reference_adjusted(target.logits_after(ctx), list(seq[:i]), 0.8, 0.6, bias)
            weights = [math.exp(x / temperature) for x in adjusted]
            pr *= weights[tok] / sum(weights)
            ctx.append(tok)
        probs[seq] = pr
    return probs


@pytest.mark.parametrize("speculative", [False, True])
def test_sd_with_penalties_and_bias_samples_the_transformed_target_law(speculative: bool) -> None:
    v, length, n, temperature = 4, 3, 3000, 0.9
    sampling = SamplingConfig(temperature=temperature, **PENALTIES)
    target = MockLM(vocab_size=v, seed=30, sharpness=1.2)
    draft = MockLM(vocab_size=v, seed=31, sharpness=1.2)
    exact = _law(target, [1, 2], length, v, temperature)
    counts: Counter = Counter()
    for seed in range(n):
        config = DecodeConfig(speculative=speculative, rule=RuleConfig(kind="exact"),
                              sampling=sampling, k=2, max_new_tokens=length, seed=seed)
        proposer = DraftModelProposer(draft, sampling) if speculative else None
        tokens, _ = run_to_end(decode(target, [1, 2], config, proposer))
        counts[tuple(tokens)] += 1
    cells = [(counts.get(s, 0), n * p) for s, p in exact.items()]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)
    # The transform binds: the plain law is far from these counts.
    plain = _law_plain(target, [1, 2], length, v, temperature)
    assert sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in plain.items()) > 5 * chi2


def _law_plain(target: MockLM, prompt: list[int], length: int, v: int, temperature: float) -> dict:
    probs = {}
    for seq in itertools.product(range(v), repeat=length):
        ctx, pr = list(prompt), 1.0
        for tok in seq:
            pr *= float(torch.softmax(target.logits_after(ctx).double() / temperature, -1)[tok])
            ctx.append(tok)
        probs[seq] = pr
    return probs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_sees_the_same_transform_so_a_copy_of_the_target_costs_nothing(temperature) -> None:
    # A draft identical to the target, transformed the same way, has q = p at every
    # position: every draft is accepted and E = 0, whatever the rule. E is thus taken on
    # the transformed p: a draft left untransformed gets rejections and, under NSD, E > 0.
    sampling = SamplingConfig(temperature=temperature, **PENALTIES)
    rule = RuleConfig(kind="nucleus", theta=0.9)
    config = DecodeConfig(rule=rule, sampling=sampling, k=3, max_new_tokens=30, seed=1)
    target, draft = MockLM(vocab_size=8, seed=40), MockLM(vocab_size=8, seed=40)
    _, same = run_to_end(decode(target, [1, 2, 3], config, DraftModelProposer(draft, sampling)))
    assert same.accepted_tokens == same.drafted_tokens > 0 and same.deviation == 0.0
    plain = SamplingConfig(temperature=temperature)
    _, other = run_to_end(decode(target, [1, 2, 3], config, DraftModelProposer(draft, plain)))
    assert other.accepted_tokens < other.drafted_tokens and other.deviation > 0


def _decode_with_logprobs(target, draft, sampling: SamplingConfig, speculative: bool, **config):
    """The tokens of an NSD θ 0.8 (k = 3) or plain decoding after [1, 2], and the
    TokenLogprob entries it reported."""
    decode_config = DecodeConfig(speculative=speculative, rule=RuleConfig(kind="nucleus", theta=0.8),
                                 sampling=sampling, k=3, **config)
    sink: list = []
    tokens, _ = run_to_end(decode(target, [1, 2], decode_config,
                                  DraftModelProposer(draft, sampling) if speculative else None,
                                  logprob_sink=sink))
    return tokens, sink


@pytest.mark.parametrize("temperature,speculative", [(0.0, True), (0.8, True), (0.8, False),
                                                     (0.0, False)])
def test_logprobs_are_those_of_the_target_distribution_used(temperature, speculative) -> None:
    sampling = SamplingConfig(temperature=temperature, top_k=6, **PENALTIES)
    target = MockLM(vocab_size=10, seed=50)
    tokens, sink = _decode_with_logprobs(target, MockLM(vocab_size=10, seed=51), sampling, speculative,
                                         max_new_tokens=20, seed=4, logprobs=3)
    assert [e.token for e in sink] == tokens
    for i, entry in enumerate(sink):
        logits = target.logits_after([1, 2] + tokens[:i])
        history = tokens[:i]
        if temperature == 0:  # p̂: the adjusted softmax at temperature 1
            expected = torch.log_softmax(adjust_logits(logits, sampling, history), -1)
            if not speculative:  # (NSD may accept another token of the nucleus)
                assert entry.top[0][0] == entry.token
        else:
            expected = torch.log(logits_to_probs(logits, sampling, history).double()).float()
        assert entry.logprob == pytest.approx(float(expected[entry.token]), abs=1e-5)
        order = torch.argsort(expected, descending=True)[:3].tolist()
        assert [t for t, _ in entry.top] == order
        assert [lp for _, lp in entry.top] == pytest.approx(expected[order].tolist(), abs=1e-5)


@pytest.mark.parametrize("filters", [dict(top_p=0.3), dict(top_k=1), dict(min_p=0.5)])
@pytest.mark.parametrize("speculative", [False, True])
def test_top_logprobs_past_the_kept_tokens_are_the_target_s_runners_up(filters, speculative) -> None:
    # Asked for more alternatives than the filters keep, the rest are the tokens they
    # removed, ranked by the adjusted logits before the filters, each at -inf: real
    # runners-up, never arbitrary zero-probability ids (in a real vocabulary, special tokens).
    sampling = SamplingConfig(temperature=0.7, **filters, **PENALTIES)
    target = MockLM(vocab_size=12, seed=52)
    tokens, sink = _decode_with_logprobs(target, MockLM(vocab_size=12, seed=53), sampling, speculative,
                                         max_new_tokens=15, seed=6, logprobs=6)
    filled = 0
    for i, entry in enumerate(sink):
        logits = target.logits_after([1, 2] + tokens[:i])
        p = logits_to_probs(logits, sampling, tokens[:i])
        adjusted = adjust_logits(logits, sampling, tokens[:i])
        kept = sorted(range(12), key=lambda t: -float(p[t]))[:int((p > 0).sum())]
        removed = sorted((t for t in range(12) if p[t] == 0), key=lambda t: -float(adjusted[t]))
        ids = [t for t, _ in entry.top]
        assert len(ids) == len(set(ids)) == 6
        n_kept = min(len(kept), 6)
        assert set(ids[:n_kept]) == set(kept[:n_kept])  # the kept ones first, as before
        assert ids[n_kept:] == removed[:6 - n_kept]
        assert all(math.isinf(v) and v < 0 for _, v in entry.top[n_kept:])
        filled += 6 - n_kept
    assert filled > 0  # the filters bind on this run


# ----------------------------------------------------------------------------- the server

DEFAULTS = GenerationConfig(method="nsd", max_new_tokens=10, k=3)


@pytest.fixture(scope="module")
def server():
    engine = mock_engine(n_ctx=256)
    with running_server(engine, ServerConfig(model_name="mock", defaults=DEFAULTS)) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client, engine


def _post(client, chat: bool, **body):
    base = {"model": "mock", "max_tokens": 10}
    base.update({"messages": [{"role": "user", "content": "abcab"}]} if chat else {"prompt": "abcab"})
    return client.post("/v1/chat/completions" if chat else "/v1/completions", json={**base, **body})


def _library(engine, chat: bool, **config):
    prompt = engine.encode([{"role": "user", "content": "abcab"}]) if chat else engine.encode("abcab")
    return engine.generate(prompt, GenerationConfig(**{**DEFAULTS.__dict__, "max_new_tokens": 10,
                                                       **config}))


@pytest.mark.parametrize("chat", [False, True])
def test_penalties_are_honoured(server, chat: bool) -> None:
    client, engine = server
    body = dict(presence_penalty=1.5, frequency_penalty=2.0, temperature=0.7, seed=3)
    r = _post(client, chat, **body)
    assert r.status_code == 200
    text = r.json()["choices"][0]["message" if chat else "text"]
    text = text["content"] if chat else text
    assert text == _library(engine, chat, **body).text
    plain = _library(engine, chat, temperature=0.7, seed=3).text
    assert text != plain  # they bind on this prompt
    # A strong frequency penalty spreads the tokens: no letter repeats much.
    assert max(Counter(text).values()) <= max(Counter(plain).values())


@pytest.mark.parametrize("chat", [False, True])
def test_logit_bias_is_honoured(server, chat: bool) -> None:
    client, _ = server
    r = _post(client, chat, logit_bias={"5": 100})  # token 5 is "f" to the mock tokenizer
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"] if chat else choice["text"]) == "f" * 10
    r = _post(client, chat, logit_bias={"5": -100, "6": -100}, temperature=1.0, seed=2,
              max_tokens=40)
    text = r.json()["choices"][0]
    assert not set(text["message"]["content"] if chat else text["text"]) & {"f", "g"}


def test_chat_logprobs_and_top_logprobs(server) -> None:
    client, engine = server
    r = _post(client, True, logprobs=True, top_logprobs=2, temperature=0.8, seed=9)
    body = r.json()
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 10
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    expected = _library(engine, True, temperature=0.8, seed=9, logprobs=2).logprobs
    for entry, info in zip(content, expected):
        assert entry["logprob"] == pytest.approx(info.logprob)
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert top == sorted(top, reverse=True) and entry["logprob"] <= top[0] + 1e-6
        assert all(-9999 <= t <= 0 for t in top)
    r = _post(client, True, logprobs=True)  # no alternatives asked: none given
    assert all(e["top_logprobs"] == [] for e in r.json()["choices"][0]["logprobs"]["content"])
    assert _post(client, True).json()["choices"][0]["logprobs"] is None


def test_greedy_logprobs_report_the_emitted_token_as_most_likely(server) -> None:
    client, _ = server
    # Exact SD: greedy output is the argmax at every position (NSD may relax to another).
    content = _post(client, True, logprobs=True, top_logprobs=1,
                    nsd={"method": "sd"}).json()["choices"][0]["logprobs"]["content"]
    for entry in content:
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert entry["logprob"] < 0  # p̂, the temperature-1 softmax: not a one-hot's 0


def test_completion_logprobs_legacy_form(server) -> None:
    client, _ = server
    body = _post(client, False, logprobs=3, temperature=0.8, seed=1).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == list(itertools.accumulate([0] + [len(t) for t in lp["tokens"]]))[:-1]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 10
    assert all(len(top) <= 3 and max(top.values()) >= logprob - 1e-6
               for top, logprob in zip(lp["top_logprobs"], lp["token_logprobs"]))


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_match_the_whole_response(server, chat: bool) -> None:
    client, _ = server
    body = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    whole = _post(client, chat, temperature=0.8, seed=5, stop=["c"], **body).json()
    base = {"model": "mock", "max_tokens": 10, "temperature": 0.8, "seed": 5, "stop": ["c"],
            "stream": True, **body}
    base.update({"messages": [{"role": "user", "content": "abcab"}]} if chat else {"prompt": "abcab"})
    with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=base) as r:
        events = [e for e in sse_events(r.read().decode()) if e != "[DONE]"]
    pieces = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    expected = whole["choices"][0]["logprobs"]
    if chat:
        assert [x for p in pieces for x in p["content"]] == expected["content"]
    else:
        assert [x for p in pieces for x in p["tokens"]] == expected["tokens"]
        assert [x for p in pieces for x in p["text_offset"]] == expected["text_offset"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "text"}), ("echo", False), ("suffix", ""), ("best_of", 1),
    ("tool_choice", "none"), ("user", "someone"), ("store", False), ("service_tier", "auto"),
    ("parallel_tool_calls", False), ("modalities", ["text"]), ("metadata", {}),
    ("presence_penalty", 0), ("logit_bias", {}),
])
def test_fields_that_ask_for_nothing_are_accepted(server, chat, field, value) -> None:
    client, _ = server
    assert _post(client, chat, **{field: value}).status_code == 200


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("field, value, says", [
    ("response_format", {"type": "json_object"}, "same grammar"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "same grammar"),
    ("echo", True, "echo"), ("suffix", "end", "suffix"), ("best_of", 2, "best_of"),
    ("tool_choice", "auto", "tool calling"), ("audio", {"voice": "x"}, "audio"),
    ("modalities", ["text", "audio"], "text modality"), ("prediction", {"type": "content"}, "predicted"),
    ("reasoning_effort", "low", "reasoning_effort"), ("web_search_options", {}, "web search"),
    ("store", True, "storing"), ("metadata", {"a": "b"}, "metadata"),
    ("service_tier", "flex", "tiers"), ("functions", [{"name": "f"}], "tool calling"),
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3, "[-2, 2]"),
    ("logit_bias", {"5": 101}, "[-100, 100]"), ("logit_bias", {"x": 1}, "token id"),
    ("logit_bias", {"16": 1}, "vocabulary"), ("logit_bias", [1], "object"),
    ("repetition_penalty", 1.1, "unknown field"), ("n", 2, "n = 1"),
])
def test_fields_not_implemented_are_a_400_naming_them(server, chat, field, value, says) -> None:
    client, _ = server
    r = _post(client, chat, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and says in error["message"], error


def test_logprobs_fields_are_checked(server) -> None:
    client, _ = server
    r = _post(client, True, top_logprobs=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = _post(client, True, logprobs=True, top_logprobs=21)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = _post(client, False, logprobs=True)  # the legacy field is a count, not a flag
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = _post(client, False, logprobs=21)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("chat", [False, True])
def test_top_logprobs_past_the_filters_are_the_next_real_tokens(server, chat: bool) -> None:
    # More alternatives asked for than top-k / top-p keep: the rest are the tokens the
    # target ranks next (top-k and top-p keep a prefix of the logits' order, so the whole
    # list is the logits' order), at -9999, each token once.
    client, engine = server
    body = dict(logprobs=True, top_logprobs=4) if chat else dict(logprobs=4)
    sampling = dict(temperature=0.7, top_p=0.5, seed=3) if chat else dict(temperature=0.7, top_k=1)
    r = _post(client, chat, max_tokens=3, **body, **sampling).json()
    lm = MockLM(vocab_size=16, seed=2)  # the mock engine's target
    prompt = engine.encode([{"role": "user", "content": "abcab"}] if chat else "abcab")
    filters = SamplingConfig(**{k: v for k, v in sampling.items() if k != "seed"})
    choice = r["choices"][0]
    tokens = [ord(c) - 97 for c in (choice["message"]["content"] if chat else choice["text"])]
    filled = 0
    for i in range(len(tokens)):
        logits = lm.logits_after(prompt + tokens[:i])
        p = logits_to_probs(logits, filters)
        order = torch.argsort(logits, descending=True)[:4].tolist()
        expected = [(chr(97 + t), math.log(p[t]) if p[t] > 0 else -9999.0) for t in order]
        if chat:
            entry = r["choices"][0]["logprobs"]["content"][i]
            got = [(t["token"], t["logprob"]) for t in entry["top_logprobs"]]
        else:
            got = list(r["choices"][0]["logprobs"]["top_logprobs"][i].items())
        assert [t for t, _ in got] == [t for t, _ in expected]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], abs=1e-5)
        filled += sum(v == -9999.0 for _, v in got)
    assert filled > 0  # the filters bind on this prompt


def test_completions_top_logprobs_keep_the_likelier_of_tokens_with_one_text() -> None:
    # The legacy form maps text to logprob, so two tokens of one text cannot both appear:
    # the likelier is kept (chat's list holds both).
    from nsd.generation import TokenInfo
    from nsd.serve.protocol import ResponseBuilder

    info = TokenInfo(3, "a", 0, -0.5, ((3, "a", -0.5), (7, "", -1.0), (9, "", -2.0), (4, "b", -3.0)))
    legacy = ResponseBuilder("m", chat=False, config=GenerationConfig()).logprobs([info])
    assert legacy["top_logprobs"] == [{"a": -0.5, "": -1.0, "b": -3.0}]
    chat = ResponseBuilder("m", chat=True, config=GenerationConfig()).logprobs([info])
    assert [t["token"] for t in chat["content"][0]["top_logprobs"]] == ["a", "", "", "b"]


# JSON null in an optional field means "not set": the server's setting applies, exactly as
# if the field were left out (OpenAI's reading), in the nsd object too.
NULLABLE = ["temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
            "frequency_penalty", "stream", "stream_options", "max_tokens", "max_completion_tokens",
            "stop", "n", "user", "logit_bias", "logprobs", "tools", "functions", "tool_choice",
            "parallel_tool_calls", "response_format", "echo", "suffix", "best_of", "nsd"]
NSD_FIELDS = ["method", "theta", "budget", "cap", "smooth", "typical_epsilon", "typical_delta",
              "k", "k_max", "adaptive_k"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("body", [{f: None} for f in NULLABLE]
                         + [{"nsd": {f: None}} for f in NSD_FIELDS]
                         + [{"stream": True, "stream_options": {"include_usage": None}},
                            {"top_logprobs": None}, {"logprobs": True, "top_logprobs": None}])
def test_null_means_not_set(server, chat: bool, body: dict) -> None:
    client, _ = server
    if not chat and "top_logprobs" in body:
        pytest.skip("top_logprobs is a chat field")
    given = {"temperature": 0.8, "seed": 7, **body}  # sampling, so seed and filters matter
    left_out = {k: v for k, v in given.items() if v is not None}
    for nested in ("nsd", "stream_options"):  # a null inside is left out there
        if isinstance(given.get(nested), dict):
            left_out[nested] = {k: v for k, v in given[nested].items() if v is not None}
    r, expected = _post(client, chat, **given), _post(client, chat, **left_out)
    assert r.status_code == 200, r.text
    assert _answer(r, chat) == _answer(expected, chat)


def _answer(r, chat: bool) -> str:
    """The text of a whole or streamed response."""
    if not r.headers["content-type"].startswith("text/event-stream"):
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    events = [e for e in sse_events(r.text) if e != "[DONE]" and e["choices"]]
    return "".join((e["choices"][0]["delta"].get("content", "") if chat else e["choices"][0]["text"])
                   for e in events)


class NamedTokenizer(MockTokenizer):
    """A chat template that shows a user's name (as many do), but no assistant's."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> str:
        return "".join(f"<{m['role']}{':' + m['name'] if 'name' in m and m['role'] == 'user' else ''}>"
                       f"{m['content']}" for m in messages) + "<assistant>"


def test_a_message_name_is_given_to_the_template_or_refused() -> None:
    engine = mock_engine(n_ctx=256)
    engine.tokenizer = NamedTokenizer()
    with running_server(engine, ServerConfig(model_name="mock", defaults=DEFAULTS)) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:
            named = [{"role": "user", "content": "abcab", "name": "bob"}]
            r = _post(client, True, messages=named)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(engine.encode(named)) \
                == len(engine.encode([{"role": "user", "content": "abcab"}])) + 4  # ":bob"
            assert r.json()["choices"][0]["message"]["content"] == \
                engine.generate(engine.encode(named), DEFAULTS).text
            # This template drops an assistant's name: refused, not silently lost.
            turns = [*named, {"role": "assistant", "content": "ok", "name": "helper"},
                     {"role": "user", "content": "more", "name": None}]  # null: no name
            r = _post(client, True, messages=turns)
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["param"] == "messages[1].name" and "does not show" in error["message"]
            assert _post(client, True, messages=[*named, {"role": "assistant", "content": "ok"},
                                                 turns[2]]).status_code == 200


def test_an_assistant_turn_sent_back_with_its_null_fields_is_accepted(server) -> None:
    client, _ = server
    turn = {"role": "assistant", "content": "ok", "refusal": None, "audio": None,
            "tool_calls": None, "function_call": None, "name": None}
    r = _post(client, True, messages=[{"role": "user", "content": "abcab"}, turn,
                                      {"role": "user", "content": "ab"}])
    assert r.status_code == 200, r.text


def test_an_openai_client_message_and_stream_options_round_trip(server) -> None:
    # What the openai client's ChatCompletionMessage.model_dump() sends back as a turn, and
    # stream options it may send: accepted where they ask for nothing nsd lacks.
    client, _ = server
    turn = {"role": "assistant", "content": "ok", "refusal": None, "audio": None, "annotations": None,
            "tool_calls": None, "function_call": None}
    turns = [{"role": "user", "content": "abcab"}, turn, {"role": "user", "content": "ab"}]
    assert _post(client, True, messages=turns).status_code == 200
    assert _post(client, True, messages=[*turns[:1], {**turn, "annotations": []}, turns[2]]).status_code == 200
    for value, param in ((0, "refusal"), ("", "refusal"), ({}, "audio"), ([{"type": "url_citation"}], "annotations")):
        r = _post(client, True, messages=[*turns[:1], {**turn, param: value}, turns[2]])
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[1].{param}", (param, value)
    ok = _post(client, True, messages=turns[:1], stream=True,
               stream_options={"include_usage": True, "include_obfuscation": False})
    assert ok.status_code == 200
    r = _post(client, True, messages=turns[:1], stream=True, stream_options={"include_obfuscation": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_obfuscation"
    # A completions request with chat's messages: the generic unknown-field message.
    r = _post(client, False, messages=turns)
    assert r.status_code == 400 and "a message takes" not in r.json()["error"]["message"]
