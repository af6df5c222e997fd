"""Several requests decoded at once, their forwards batched (nsd.backends.sequences,
Engine.batched): each request's tokens and statistics are those it gets alone, with the
same seed and a fixed k; forwards really carry several sequences; one request's failure
is its own."""

from __future__ import annotations

import string
import threading
import time
from typing import Any

import pytest
import torch

from mock import CharTokenizer, MockLM
from nsd.api import Engine, GenerationConfig
from nsd.backends.sequences import StepBatcher, sequence_views
from nsd.errors import NSDError

CONFIGS = [
    GenerationConfig(method="ar", max_new_tokens=14, temperature=1.0, seed=3),
    GenerationConfig(method="sd", k=3, max_new_tokens=17, temperature=1.0, seed=4),
    GenerationConfig(method="nsd", theta=0.9, k=2, max_new_tokens=15, temperature=0.8, seed=5),
    GenerationConfig(method="sd", k=4, max_new_tokens=12, temperature=0.0, seed=6),
]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 1], [2, 2, 2, 2, 2, 2, 2]]


def _run_together(slots: list[Engine], batcher: StepBatcher, prompts: list[list[int]],
                  configs: list[GenerationConfig]) -> list[Any]:
    """Each request on its own thread, all members before any forward (so that the
    forwards meet), as the server's slots run them."""
    results: list[Any] = [None] * len(prompts)
    ready = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        with batcher.member():
            ready.wait()
            try:
                results[i] = slots[i].generate(prompts[i], configs[i])
            except Exception as exc:  # noqa: BLE001 - checked by the caller
                results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request never finished (deadlock?)"
    return results


def _same(alone: Any, batched: Any) -> None:
    assert batched.token_ids == alone.token_ids
    a, b = alone.stats, batched.stats
    assert (b.accepted_tokens, b.drafted_tokens, b.target_passes, b.relaxed_accepts) == \
        (a.accepted_tokens, a.drafted_tokens, a.target_passes, a.relaxed_accepts)
    assert b.deviation == pytest.approx(a.deviation, rel=1e-6, abs=1e-12)


def _mock_engine() -> Engine:
    return Engine.from_backends(MockLM(seed=1), CharTokenizer(), draft=MockLM(seed=2), proposer="draft")


def test_mock_requests_batched_match_each_alone() -> None:
    alone = [_mock_engine().generate(p, c) for p, c in zip(PROMPTS, CONFIGS)]
    engine = _mock_engine()
    slots, batcher = engine.batched(len(PROMPTS))
    batched = _run_together(slots, batcher, PROMPTS, CONFIGS)
    for a, b in zip(alone, batched):
        _same(a, b)
    # Forwards carried several sequences (target and draft alike), and each sequence's
    # cache holds its own context.
    assert max(engine.target.batch_sizes) == len(PROMPTS)
    assert max(engine.draft.batch_sizes) > 1
    assert batcher.stats.largest == len(PROMPTS)
    for seq, (prompt, result) in enumerate(zip(PROMPTS, batched)):
        held = engine.target.seq_cached_tokens(seq)
        assert held[:len(prompt) + len(result.token_ids) - 1] == prompt + result.token_ids[:-1]


def test_a_member_that_leaves_does_not_hold_the_others() -> None:
    """Requests of very different lengths: when the short ones end, the long one's
    forwards run alone instead of waiting for members that are gone."""
    engine = _mock_engine()
    slots, batcher = engine.batched(3)
    configs = [GenerationConfig(method="sd", k=2, max_new_tokens=n, temperature=1.0, seed=i)
               for i, n in enumerate((2, 5, 60))]
    results = _run_together(slots, batcher, PROMPTS[:3], configs)
    assert [len(r.token_ids) for r in results] == [2, 5, 60]
    assert batcher.members == 0 and 1 in batcher.stats.by_size and 3 in batcher.stats.by_size


def test_batched_engine_refuses_a_k_max_whose_costs_it_did_not_measure() -> None:
    engine = _mock_engine()
    slots, _ = engine.batched(2)
    with pytest.raises(NSDError, match="k_max"):
        slots[0].generate([1, 2], GenerationConfig(method="sd", k="auto", k_max=engine.k_max + 4))


transformers = pytest.importorskip("transformers")
VOCAB = 97


def _tiny_qwen2(seed: int, layers: int) -> torch.nn.Module:
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hf_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    return _tiny_qwen2(0, layers=2), _tiny_qwen2(1, layers=1)


def _hf_engine(models: tuple[torch.nn.Module, torch.nn.Module], max_len: int = 128) -> Engine:
    target, draft = models
    return Engine.from_models(target, CharTokenizer(string.printable[:VOCAB]), draft_model=draft,
                              max_len=max_len)


def test_transformers_float32_requests_batched_match_each_alone(hf_models) -> None:
    """The issue's identity check: on the float32 transformers backend, where a padded
    batch changes logits only by rounding, a request's tokens and statistics batched equal
    those it gets alone with the same seed and fixed k."""
    prompts = [[(7 * i + 3 * j) % (VOCAB - 1) + 1 for j in range(4 + 5 * i)] for i in range(4)]
    alone = [_hf_engine(hf_models).generate(p, c) for p, c in zip(prompts, CONFIGS)]
    engine = _hf_engine(hf_models)
    slots, batcher = engine.batched(len(prompts))
    batched = _run_together(slots, batcher, prompts, CONFIGS)
    for a, b in zip(alone, batched):
        _same(a, b)
    assert batcher.stats.largest == len(prompts)  # real padded batches of all four


def _hf_backend(models: tuple[torch.nn.Module, torch.nn.Module]) -> Any:
    from nsd.backends.hf import HFBackend

    return HFBackend.from_model(models[0], max_len=64)


@pytest.mark.parametrize("kind", ["mock", "transformers"])
def test_resetting_one_sequence_empties_that_one_alone(kind: str, hf_models) -> None:
    """reset(seq=s) empties sequence s and no other (as llama.cpp's backend does); reset()
    with no sequence empties them all."""
    backend = MockLM(seed=1) if kind == "mock" else _hf_backend(hf_models)
    sizes = [3, 4, 2]
    backend.set_sequences(len(sizes))
    for seq, n in enumerate(sizes):
        backend.forward_many([(seq, [5 + seq] * n, False)])

    def held() -> list[int]:
        return [backend.seq_num_cached(s) for s in range(len(sizes))]

    assert held() == [3, 4, 2]
    backend.reset(seq=2)
    assert held() == [3, 4, 0] and backend.seq_cached_tokens(1) == [6] * 4
    backend.reset(seq=0)
    assert held() == [0, 4, 0]
    backend.forward_many([(2, [9], False)])
    backend.reset(seq=1)
    assert held() == [0, 0, 1] and backend.seq_cached_tokens(2) == [9]
    backend.reset()
    assert held() == [0, 0, 0]


def test_a_request_starting_on_slot_2_leaves_slots_1_and_3_decoding(hf_models) -> None:
    """Three slots on the transformers backend: slots 1 and 3 decode, then a request
    starts on slot 2 (its cache is reset first). Every request's tokens and statistics are
    those it gets alone: the reset of slot 2 emptied no other slot's cache."""
    prompts = [[(5 * i + 2 * j) % (VOCAB - 1) + 1 for j in range(6 + 3 * i)] for i in range(3)]
    configs = [GenerationConfig(method="ar", max_new_tokens=40, temperature=1.0, seed=3),
               GenerationConfig(method="ar", max_new_tokens=8, temperature=1.0, seed=7),
               GenerationConfig(method="sd", k=2, max_new_tokens=40, temperature=0.0)]
    alone = [_hf_engine(hf_models).generate(p, c) for p, c in zip(prompts, configs)]
    engine = _hf_engine(hf_models)
    slots, batcher = engine.batched(3)
    results: list[Any] = [None] * 3
    first_two = threading.Barrier(2)

    def run(i: int) -> None:
        if i == 1:  # the late one: joins once the others have run a few batches
            wait_for(lambda: batcher.rounds >= 4)
        with batcher.member():
            if i != 1:
                first_two.wait()
            try:
                results[i] = slots[i].generate(prompts[i], configs[i])
            except Exception as exc:  # noqa: BLE001 - checked below
                results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for a, b in zip(alone, results):
        assert not isinstance(b, Exception), b
        _same(a, b)
    # Slot 2's request joined forwards of all three: slots 1 and 3 were still decoding.
    assert batcher.stats.largest == 3


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def test_one_requests_full_context_fails_it_alone(hf_models) -> None:
    engine = _hf_engine(hf_models, max_len=40)
    slots, batcher = engine.batched(3)
    prompts = [[5, 6, 7], [8, 9], [3] * 30]  # the last runs out of room after ~10 tokens
    configs = [GenerationConfig(method="sd", k=2, max_new_tokens=n, temperature=0.0)
               for n in (12, 12, 30)]
    results = _run_together(slots, batcher, prompts, configs)
    assert isinstance(results[2], NSDError) and "exceeds the context" in str(results[2])
    for prompt, config, result in zip(prompts[:2], configs[:2], results[:2]):
        _same(_hf_engine(hf_models, max_len=40).generate(prompt, config), result)


def test_a_long_forward_beside_others_runs_in_chunks_with_the_same_logits() -> None:
    """A prompt's prefill beside another request runs one chunk per round, so the other's
    steps go on between them; the logits are those of one forward. Alone it is one."""
    from nsd.backends.sequences import SequenceView

    prompt = [(3 * i + 1) % 16 for i in range(23)]
    whole = MockLM(seed=1).forward(prompt)
    backend = MockLM(seed=1)
    batcher = StepBatcher()
    views = [v[0] for v in sequence_views([backend], 2, batcher)]
    got: dict[str, Any] = {}
    ready = threading.Barrier(2)

    def long_one() -> None:
        with batcher.member():
            ready.wait()
            got["all"] = views[0].forward(prompt)  # all logits, 23 tokens in chunks of 10
            views[0].rewind(0)
            got["last"] = views[0].forward(prompt, all_logits=False)

    def stepper() -> None:
        with batcher.member():
            ready.wait()
            for tok in range(8):
                views[1].forward([tok])

    original = SequenceView.prefill_chunk
    SequenceView.prefill_chunk = 10
    try:
        threads = [threading.Thread(target=long_one), threading.Thread(target=stepper)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert torch.equal(got["all"], whole) and torch.equal(got["last"], whole[-1:])
        # Six chunks of sequence 0 (3 + 3), each in a round beside one of the stepper's
        # eight one-token forwards; the stepper's last two run alone.
        assert backend.batch_sizes == [2] * 6 + [1] * 2
        alone = StepBatcher()
        lone = sequence_views([MockLM(seed=1)], 1, alone)[0][0]
        with alone.member():
            assert torch.equal(lone.forward(prompt), whole)
        assert lone.backend.batch_sizes == [1]  # alone: one forward
    finally:
        SequenceView.prefill_chunk = original


def test_the_servers_prefill_chunk_reaches_every_view() -> None:
    from nsd.serve import ServerConfig
    from nsd.serve.worker import DecodeWorker

    assert ServerConfig(model_name="m").prefill_chunk == 64
    with pytest.raises(NSDError, match="prefill_chunk"):
        ServerConfig(model_name="m", prefill_chunk=-1)
    worker = DecodeWorker(_mock_engine(), 4, parallel=2, prefill_chunk=7)
    worker.start()
    try:
        views = [v for slot in worker._slots for v in (slot.target, slot.draft)]
        assert len(views) == 4 and all(v.prefill_chunk == 7 for v in views)
    finally:
        worker.stop(5.0)


def test_a_chats_next_turn_sent_as_the_last_one_ends_goes_to_its_slot() -> None:
    """The slot is free before the client hears that a generation ended: a next turn sent
    at that very moment goes to the slot whose cache holds the conversation (it reuses the
    prompt) rather than racing the release to an empty slot."""
    from nsd.prefix_cache import PrefixCache
    from nsd.serve.worker import DecodeWorker, Job

    engine = _mock_engine()
    engine.prefix_cache = PrefixCache(0)  # as the server attaches it: live caches reused
    worker = DecodeWorker(engine, 4, parallel=2)
    worker.start()
    config = GenerationConfig(method="nsd", k=2, max_new_tokens=5, temperature=0.0)
    ends: list[tuple[Any, int]] = []
    finished = threading.Event()

    class Turn(Job):
        def emit(self, kind: str, payload: Any = None) -> None:  # the client hearing events
            if kind == "error":
                ends.append((payload, worker.running))
                finished.set()
            if kind != "done":
                return
            ends.append((payload, worker.running))
            if len(ends) == 1:  # the user answers at once
                worker.submit(Turn(self.prompt_ids + payload.token_ids + [3, 1, 4], config, None))
            else:
                finished.set()

    try:
        first = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
        worker.submit(Turn(first, config, None))
        assert finished.wait(30)
        (one, running_at_first_end), (two, _) = ends
        assert running_at_first_end == 0  # the slot was released before "done"
        assert two.stats.cached_prompt_tokens >= len(first)  # the conversation's slot
    finally:
        worker.stop(5.0)
