"""Prompt reuse: the prefill keeps what the caches hold, saved sequences come back from
the prefix cache, and neither changes a token (mock LMs and a float32 transformers model)."""

from __future__ import annotations

import pytest
import torch

from mock import CachingLM, CharTokenizer, MockLM
from nsd.api import Engine, GenerationConfig
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.prefix_cache import PrefixCache
from nsd.proposers.draft_model import DraftModelProposer
from nsd.rules.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0.0)
SAMPLE = SamplingConfig(temperature=1.0)


def _engine(target, draft=None, budget: int = 0) -> Engine:
    engine = Engine.from_backends(target, CharTokenizer(), draft=draft, eos_token_ids=())
    engine.prefix_cache = PrefixCache(budget_bytes=budget)  # 0: the live cache only
    return engine


@pytest.mark.parametrize("method,temperature", [("sd", 0.0), ("nsd", 1.0), ("ar", 0.7)])
def test_warm_prefix_gives_the_tokens_of_a_cold_cache(method: str, temperature: float) -> None:
    warm = _engine(CachingLM(vocab_size=52, seed=1), CachingLM(vocab_size=52, seed=2))
    config = GenerationConfig(method=method, temperature=temperature, k=3, max_new_tokens=20, seed=5)
    first = warm.generate("abcdefghijklmnopqrstuvwxyz", config)
    # The second turn extends the first (prompt + answer + more), like a chat.
    second_prompt = warm.encode("abcdefghijklmnopqrstuvwxyz") + first.token_ids + warm.encode("XYZ")
    t_fed, d_fed = warm.target.fed_tokens, warm.draft.fed_tokens
    again = warm.generate(second_prompt, config)
    assert again.stats.cached_prompt_tokens >= 26 + len(first.token_ids) - 1
    fed_second = warm.target.fed_tokens - t_fed
    cold = _engine(CachingLM(vocab_size=52, seed=1), CachingLM(vocab_size=52, seed=2))
    reference = cold.generate(second_prompt, config)
    assert again.token_ids == reference.token_ids
    assert again.stats.deviation == reference.stats.deviation
    assert reference.stats.cached_prompt_tokens == 0
    # Without a prefix cache the engine prefills every prompt whole (comparable runs).
    plain = Engine.from_backends(CachingLM(vocab_size=52, seed=1), CharTokenizer(),
                                 draft=CachingLM(vocab_size=52, seed=2), eos_token_ids=())
    plain.generate("abcdefghijklmnopqrstuvwxyz", config)
    assert plain.generate(second_prompt, config).stats.cached_prompt_tokens == 0
    # The prefill fed only the new part of the prompt (3 tokens + the answer's last one).
    assert fed_second < cold.target.fed_tokens - len(second_prompt) + 10
    if method != "ar":  # the draft's cache was reused too, and counted
        assert warm.draft.fed_tokens - d_fed < cold.draft.fed_tokens - len(second_prompt) + 10
        counted = warm.prefix_cache.stats()["draft_reused_tokens"]
        assert counted >= again.stats.cached_prompt_tokens - 1 and counted <= len(second_prompt)
    else:
        assert warm.prefix_cache.stats()["draft_reused_tokens"] == 0  # no draft ran


def test_a_backend_that_does_not_say_what_it_holds_is_reset() -> None:
    target = MockLM(vocab_size=16, seed=3)  # no cached_tokens: nothing is reused
    config = DecodeConfig(speculative=False, sampling=GREEDY, max_new_tokens=5)
    a, _ = run_to_end(decode(target, [1, 2, 3, 4], config))
    b, stats = run_to_end(decode(target, [1, 2, 3, 4], config, reuse_cache=True))
    assert a == b and stats.cached_prompt_tokens == 0


def test_diverging_prompt_keeps_only_the_common_prefix() -> None:
    target = CachingLM(vocab_size=16, seed=3)
    config = DecodeConfig(speculative=False, sampling=GREEDY, max_new_tokens=4)
    run_to_end(decode(target, [1, 2, 3, 4, 5, 6], config, reuse_cache=True))
    tokens, stats = run_to_end(decode(target, [1, 2, 3, 9, 9, 9], config, reuse_cache=True))
    assert stats.cached_prompt_tokens == 3
    cold, _ = run_to_end(decode(CachingLM(vocab_size=16, seed=3), [1, 2, 3, 9, 9, 9], config))
    assert tokens == cold


def test_prefix_cache_restores_an_earlier_conversation_and_counts() -> None:
    engine = _engine(CachingLM(vocab_size=52, seed=1), CachingLM(vocab_size=52, seed=2))
    engine.prefix_cache = cache = PrefixCache(budget_bytes=1 << 20)
    config = GenerationConfig(method="sd", k=3, max_new_tokens=8)
    conv_a = "abcdefghijklmnopqrstuvwxyz" * 2
    conv_b = "ZYXWVUTSRQPONMLKJIHGFEDCBA" * 2
    ra = engine.generate(conv_a, config)
    engine.generate(conv_b, config)  # A is saved before B's prefill cuts the cache back
    assert cache.saves == 1 and cache.entries == 1
    again = engine.generate(engine.encode(conv_a) + ra.token_ids + engine.encode("more"), config)
    assert cache.restores == 1
    assert again.stats.cached_prompt_tokens == len(conv_a) + len(ra.token_ids) - 1
    # The draft came back with it: its cache holds conversation A again.
    assert engine.draft.cached_tokens[:len(conv_a)] == engine.encode(conv_a)
    cold = _engine(CachingLM(vocab_size=52, seed=1), CachingLM(vocab_size=52, seed=2))
    assert again.token_ids == cold.generate(engine.encode(conv_a) + ra.token_ids +
                                            engine.encode("more"), config).token_ids
    stats = cache.stats()
    assert stats["hits"] == 1 and stats["misses"] == 2
    assert stats["reused_tokens"] == again.stats.cached_prompt_tokens
    # A (restored, kept: the live cache will supersede it when saved) and B (saved then).
    assert stats["bytes_held"] > 0 and stats["entries"] == 2 and cache.saves == 2


def test_prefix_cache_evicts_least_recently_used_within_budget() -> None:
    engine = _engine(CachingLM(vocab_size=52, seed=1))
    engine.use_proposer("ngram")
    # CachingLM snapshots take 8 bytes per token: room for about two 60-token sequences.
    cache = engine.prefix_cache = PrefixCache(budget_bytes=8 * 140)
    config = GenerationConfig(method="ar", max_new_tokens=4)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    prompts = [letters[i:] + letters[:i] + letters[i:i + 6] for i in range(4)]  # 58 tokens each
    for prompt in prompts:
        engine.generate(prompt, config)
    assert cache.saves == 3 and cache.evictions == 1 and cache.entries == 2
    assert cache.bytes_held <= cache.budget_bytes
    engine.generate(prompts[0] + "x", config)  # evicted: a miss
    assert cache.stats()["hits"] == 0
    engine.generate(prompts[2] + "x", config)  # still saved: restored
    assert cache.restores == 1 and cache.stats()["hits"] == 1


def test_zero_budget_saves_nothing_but_reuses_the_live_cache() -> None:
    engine = _engine(CachingLM(vocab_size=52, seed=1))
    engine.proposer_kind = "ngram"
    cache = engine.prefix_cache = PrefixCache(budget_bytes=0)
    config = GenerationConfig(method="ar", max_new_tokens=4)
    r = engine.generate("abcdefghijklmnopqrstuvwxyz", config)
    engine.generate(engine.encode("abcdefghijklmnopqrstuvwxyz") + r.token_ids + [1, 2], config)
    engine.generate("ZYXWVUTSRQPONMLKJIHGFEDCBA", config)
    assert cache.saves == 0 and cache.entries == 0
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 2


transformers = pytest.importorskip("transformers")


def _tiny_qwen2(seed: int) -> torch.nn.Module:
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=52, max_position_embeddings=256,
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_transformers_float32_warm_equals_cold(temperature: float) -> None:
    from nsd.backends.hf import HFBackend

    target_model, draft_model = _tiny_qwen2(0), _tiny_qwen2(1)

    def engine() -> Engine:
        return _engine(HFBackend.from_model(target_model, max_len=256),
                       HFBackend.from_model(draft_model, max_len=256))

    warm = engine()
    warm.prefix_cache = PrefixCache(budget_bytes=64 << 20)
    config = GenerationConfig(method="nsd", temperature=temperature, k=3, max_new_tokens=16, seed=2)
    first = warm.generate("abcdefghijklmnopqrstuvwxyzabcdefgh", config)
    warm.generate("QRSTUVWXYZ" * 3, config)  # another conversation in between: A is saved
    prompt = warm.encode("abcdefghijklmnopqrstuvwxyzabcdefgh") + first.token_ids + warm.encode("ok")
    again = warm.generate(prompt, config)
    assert warm.prefix_cache.restores == 1
    assert again.stats.cached_prompt_tokens == 34 + len(first.token_ids) - 1
    reference = engine().generate(prompt, config)
    assert again.token_ids == reference.token_ids
    assert again.stats.accepted_per_pass == reference.stats.accepted_per_pass


def test_server_reports_reuse_in_usage_and_metrics() -> None:
    import httpx

    from nsd.serve import ServerConfig
    from serve_support import mock_engine, running_server

    engine = mock_engine(n_ctx=512)
    config = ServerConfig(model_name="mock", defaults=GenerationConfig(method="sd", k=3,
                                                                        max_new_tokens=8),
                          prefix_cache_mb=1)
    with running_server(engine, config) as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        messages = [{"role": "user", "content": "a long enough first question"}]
        r1 = client.post("/v1/chat/completions", json={"model": "mock", "messages": messages}).json()
        assert r1["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        messages += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "and a second one"}]
        r2 = client.post("/v1/chat/completions", json={"model": "mock", "messages": messages}).json()
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"]
        metrics = client.get("/metrics").text
    assert engine.prefix_cache.budget_bytes == 1 << 20
    for line in ("nsd_prefix_cache_hits_total 1.0", "nsd_prefix_cache_misses_total 1.0",
                 f"nsd_prefix_cache_reused_tokens_total "
                 f"{float(r2['usage']['prompt_tokens_details']['cached_tokens'])}",
                 "nsd_prefix_cache_budget_bytes 1.048576e+06"):
        assert line in metrics, line
    for name in ("bytes_held", "entries", "evictions_total", "saves_total", "restores_total"):
        assert f"nsd_prefix_cache_{name}" in metrics
