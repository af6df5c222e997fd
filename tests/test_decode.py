"""The decoding loop on mock models: losslessness, draft = target, reproducibility,
sequence-level fidelity, stopping, and the n-gram proposer."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mock import ByteTokenizer, CharTokenizer, MockLM, ScriptLM, cycle_lm
from nsd.api import Engine, GenerationConfig
from nsd.stops import StopScanner
from nsd.draftlen.costmodel import AdaptiveK
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.errors import NSDError
from nsd.proposers.base import Proposal, Proposer
from nsd.proposers.draft_model import DraftModelProposer
from nsd.proposers.ngram import NgramConfig, NgramProposer
from nsd.rules.sampling import SamplingConfig
from nsd.rules.verify import RuleConfig

GREEDY = SamplingConfig(temperature=0.0)
SAMPLE = SamplingConfig(temperature=1.0)


def _run(target, config, proposer=None, prompt=(1, 2, 3), **kw):
    return run_to_end(decode(target, list(prompt), config, proposer, **kw))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_sd_equals_ar(k: int) -> None:
    target = MockLM(vocab_size=32, seed=0)
    ar_tokens, ar_stats = _run(target, DecodeConfig(speculative=False, sampling=GREEDY, max_new_tokens=40))
    draft = MockLM(vocab_size=32, seed=0, sharpness=1.0)  # same argmax structure, flatter
    draft.table += 2.0 * torch.randn(draft.table.shape, generator=torch.Generator().manual_seed(1))
    sd_tokens, sd_stats = _run(target, DecodeConfig(sampling=GREEDY, k=k, max_new_tokens=40),
                               DraftModelProposer(draft, GREEDY, target.vocab_size))
    assert sd_tokens == ar_tokens
    assert ar_stats.target_passes == 40 and ar_stats.tau == 1.0
    assert sd_stats.new_tokens == 40 and sd_stats.deviation == 0.0
    assert 0 < sd_stats.accepted_tokens < sd_stats.drafted_tokens  # a real mix of accepts/rejects
    assert sd_stats.target_passes < 40


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE])
def test_draft_equal_to_target_accepts_everything(sampling: SamplingConfig) -> None:
    target, draft = MockLM(seed=3), MockLM(seed=3)
    tokens, stats = _run(target, DecodeConfig(sampling=sampling, k=4, max_new_tokens=50),
                         DraftModelProposer(draft, sampling, target.vocab_size))
    assert stats.accepted_tokens == stats.drafted_tokens > 0
    assert stats.deviation == 0.0
    assert stats.tau == pytest.approx(50 / stats.target_passes) and stats.tau > 4.5
    assert all(r == 1.0 for r in stats.acceptance_by_position)


def test_seeded_runs_are_reproducible_and_seeds_matter() -> None:
    def run(seed: int):
        target, draft = MockLM(seed=4), MockLM(seed=5)
        cfg = DecodeConfig(rule=RuleConfig(kind="nucleus", theta=0.8), sampling=SAMPLE, k=3,
                           max_new_tokens=30, seed=seed)
        return _run(target, cfg, DraftModelProposer(draft, SAMPLE))
    (a, sa), (b, sb), (c, _) = run(7), run(7), run(8)
    assert a == b and sa.accepted_per_pass == sb.accepted_per_pass and sa.deviation == sb.deviation
    assert a != c


def test_greedy_smooth_budget_output_does_not_depend_on_the_seed() -> None:
    # At temperature 0 a relaxed accept costs E = 1; a smooth budget with a fractional
    # remainder relaxes all-or-nothing there, so the seed (which only feeds the uniforms)
    # cannot change a greedy output, its statistics or its D.
    target = MockLM(vocab_size=32, seed=6, sharpness=1.0)
    draft = MockLM(vocab_size=32, seed=7, sharpness=1.0)
    runs = []
    for seed in range(8):
        cfg = DecodeConfig(rule=RuleConfig(kind="nucleus", theta=0.9, budget=2.5, smooth=True),
                           sampling=GREEDY, k=4, max_new_tokens=60, seed=seed)
        tokens, stats = _run(target, cfg, DraftModelProposer(draft, GREEDY))
        runs.append((tokens, stats.accepted_per_pass, stats.relaxed_accepts, stats.deviation))
    assert all(run == runs[0] for run in runs[1:])
    assert runs[0][3] == 2.0 and runs[0][2] == 2  # two whole relaxed accepts; the 0.5 left unspent


def test_nsd_greedy_accepts_more_and_reports_deviation() -> None:
    target = MockLM(vocab_size=32, seed=6, sharpness=1.0)
    draft = MockLM(vocab_size=32, seed=7, sharpness=1.0)
    sd = _run(target, DecodeConfig(sampling=GREEDY, k=4, max_new_tokens=60),
              DraftModelProposer(draft, GREEDY))[1]
    nsd = _run(target, DecodeConfig(rule=RuleConfig(kind="nucleus", theta=0.9), sampling=GREEDY, k=4,
                                    max_new_tokens=60), DraftModelProposer(draft, GREEDY))[1]
    assert nsd.tau > sd.tau
    assert nsd.relaxed_accepts > 0
    assert nsd.deviation == pytest.approx(nsd.relaxed_accepts)  # greedy: each relaxed accept costs 1
    budget = _run(target, DecodeConfig(rule=RuleConfig(kind="nucleus", theta=0.9, budget=2.0),
                                       sampling=GREEDY, k=4, max_new_tokens=60),
                  DraftModelProposer(draft, GREEDY))[1]
    assert budget.deviation <= 2.0 and budget.relaxed_accepts <= 2


@pytest.mark.parametrize("rule", [RuleConfig(kind="nucleus", theta=0.9), RuleConfig(kind="typical"),
                                  RuleConfig(kind="nucleus", theta=0.9, budget=1.5)])
def test_per_position_counts_add_up_over_many_blocks(rule: RuleConfig) -> None:
    # Sampled, several blocks of k = 4 with rejections at different positions: each
    # position's counts are over the blocks that reached it, and they add up to the totals.
    target = MockLM(vocab_size=32, seed=6, sharpness=1.0)
    draft = MockLM(vocab_size=32, seed=7, sharpness=1.0)
    sampling = SamplingConfig(temperature=1.0)
    stats = _run(target, DecodeConfig(rule=rule, sampling=sampling, k=4, max_new_tokens=80, seed=3),
                 DraftModelProposer(draft, sampling))[1]
    n = len(stats.position_attempts)
    assert n == 4 and len(stats.position_relaxed) == n and len(stats.position_deviation) == n
    # Else the test shows nothing (with a budget E is charged while it lasts, whether or
    # not a relaxed accept happens, and here it ran out before one did).
    assert stats.deviation > 0 and (stats.relaxed_accepts > 0 or rule.budget < math.inf)
    assert sum(stats.position_relaxed) == stats.relaxed_accepts
    assert math.isclose(sum(stats.position_deviation), stats.deviation, rel_tol=1e-12)
    assert all(r <= a <= t for r, a, t in zip(stats.position_relaxed, stats.position_accepts,
                                               stats.position_attempts))
    assert all(d >= 0 for d in stats.position_deviation)
    # Later positions are reached by fewer blocks, so their counts are not all the same.
    assert stats.position_attempts[0] > stats.position_attempts[-1]


def _exact_sequence_probs(target: MockLM, prompt: list[int], length: int, v: int,
                          law=lambda logits: torch.softmax(logits, -1).tolist()) -> dict:
    """Every sequence of ``length`` tokens with positive probability under ``law`` (logits
    -> next-token probabilities; by default the plain softmax), and that probability."""
    probs = {}
    for seq in itertools.product(range(v), repeat=length):
        ctx, pr = list(prompt), 1.0
        for tok in seq:
            pr *= law(target.logits_after(ctx))[tok]
            ctx.append(tok)
        if pr > 0:
            probs[seq] = pr
    return probs


def _empirical(config: DecodeConfig, n: int, v: int, length: int):
    target, draft = MockLM(vocab_size=v, seed=10, sharpness=1.5), MockLM(vocab_size=v, seed=11, sharpness=1.5)
    counts: dict = {}
    deviations = []
    for seed in range(n):
        tokens, stats = _run(target, DecodeConfig(**{**config.__dict__, "seed": seed}),
                             DraftModelProposer(draft, SAMPLE), prompt=(1, 2))
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
        deviations.append(stats.deviation)
    return target, counts, sum(deviations) / n


def test_sequence_level_distribution_exact_and_nsd_bound() -> None:
    v, length, n = 4, 3, 4000
    base = dict(sampling=SAMPLE, k=2, max_new_tokens=length)
    target, counts, mean_dev = _empirical(DecodeConfig(rule=RuleConfig(kind="exact"), **base), n, v, length)
    exact = _exact_sequence_probs(target, [1, 2], length, v)
    chi2 = sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in exact.items())
    dof = len(exact) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), chi2  # exact SD samples the target's sequences
    assert mean_dev == 0.0

    _, counts, mean_dev = _empirical(DecodeConfig(rule=RuleConfig(kind="nucleus", theta=0.9), **base), n, v, length)
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - p) for s, p in exact.items())
    # Empirical TV carries a positive sampling bias of about Σ sqrt(p/n)/2 ≈ 0.05 here.
    noise = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in exact.values())
    assert mean_dev > 0.05
    assert tv <= mean_dev + 2 * noise, (tv, mean_dev, noise)


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> list[float]:
    """The sampling law written out independently of nsd.rules.sampling, in float64: top-k on the
    logits (every token tied with the k-th kept), temperature, the smallest most-probable
    set whose mass reaches top-p, then min-p relative to the most probable survivor."""
    values = [float(x) for x in logits.double()]
    order = sorted(range(len(values)), key=lambda i: -values[i])
    kept = [i for i in order if values[i] >= values[order[top_k - 1]]] if top_k else order
    weights = {i: math.exp(values[i] / temperature) for i in kept}
    total = sum(weights.values())
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += weights[i] / total
    floor = min_p * max(weights[i] for i in nucleus)
    final = [i for i in nucleus if weights[i] >= floor]
    z = sum(weights[i] for i in final)
    return [weights[i] / z if i in final else 0.0 for i in range(len(values))]


@pytest.mark.parametrize("speculative", [False, True])
def test_sequence_law_with_temperature_top_k_top_p_and_min_p(speculative: bool) -> None:
    # The loop's law when every filter is on (the frontier's sampled runs use 0.8 / 0.95):
    # AR and exact SD must both sample the target's filtered sequence law, which the
    # reference above computes without nsd's own transform.
    v, length, n = 6, 3, 3000
    # Each filter binds here: dropping any one of them puts 3.5-5.5% of the mass outside this
    # support, and temperature 0.7 instead of 0.8 moves the chi-square by about 800.
    knobs = dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.2)
    sampling = SamplingConfig(**knobs)
    target = MockLM(vocab_size=v, seed=20, sharpness=1.2)
    draft = MockLM(vocab_size=v, seed=21, sharpness=1.2)
    exact = _exact_sequence_probs(target, [1, 2], length, v,
                                  lambda logits: _reference_probs(logits, **knobs))
    counts: dict[tuple, int] = {}
    for seed in range(n):
        config = DecodeConfig(speculative=speculative, sampling=sampling, k=2, max_new_tokens=length, seed=seed)
        proposer = DraftModelProposer(draft, sampling) if speculative else None
        tokens, _ = _run(target, config, proposer, prompt=(1, 2))
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    assert set(counts) <= set(exact)  # nothing outside the filtered support, ever
    # Pearson chi-square over the sequences expected >= 5 times, the rest pooled into one
    # cell (when there is a rest: a pooled cell of float leftovers would add a false dof).
    big = [s for s, p in exact.items() if n * p >= 5]
    cells = [(counts.get(s, 0), n * exact[s]) for s in big]
    rest = sum(p for s, p in exact.items() if n * p < 5)
    if rest > 0:
        cells.append((n - sum(o for o, _ in cells), n * rest))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    assert dof >= 10, dof  # the law has room to be wrong
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


def test_eos_and_stop_check_and_length() -> None:
    target = MockLM(seed=12)
    tokens, _ = _run(target, DecodeConfig(speculative=False, sampling=GREEDY, max_new_tokens=30))
    eos = tokens[5]
    first = tokens.index(eos)
    out, stats = _run(target, DecodeConfig(sampling=GREEDY, k=4, max_new_tokens=30),
                      DraftModelProposer(MockLM(seed=12), GREEDY), eos_token_ids=[eos])
    assert out == tokens[:first + 1] and stats.stop_reason == "eos"
    out, stats = _run(target, DecodeConfig(sampling=GREEDY, k=4, max_new_tokens=30),
                      DraftModelProposer(MockLM(seed=12), GREEDY), stop_check=lambda g: len(g) >= 7)
    assert stats.stop_reason == "stop" and out == tokens[:len(out)] and len(out) >= 7
    out, stats = _run(target, DecodeConfig(sampling=GREEDY, k=8, max_new_tokens=3),
                      DraftModelProposer(MockLM(seed=12), GREEDY))
    assert out == tokens[:3] and stats.stop_reason == "length"


def test_ngram_proposer() -> None:
    prop = NgramProposer(NgramConfig(max_ngram=2))
    gen = torch.Generator()
    p = prop.propose([5, 6, 7, 8, 9, 5, 6], 3, gen)
    assert p.tokens.tolist() == [7, 8, 9] and p.probs is None
    assert prop.propose([1, 2, 3], 3, gen).tokens.numel() == 0  # nothing to copy
    assert prop.propose([1, 2, 1], 4, gen).tokens.tolist() == [2, 1]  # unigram fallback, short
    with pytest.raises(NSDError):
        NgramConfig(min_ngram=0)


def test_ngram_sd_is_lossless_greedy() -> None:
    target = MockLM(vocab_size=8, seed=13)  # small vocab: repetitive text, n-grams hit
    ar, _ = _run(target, DecodeConfig(speculative=False, sampling=GREEDY, max_new_tokens=60))
    sd, stats = _run(target, DecodeConfig(sampling=GREEDY, k=4, max_new_tokens=60), NgramProposer())
    assert sd == ar and stats.accepted_tokens > 0 and stats.target_passes < 60
    # k_per_pass says what was drafted, not the k asked for: lookup finds fewer tokens
    # (often none) where the context does not repeat.
    assert len(stats.k_per_pass) == stats.target_passes
    assert sum(stats.k_per_pass) == stats.drafted_tokens
    assert 0 in stats.k_per_pass and len(stats.accepted_per_pass) == sum(k > 0 for k in stats.k_per_pass)


def test_adaptive_k_policy() -> None:
    pol = AdaptiveK(k=4, k_max=6)
    pol.observe(4, 4, 4, 0.0, 0.0, 0.0)
    assert pol.k == 6
    pol.observe(6, 6, 6, 0.0, 0.0, 0.0)
    assert pol.k == 6
    pol.observe(6, 6, 2, 0.0, 0.0, 0.0)
    assert pol.k == 5
    target = MockLM(seed=3)
    _, stats = _run(target, DecodeConfig(sampling=GREEDY, k=2, adaptive_k=True, k_max=8, max_new_tokens=40),
                    DraftModelProposer(MockLM(seed=3), GREEDY))
    assert max(len(stats.position_attempts), 0) == 8  # grew to k_max with an exact draft


def test_bad_inputs() -> None:
    with pytest.raises(NSDError, match="empty"):
        _run(MockLM(), DecodeConfig(speculative=False), prompt=())
    with pytest.raises(NSDError):
        DecodeConfig(k=0)
    with pytest.raises(NSDError):
        DecodeConfig(max_new_tokens=0)
    with pytest.raises(NSDError, match="vocabularies differ"):
        DraftModelProposer(MockLM(vocab_size=8), GREEDY, target_vocab_size=16)


# --------------------------------------------------------------------------- stop strings


def _mock_engine(target: MockLM, tokenizer: CharTokenizer) -> Engine:
    """A real :class:`Engine` around a mock target and n-gram drafts (no weights loaded)."""
    return Engine.from_backends(target, tokenizer, proposer="ngram", eos_token_ids=())


@pytest.mark.parametrize("k", [3, 30])
@pytest.mark.parametrize("stop", ["jk", "ij"])
def test_stop_string_found_however_many_tokens_a_pass_adds(k: int, stop: str) -> None:
    # Periodic greedy text a..N; the prompt holds one period, then "abcde", so n-gram lookup
    # drafts up to 30 tokens a pass and the target accepts them all. At k = 30 one pass adds
    # 31 tokens: a stop string early in it lies outside any fixed-size tail of the output.
    v = 40
    tokenizer = CharTokenizer()
    engine = _mock_engine(cycle_lm(v), tokenizer)
    prompt = list(range(v)) + list(range(5))
    result = engine.generate(prompt, GenerationConfig(method="sd", k=k, max_new_tokens=200, stop=(stop,)))
    stats, tokens = result.stats, result.token_ids
    assert result.text == {"jk": "fghi", "ij": "fgh"}[stop]
    assert stats.stop_reason == "stop"
    assert stats.new_tokens == len(tokens) and len(stats.accepted_per_pass) == stats.target_passes
    # Generation ends with the pass that completes the stop string, whatever its size.
    last_pass = stats.accepted_per_pass[-1] + 1
    assert stop in tokenizer.decode(tokens) and stop not in tokenizer.decode(tokens[:-last_pass])
    if k == 30:
        assert stats.target_passes == 1 and stats.new_tokens == 31


def test_stop_scanner_does_not_count_replacement_characters_towards_its_margin() -> None:
    # Byte tokens: six emoji are 24 tokens, and the stop string's last byte arrives in a later
    # pass. The re-decoded margin starts inside an emoji, whose stray bytes render as three
    # U+FFFD; counted as characters they would end the margin one emoji short of the stop
    # string's start.
    stop = "\U0001F642" * 6
    tokenizer = ByteTokenizer()
    generated = tokenizer.encode("ab" + stop)
    scan = StopScanner(tokenizer, (stop,))
    assert not scan(generated[:-1])
    assert scan(generated)


@pytest.mark.parametrize("method,k", [("ar", 4), ("sd", 3), ("sd", 7)])
def test_emoji_stop_string_split_into_byte_tokens_stops_decoding(method: str, k: int) -> None:
    stop = "\U0001F642" * 6
    tokenizer = ByteTokenizer()
    script = tokenizer.encode("ab" + stop + "tail text after the stop string " * 4)
    engine = Engine.from_backends(ScriptLM(script), tokenizer, proposer="ngram", eos_token_ids=())
    result = engine.generate(script[:1], GenerationConfig(method=method, k=k, max_new_tokens=120,
                                                          stop=(stop,)))
    assert result.text == "b"
    assert result.stats.stop_reason == "stop"
    # Decoding ends with the pass that completes the stop string.
    assert tokenizer.encode(stop) == result.token_ids[1:1 + len(tokenizer.encode(stop))]
    assert len(result.token_ids) <= 1 + len(tokenizer.encode(stop)) + k


# --------------------------------------------------------------------------- EOS inside a block


class ScriptedProposer(Proposer):
    """Deterministic drafts (one-hot q) from a fixed script, whatever the context."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, context, k: int, generator: torch.Generator, lookup: bool = False) -> Proposal:
        return Proposal(torch.tensor(self.tokens[:k], dtype=torch.long), None)


def test_statistics_count_only_tokens_emitted_before_an_accepted_eos() -> None:
    # Target continues 0 → 1 → 2 …; the 8 drafts all match it and EOS (6) is draft 6 of 8.
    target = cycle_lm(16)
    tokens, stats = _run(target, DecodeConfig(sampling=GREEDY, k=8, max_new_tokens=50),
                         ScriptedProposer([1, 2, 3, 4, 5, 6, 7, 8]), prompt=(0,), eos_token_ids=[6])
    assert tokens == [1, 2, 3, 4, 5, 6] and stats.stop_reason == "eos"
    assert stats.new_tokens == 6 and stats.target_passes == 1
    assert stats.accepted_tokens == 6 and stats.accepted_per_pass == [6]
    assert stats.drafted_tokens == 6  # drafts after the EOS were never candidates for output
    assert stats.position_attempts == [1] * 6 and stats.position_accepts == [1] * 6
    assert stats.position_relaxed == [0] * 6 and stats.position_deviation == [0.0] * 6  # exact SD
    assert stats.acceptance_rate == 1.0


def test_deviation_charged_only_for_positions_emitted_before_an_accepted_eos() -> None:
    # Greedy NSD over a flat-ish target (θ = 0.99 nucleus holds every token): drafts 9 (EOS)
    # and 14 are not the argmax, so each is a relaxed accept costing E = 1. The EOS is
    # emitted and pays; draft 14 after it is not emitted and must not.
    target = cycle_lm(16, margin=3.0)
    rule = RuleConfig(kind="nucleus", theta=0.99)
    tokens, stats = _run(target, DecodeConfig(rule=rule, sampling=GREEDY, k=8, max_new_tokens=50),
                         ScriptedProposer([1, 2, 3, 4, 5, 9, 14, 15]), prompt=(0,), eos_token_ids=[9])
    assert tokens == [1, 2, 3, 4, 5, 9] and stats.stop_reason == "eos"
    assert stats.relaxed_accepts == 1
    assert stats.deviation == 1.0
    assert stats.accepted_tokens == 6 and stats.accepted_per_pass == [6]
    # By position: the relaxed accept and its charge sit at draft position 6 (the EOS), and
    # nothing is charged at position 7, which was drafted but not emitted.
    assert stats.position_relaxed == [0, 0, 0, 0, 0, 1]
    assert stats.position_deviation == [0.0] * 5 + [1.0]
    assert sum(stats.position_deviation) == stats.deviation
    # The budget state agrees with the report: B = 1 exactly covers the one emitted charge.
    tokens, budgeted = _run(target, DecodeConfig(rule=RuleConfig(kind="nucleus", theta=0.99, budget=1.0),
                                                 sampling=GREEDY, k=8, max_new_tokens=50),
                            ScriptedProposer([1, 2, 3, 4, 5, 9, 14, 15]), prompt=(0,), eos_token_ids=[9])
    assert tokens == [1, 2, 3, 4, 5, 9] and budgeted.deviation == 1.0 and budgeted.relaxed_accepts == 1


def test_stop_scanner_reaches_back_past_tokens_that_decode_to_nothing() -> None:
    # "j", forty tokens that render as "" (special tokens, byte pieces), then "k" in a later
    # pass: the straddling stop string lies beyond any fixed number of earlier tokens.
    class PieceTokenizer:
        pieces = ["", "j", "k", "x"]

        def decode(self, tokens, skip_special_tokens: bool = False) -> str:
            return "".join(self.pieces[t] for t in tokens)

    scan = StopScanner(PieceTokenizer(), ("jk",))
    generated = [3, 1] + [0] * 40
    assert not scan(generated)
    generated += [2]
    assert scan(generated)


class _ClockedLM(MockLM):
    """A draft whose forwards advance a fake clock by one second per token read, and that
    records each forward's length: the draft's timings become exact token counts, whatever
    the load on the machine."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.now = 0.0
        self.reads: list[int] = []

    def forward(self, tokens, all_logits: bool = True):
        self.now += len(tokens)
        self.reads.append(len(tokens))
        return super().forward(tokens, all_logits)


def test_the_draft_reading_the_prompt_is_reported_apart_from_its_blocks(monkeypatch) -> None:
    from types import SimpleNamespace

    from nsd import decode as decode_module
    from nsd.proposers import draft_model

    target = MockLM(vocab_size=32, seed=0)  # its forwards take no time on the fake clock
    lm = _ClockedLM(vocab_size=32, seed=0)
    for module in (draft_model, decode_module):  # the proposer's clock and the loop's alike
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: lm.now))
    draft = DraftModelProposer(lm, GREEDY, target.vocab_size)
    prompt = tuple(range(1, 9))
    config = DecodeConfig(sampling=GREEDY, k=3, max_new_tokens=12)
    _, stats = _run(target, config, draft, prompt=prompt)
    # Only the first forward read the prompt: its tokens are the count, no block's are.
    assert lm.reads[0] >= len(prompt) and len(lm.reads) > 1
    assert stats.draft_prefill_s == lm.reads[0]
    assert stats.propose_s == sum(lm.reads) > stats.draft_prefill_s
    assert stats.to_dict()["draft_prefill_s"] == stats.draft_prefill_s
    # Again with the same proposer: its cache holds the prompt, so it reads from the last
    # prompt token on, and begin() started the count afresh.
    first_of_again = len(lm.reads)
    _, again = _run(target, config, draft, prompt=prompt)
    assert 0 < lm.reads[first_of_again] < len(prompt)
    assert again.draft_prefill_s == lm.reads[first_of_again]
    _, lookup = _run(target, DecodeConfig(sampling=GREEDY, k=3, max_new_tokens=12), NgramProposer(NgramConfig()),
                     prompt=prompt)
    assert lookup.draft_prefill_s == 0.0
