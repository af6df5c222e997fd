"""A greedy NSD answer does not depend on how busy the server is: the same request alone
and beside three others running gives the same text and the same draft lengths, and
``usage.nsd.relaxed`` says whether the relaxed rule moved it off the target's greedy text.

On the mock the step costs are set so that the choice differs between the two cases for
a request that prices the shared forwards (alone drafting pays; beside three others a
drafted token costs what it adds to their forwards, and plain steps win); on the tiny
transformers pair they are measured."""

from __future__ import annotations

import string
import threading
from typing import Any

import httpx
import pytest
import torch

from mock import MockLM
from nsd.api import Engine, GenerationConfig
from nsd.draftlen.calibrate import Calibration
from nsd.draftlen.host_costs import HostCosts
from nsd.serve import ServerConfig
from serve_support import MockTokenizer, SlowLM, running_server, wait_until

K_MAX = 8
GREEDY = {"temperature": 0.0, "max_tokens": 40, "nsd": {"method": "nsd", "theta": 0.9, "k": "auto"}}


def _with_costs(engine: Engine) -> Engine:
    """Step costs set rather than measured (a busy machine's timings would decide what is
    tested): a target forward costs about the same for 1 and 9 tokens and the draft's step
    a twentieth of it, so drafting pays for a request alone, and beside others' forwards,
    which a drafted token joins for what it adds, plain steps win."""
    engine.target_model.calibration = Calibration(
        tuple(0.01 + 0.0005 * n for n in range(1, K_MAX + 2)), {}, cached=False)
    engine.draft_model.calibration = Calibration(
        tuple(0.0005 + 0.00005 * n for n in range(1, K_MAX + 2)), {}, cached=False)
    return engine


def _mock_engine() -> Engine:
    target = SlowLM(delay=0.0, vocab_size=16, seed=1)
    return _with_costs(Engine.from_backends(target, MockTokenizer(), proposer="draft",
                                            draft=MockLM(vocab_size=16, seed=2), eos_token_ids=()))


def _tiny_qwen2(seed: int, layers: int, tied: bool) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=512,
        tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


def _transformers_engine() -> Engine:
    pytest.importorskip("transformers")
    from mock import CharTokenizer

    # The target (tied embeddings) repeats its last token; the untied draft proposes other
    # tokens, which the target's nearly flat nucleus takes by the relaxed rule.
    return _with_costs(Engine.from_models(_tiny_qwen2(0, 2, tied=True),
                                          CharTokenizer(string.printable[:97]),
                                          draft_model=_tiny_qwen2(1, 1, tied=False), max_len=512))


def _post(client: httpx.Client, prompt: str, **fields: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, **fields})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kind", ["mock", "transformers"])
def test_a_greedy_nsd_answer_is_the_same_alone_and_in_a_batch_of_four(kind: str, monkeypatch) -> None:
    # nsd's own work per pass, left unpriced rather than timed on a busy machine.
    monkeypatch.setattr("nsd.engine.host_costs", lambda *_, **__: HostCosts(0.0, 0.0, 0.0, 0.0))
    engine = _mock_engine() if kind == "mock" else _transformers_engine()
    config = ServerConfig(model_name="m", parallel=4,
                          defaults=GenerationConfig(k_max=K_MAX, max_new_tokens=40))
    prompt = "abcabdabcabe" if kind == "mock" else "Greedy answers hold under load: "
    with running_server(engine, config, startup_s=180) as (url, app), \
            httpx.Client(base_url=url, timeout=120) as client:
        alone = _post(client, prompt, **GREEDY)
        stats = alone["usage"]["nsd"]
        # The relaxed rule accepted off-argmax drafts on the way (else the test shows nothing).
        assert stats["deviation"] > 0 and stats["relaxed"] is True
        assert stats["drafted_tokens"] > 0
        # Three others, sampled, long: running the whole time the greedy one runs.
        if kind == "mock":
            engine.target.delay = 0.002
        others: list[dict[str, Any]] = []

        def other(i: int) -> None:
            with httpx.Client(base_url=url, timeout=120) as own:
                others.append(_post(own, f"zyx{i}" * 3, temperature=0.9, seed=i, max_tokens=400,
                                    nsd={"method": "nsd", "k": "auto"}))

        threads = [threading.Thread(target=other, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: app.state.worker.running == 3, timeout=60)
        before = app.state.worker.batcher.stats.by_size.get(4, 0)
        busy = _post(client, prompt, **GREEDY)
        assert app.state.worker.batcher.stats.by_size.get(4, 0) > before  # it ran in a batch of 4
        assert app.state.worker.running == 3  # the others were still running when it ended
        for t in threads:
            t.join(120)
        assert busy["choices"][0]["text"] == alone["choices"][0]["text"]
        assert busy["usage"]["nsd"]["k_per_pass"] == stats["k_per_pass"]
        assert busy["usage"]["nsd"]["relaxed"] is True
        # An exact greedy answer reports relaxed false.
        exact = _post(client, prompt, temperature=0.0, max_tokens=10, nsd={"method": "sd", "k": 2})
        assert exact["usage"]["nsd"]["relaxed"] is False and exact["usage"]["nsd"]["deviation"] == 0


def test_draft_context_reaches_the_draft_through_the_server(monkeypatch) -> None:
    # A server drafting with a draft model takes nsd.draft_context (an ngram server refuses
    # it: tests/test_serve.py): the draft reads only the prompt's last 3 tokens, and greedy
    # SD's answer is the same as with the whole prompt (the target reads all of it).
    monkeypatch.setattr("nsd.engine.host_costs", lambda *_, **__: HostCosts(0.0, 0.0, 0.0, 0.0))
    reads: list[int] = []

    class CountingDraft(MockLM):
        def forward(self, tokens, all_logits: bool = True):
            reads.append(len(tokens))
            return super().forward(tokens, all_logits)

    target = SlowLM(delay=0.0, vocab_size=16, seed=1)
    engine = _with_costs(Engine.from_backends(target, MockTokenizer(), proposer="draft",
                                              draft=CountingDraft(vocab_size=16, seed=2), eos_token_ids=()))
    config = ServerConfig(model_name="m", defaults=GenerationConfig(k_max=K_MAX, max_new_tokens=12))
    prompt = "abcabdabcabe"
    with running_server(engine, config) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        answers = []
        for window in (3, 0):
            reads.clear()
            body = _post(client, prompt, temperature=0.0, max_tokens=12,
                         nsd={"method": "sd", "k": 2, "draft_context": window})
            answers.append(body["choices"][0]["text"])
            if window:  # a fresh draft: it reads the window (the second request reuses its cache)
                assert reads[0] == 3
        assert answers[0] == answers[1]
