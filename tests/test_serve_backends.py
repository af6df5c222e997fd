"""The server's concurrency on both real backend kinds, not only the mock: requests that
arrive while others decode (so slots start, reset and end at different times) each get
the answer they get alone, whole or streamed.

transformers: a tiny random Qwen2 pair (no weights to fetch); llama.cpp: the small SmolLM2
GGUF of the registry (skipped with NSD_SKIP_REAL_MODELS=1 or without llama-cpp-python).
"""

from __future__ import annotations

import os
import random
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from mock import CharTokenizer
from nsd.api import Engine, GenerationConfig, load_engine
from nsd.serve import ServerConfig
from serve_support import running_server, sse_events

ALPHABET = string.printable[:97]
PARALLEL = 3


def _tiny_qwen2(seed: int, layers: int) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(ALPHABET), max_position_embeddings=512,
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


def _transformers_engine() -> Engine:
    pytest.importorskip("transformers")
    return Engine.from_models(_tiny_qwen2(0, 2), CharTokenizer(ALPHABET),
                              draft_model=_tiny_qwen2(1, 1), max_len=256)


def _llama_engine() -> Engine:
    if os.environ.get("NSD_SKIP_REAL_MODELS") == "1":
        pytest.skip("NSD_SKIP_REAL_MODELS=1")
    from nsd.models.loader import BackendOptions, llama_available

    if not llama_available():
        pytest.skip("llama-cpp-python is not installed (run scripts/install.sh)")
    from nsd.models.registry import fetch_gguf

    fetch_gguf("smollm2-135m-instruct")  # a no-op once cached
    # One thread: on a busy machine llama.cpp's spinning worker threads slow it many-fold.
    return load_engine("smollm2-135m-instruct", proposer="ngram",
                       options=BackendOptions(n_ctx=512, threads=1, weights="original"))


ENGINES = {"transformers": _transformers_engine, "llama.cpp": _llama_engine}


def _bodies(client: int, kind: str) -> list[dict[str, Any]]:
    """Three requests per client: greedy AR, greedy SD with k 3, and seeded sampling (on
    transformers float32, where a batch changes logits by rounding alone; llama.cpp's
    batched kernels round differently, enough to move a draw at temperature 1 across a
    boundary now and then, so there the third is greedy SD with k 2). Each prompt starts
    with a character of its own, so no slot's cache shares a token with it: every request
    resets its slot's cache while the others decode. They ask to continue a count, which
    SmolLM2 does with a wide margin between its first and second choice."""
    base = {"model": "m", "max_tokens": 12}
    third = {"temperature": 1.0, "seed": 10 + client, "nsd": {"method": "ar"}} \
        if kind == "transformers" else {"temperature": 0.0, "nsd": {"method": "sd", "k": 2}}
    bodies = [{**base, "temperature": 0.0, "nsd": {"method": "ar"}},
              {**base, "temperature": 0.0, "nsd": {"method": "sd", "k": 3}}, {**base, **third}]
    for j, body in enumerate(bodies):
        n = 10 * client + 3 * j
        body["prompt"] = f"{string.ascii_uppercase[3 * client + j]}. Continue the sequence: " \
                         f"{n}, {n + 1}, {n + 2},"
    return bodies


def _alone(engine: Engine, body: dict[str, Any]) -> str:
    """The answer the request gets from the engine alone, before it serves anything."""
    config = GenerationConfig(max_new_tokens=body["max_tokens"], temperature=body["temperature"],
                              seed=body.get("seed", GenerationConfig.seed), **body["nsd"])
    return engine.generate(body["prompt"], config).text


def _ask(url: str, body: dict[str, Any], stream: bool) -> str:
    r = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=300)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["text"]
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] is not None
    return "".join(e["choices"][0]["text"] for e in events[:-1])


@pytest.mark.parametrize("kind", list(ENGINES))
def test_requests_arriving_while_others_decode_get_their_answers_alone(kind: str) -> None:
    clients = 2 * PARALLEL
    config = ServerConfig(model_name="m", parallel=PARALLEL, queue_size=2 * clients,
                          defaults=GenerationConfig(max_new_tokens=12))
    engine = ENGINES[kind]()
    expected = {(c, j): _alone(engine, body) for c in range(clients)
                for j, body in enumerate(_bodies(c, kind))}
    assert len(set(expected.values())) > clients  # the answers tell the requests apart
    rng = random.Random(0)
    delays = {key: rng.uniform(0, 0.05) for key in expected}
    # The start measures the batched forwards' costs for -k auto (seconds on a busy CPU).
    with running_server(engine, config, startup_s=180) as (url, app):
        start = threading.Barrier(clients)

        def client(c: int) -> list[str]:
            start.wait()
            time.sleep(0.02 * c)  # arrivals spread out: slots start while others decode
            out = []
            for j, body in enumerate(_bodies(c, kind)):
                time.sleep(delays[(c, j)])
                out.append(_ask(url, body, stream=(c + j) % 2 == 1))
            return out

        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(client, range(clients)))
        for c, texts in enumerate(results):
            for j, text in enumerate(texts):
                assert text == expected[(c, j)], (c, j)  # its own tokens, nobody else's
        # The answers were decoded side by side, in forwards of several slots.
        assert app.state.worker.batcher.stats.largest > 1
        assert app.state.worker.running == 0 and app.state.worker.depth == 0
