"""The decoding runs whose tokens ``test_pinned_outputs`` pins: mock models, fixed seeds.

Each case returns what identifies a run's path through the loop: the tokens, and the
per-pass draft and accept counts with the deviation charged (rounded).
"""

from __future__ import annotations

import threading

import torch

from mock import CharTokenizer, MockLM
from nsd.api import Engine, GenerationConfig
from nsd.draftlen.costmodel import AcceptanceTracker, CostModelK, StepCosts
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.proposers.draft_model import DraftModelProposer
from nsd.proposers.hybrid import HybridProposer
from nsd.proposers.ngram import NgramConfig, NgramProposer
from nsd.rules.sampling import SamplingConfig
from nsd.rules.verify import RuleConfig

V = 16
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
GREEDY = SamplingConfig()
WARM = SamplingConfig(temperature=0.8, top_p=0.95)


def _signature(tokens, stats) -> tuple:
    return (tokens, stats.k_per_pass, stats.accepted_per_pass, stats.relaxed_accepts,
            round(stats.deviation, 6))


def _near_draft() -> MockLM:
    """The target's table plus noise: a draft that agrees often, not always."""
    draft = MockLM(vocab_size=V, seed=30, sharpness=3.0)
    draft.table = draft.table + 1.5 * torch.randn(draft.table.shape,
                                                  generator=torch.Generator().manual_seed(31))
    return draft


def _draft(sampling: SamplingConfig) -> DraftModelProposer:
    return DraftModelProposer(_near_draft(), sampling)


def _policy(seed: int, lookup: bool) -> CostModelK:
    costs = StepCosts(tuple(0.04 * (1 + 0.05 * n) for n in range(7)), draft=0.01)
    return CostModelK(costs, AcceptanceTracker(6), k_max=6, seed=seed,
                      lookup_tracker=AcceptanceTracker(6, prior=0.9) if lookup else None)


def _run(config: DecodeConfig, proposer=None, policy=None) -> tuple:
    target = MockLM(vocab_size=V, seed=30, sharpness=3.0)
    return _signature(*run_to_end(decode(target, PROMPT, config, proposer, k_policy=policy)))


def _rule(method: str, **kw) -> RuleConfig:
    return RuleConfig.for_method(method, **kw)


def decode_cases() -> dict[str, tuple]:
    out = {}
    for name, sampling in (("greedy", GREEDY), ("warm", WARM)):
        out[f"ar-{name}"] = _run(DecodeConfig(speculative=False, sampling=sampling,
                                              max_new_tokens=24, seed=5))
        for method, kw in (("sd", {}), ("nsd", {"theta": 0.9}), ("typical", {}),
                           ("nsd-budget", {"theta": 0.9, "budget": 0.5}),
                           ("nsd-smooth", {"theta": 0.9, "budget": 0.7, "smooth": True}),
                           ("nsd-cap", {"theta": 0.95, "cap": 0.6})):
            rule = _rule(method.split("-")[0], **kw)
            config = DecodeConfig(rule=rule, sampling=sampling, k=3, max_new_tokens=24, seed=5)
            out[f"{method}-{name}-k3"] = _run(config, _draft(sampling))
        rule = _rule("nsd", theta=0.9)
        out[f"nsd-{name}-adaptive"] = _run(
            DecodeConfig(rule=rule, sampling=sampling, k=2, adaptive_k=True, k_max=6,
                         max_new_tokens=24, seed=7), _draft(sampling))
        out[f"nsd-{name}-ngram"] = _run(
            DecodeConfig(rule=rule, sampling=sampling, k=4, max_new_tokens=24, seed=7),
            NgramProposer(NgramConfig(max_ngram=2)))
        out[f"nsd-{name}-hybrid-k3"] = _run(
            DecodeConfig(rule=rule, sampling=sampling, k=3, max_new_tokens=24, seed=7),
            HybridProposer(_draft(sampling), NgramProposer()))
        auto = DecodeConfig(rule=rule, sampling=sampling, auto_k=True, k_max=6,
                            max_new_tokens=24, seed=9)
        out[f"nsd-{name}-auto"] = _run(auto, _draft(sampling), _policy(9, lookup=False))
        out[f"nsd-{name}-auto-hybrid"] = _run(
            auto, HybridProposer(_draft(sampling), NgramProposer()), _policy(9, lookup=True))
    return out


def engine_cases() -> dict[str, tuple]:
    """Through the Engine, alone and as two slots of a batch decoding at once."""
    out = {}
    configs = {"nsd-warm": GenerationConfig(method="nsd", theta=0.9, k=3, max_new_tokens=20,
                                            temperature=0.8, seed=11),
               "sd-greedy": GenerationConfig(method="sd", k=2, max_new_tokens=20)}
    for name, config in configs.items():
        engine = Engine.from_backends(MockLM(vocab_size=V, seed=30), CharTokenizer(),
                                      draft=_near_draft(), proposer="draft")
        result = engine.generate(PROMPT, config)
        out[f"engine-{name}"] = _signature(result.token_ids, result.stats)
    engine = Engine.from_backends(MockLM(vocab_size=V, seed=30), CharTokenizer(),
                                  draft=_near_draft(), proposer="hybrid")
    slots, batcher = engine.batched(2)
    results: list = [None, None]
    ready = threading.Barrier(2)
    batch_configs = list(configs.values())

    def run(i: int) -> None:
        with batcher.member():
            ready.wait()
            results[i] = slots[i].generate(PROMPT[i:], batch_configs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, name in enumerate(configs):
        out[f"batched-{name}"] = _signature(results[i].token_ids, results[i].stats)
    return out


def ragged_cases() -> dict[str, tuple]:
    """verify_ragged on a random flat batch (greedy and sampled requests, seeded)."""
    from nsd.rules.ragged import verify_ragged

    out = {}
    gen = torch.Generator().manual_seed(4)
    counts = [4, 0, 3, 2, 4, 1]
    num = sum(counts)
    logits = 3.0 * torch.randn(num, V, generator=gen)
    q = torch.softmax(logits + 2.0 * torch.randn(num, V, generator=gen), -1)
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    probs = torch.softmax(logits, -1)
    bonus = torch.randint(0, V, (len(counts),), generator=gen)
    greedy = torch.tensor([True, False, False, True, False, False])
    uniforms = torch.rand(num, dtype=torch.float64, generator=gen)
    recovered = torch.randint(0, V, (num,), generator=gen)
    cu = torch.tensor(counts).cumsum(0)
    for name, rule in (("exact", RuleConfig(kind="exact")),
                       ("nsd", RuleConfig(kind="nucleus", theta=0.9)),
                       ("nsd-budget", RuleConfig(kind="nucleus", theta=0.9, budget=0.8)),
                       ("nsd-smooth", RuleConfig(kind="nucleus", theta=0.9, budget=0.8, smooth=True))):
        for with_q in (True, False):
            result = verify_ragged(rule, probs, logits.argmax(-1), drafts, cu, 4,
                                   q if with_q else None, bonus, greedy, uniforms, recovered,
                                   torch.zeros(len(counts), dtype=torch.float64))
            out[f"ragged-{name}-{'q' if with_q else 'onehot'}"] = (
                result.output_token_ids.tolist(), [round(float(x), 6) for x in result.spent])
    return out
