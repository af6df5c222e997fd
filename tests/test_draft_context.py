"""--draft-context: a draft model that reads at most N prompt tokens it does not hold.

The mock LMs are bigram models (their logits depend on the last two tokens), so a window
of two or more tokens drafts exactly what the whole prompt would: the tests can then
require the same tokens and counts, and read the saving off the draft's forwards.
"""

from __future__ import annotations

import pytest

from mock import CachingLM, MockLM
from nsd.api import GenerationConfig
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.errors import NSDError
from nsd.proposers.draft_model import DraftModelProposer
from nsd.rules.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0.0)
SAMPLE = SamplingConfig(temperature=1.0)
PROMPT = list(range(1, 25))  # 24 tokens


class CountingLM(MockLM):
    """Records the length of each forward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[int] = []

    def forward(self, tokens, all_logits: bool = True):
        self.reads.append(len(tokens))
        return super().forward(tokens, all_logits)


def _sd(window: int, sampling: SamplingConfig = GREEDY, seed: int = 0):
    target, draft = MockLM(vocab_size=32, seed=0), CountingLM(vocab_size=32, seed=5)
    config = DecodeConfig(sampling=sampling, k=3, max_new_tokens=30, seed=seed)
    proposer = DraftModelProposer(draft, sampling, target.vocab_size, prompt_window=window)
    tokens, stats = run_to_end(decode(target, PROMPT, config, proposer))
    return tokens, stats, draft


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE])
def test_a_window_reads_only_the_prompt_tail_and_drafts_the_same(sampling: SamplingConfig) -> None:
    whole_tokens, whole, whole_draft = _sd(0, sampling)
    tokens, stats, draft = _sd(4, sampling)
    assert whole_draft.reads[0] == len(PROMPT)  # no window: the whole prompt first
    assert draft.reads[0] == 4  # the window: its last 4 tokens
    # A bigram draft sees all it needs in 4 tokens: the same drafts, the same verdicts.
    assert tokens == whole_tokens
    assert (stats.drafted_tokens, stats.accepted_tokens) == (whole.drafted_tokens, whole.accepted_tokens)
    assert draft.reads[1:] == whole_draft.reads[1:]  # the blocks themselves are unchanged
    # The draft's cache holds the window and what followed it, not the prompt's head.
    assert draft._tokens[:4] == PROMPT[-4:]


def test_greedy_sd_with_a_window_still_equals_ar() -> None:
    # A draft whose bigrams need more than the window would accept less, never change the
    # text: the target verifies against the whole context.
    target = MockLM(vocab_size=32, seed=0)
    ar, _ = run_to_end(decode(target, PROMPT, DecodeConfig(speculative=False, sampling=GREEDY,
                                                           max_new_tokens=30)))
    tokens, stats, _ = _sd(1)  # one token: the draft loses its bigram context at the start
    assert tokens == ar and stats.deviation == 0.0


def test_a_window_longer_than_the_prompt_changes_nothing() -> None:
    tokens, stats, draft = _sd(len(PROMPT))
    whole_tokens, whole, whole_draft = _sd(0)
    assert draft.reads == whole_draft.reads and tokens == whole_tokens


def test_a_cached_prompt_is_reused_when_few_tokens_are_missing() -> None:
    # The draft's cache (a prefix cache's restore, or the previous turn) holds all but the
    # last 3 prompt tokens: 3 <= the window, so it catches up from there, keeping its start.
    draft = CachingLM(vocab_size=32, seed=5)
    draft.forward(PROMPT[:-3])
    draft.fed_tokens = 0
    proposer = DraftModelProposer(draft, GREEDY, 32, reuse_cache=True, prompt_window=4)
    proposer.begin(len(PROMPT))
    proposer.propose(PROMPT, 2, generator=None)
    assert proposer.reused_tokens == len(PROMPT) - 3
    assert draft.cached_tokens[:len(PROMPT)] == PROMPT
    # More missing than the window: it starts over from the window instead.
    draft = CachingLM(vocab_size=32, seed=5)
    draft.forward(PROMPT[:-10])
    proposer = DraftModelProposer(draft, GREEDY, 32, reuse_cache=True, prompt_window=4)
    proposer.begin(len(PROMPT))
    proposer.propose(PROMPT, 2, generator=None)
    assert draft.cached_tokens[:4] == PROMPT[-4:] and proposer.reused_tokens == 0


def test_the_window_counts_prompt_tokens_when_lookup_drafted_first() -> None:
    # The hybrid proposer's prompt lookup may take the first blocks: the draft's first call
    # then sees the prompt and 6 generated tokens. Its window still holds the prompt's last
    # 4 tokens, and it reads the generated ones after them.
    draft = CountingLM(vocab_size=32, seed=5)
    proposer = DraftModelProposer(draft, GREEDY, 32, prompt_window=4)
    proposer.begin(len(PROMPT))
    generated = [3, 9, 27, 1, 2, 5]
    proposer.propose(PROMPT + generated, 2, generator=None)
    assert draft.reads[0] == 4 + len(generated)
    assert draft._tokens[:4 + len(generated)] == PROMPT[-4:] + generated


def test_a_cached_prompt_is_kept_when_lookup_generated_more_than_the_window() -> None:
    # The draft's cache holds the whole prompt (a prefix cache's restore) and prompt lookup
    # generated 6 > 4 tokens before the draft's first block: no prompt token is missing,
    # so the draft keeps its cache and reads only the generated tokens.
    draft = CachingLM(vocab_size=32, seed=5)
    draft.forward(PROMPT)
    proposer = DraftModelProposer(draft, GREEDY, 32, reuse_cache=True, prompt_window=4)
    proposer.begin(len(PROMPT))
    proposer.propose(PROMPT + [3, 9, 27, 1, 2, 5], 2, generator=None)
    assert proposer.reused_tokens == len(PROMPT)
    assert draft.cached_tokens[:len(PROMPT) + 6] == PROMPT + [3, 9, 27, 1, 2, 5]


def test_draft_context_is_checked_and_reaches_the_loop() -> None:
    assert GenerationConfig(method="sd", draft_context=64).decode_config().draft_context == 64
    assert GenerationConfig().draft_context == 0  # the default: the whole prompt
    with pytest.raises(NSDError, match="draft_context must be a whole number >= 0"):
        GenerationConfig(method="sd", draft_context=-1)
    with pytest.raises(NSDError, match="draft_context must be"):
        GenerationConfig(method="sd", draft_context=2.5)


def test_the_engine_hands_the_window_to_its_draft() -> None:
    from mock import CharTokenizer
    from nsd.api import Engine

    draft = CountingLM(vocab_size=52, seed=2)
    engine = Engine.from_backends(MockLM(vocab_size=52, seed=1), CharTokenizer(), draft=draft,
                                  proposer="draft")
    prompt = "theDraftReadsOnlyTheEndOfThisPrompt"
    base = dict(method="sd", k=3, max_new_tokens=8)
    whole = engine.generate(prompt, GenerationConfig(**base))
    assert draft.reads[0] == len(prompt)
    draft.reads.clear()
    windowed = engine.generate(prompt, GenerationConfig(**base, draft_context=5))
    assert draft.reads[0] == 5 and windowed.text == whole.text


def test_the_window_is_timed_as_prefill_once(monkeypatch) -> None:
    # A fake clock that advances one second per token the draft reads: the prefill is the
    # window's 4 tokens exactly, and no later block adds to it (its context position is
    # past the prompt even though the draft's own cache starts at the window).
    from types import SimpleNamespace

    from nsd.proposers import draft_model

    draft = CountingLM(vocab_size=32, seed=5)
    clock = SimpleNamespace(now=0.0)
    original = draft.forward

    def timed(tokens, all_logits: bool = True):
        clock.now += len(tokens)
        return original(tokens, all_logits)

    draft.forward = timed
    monkeypatch.setattr(draft_model, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    proposer = DraftModelProposer(draft, GREEDY, 32, prompt_window=4)
    proposer.begin(len(PROMPT))
    proposer.propose(PROMPT, 3, generator=None)
    assert proposer.prefill_s == 4
    proposer.propose(PROMPT + [7, 8], 3, generator=None)
    assert proposer.prefill_s == 4 and clock.now > 4


def test_k_auto_prices_only_the_window_as_the_draft_catch_up() -> None:
    from nsd.draftlen.costmodel import FixedK

    class Recording(FixedK):
        def begin(self, prompt_tokens: int) -> None:
            self.behind = prompt_tokens
            super().begin(prompt_tokens)

    assert DecodeConfig(draft_context=4).draft_catchup(24) == 4
    assert DecodeConfig(draft_context=40).draft_catchup(24) == 24
    assert DecodeConfig().draft_catchup(24) == 24
    target, draft = MockLM(vocab_size=32, seed=0), MockLM(vocab_size=32, seed=5)
    for window, expected in ((0, len(PROMPT)), (4, 4)):
        policy = Recording(3)
        config = DecodeConfig(sampling=GREEDY, k=3, max_new_tokens=4, draft_context=window)
        run_to_end(decode(target, PROMPT, config, DraftModelProposer(draft, GREEDY, 32, prompt_window=window),
                          k_policy=policy))
        assert policy.behind == expected


def test_a_record_label_gives_back_its_k_and_draft_context() -> None:
    from nsd.bench.methods import expand_methods, spec_from_record

    for spec in expand_methods(["ar", "sd", "nsd"], [0.9], [], ["draft"], ks=["auto", 2], contexts=[0, 32]):
        record = {"method": spec.label, "family": spec.family, "proposer": spec.proposer,
                  "theta": spec.theta, "budget": spec.budget, "knobs": dict(spec.knobs)}
        assert spec_from_record(record) == spec
