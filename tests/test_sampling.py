"""The logits → probabilities transform: top-p's fast path keeps exactly the tokens a
full stable sort keeps (ties included), and every filter renormalises."""

from __future__ import annotations

import pytest
import torch

from nsd.rules import sampling
from nsd.rules.sampling import SamplingConfig, logits_to_probs


def reference_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by a full stable descending sort: keep token i while the mass before it is
    below top_p (ties at the cut: lowest ids first)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def rows(seed: int, vocab: int = 5000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    peaked = torch.randn(4, vocab, generator=gen) * 4.0  # nucleus of a few dozen tokens
    flat = torch.randn(2, vocab, generator=gen) * 0.3  # nucleus of thousands: the sort path
    # Ties at the cut: a row of a few equal top values and many equal small ones.
    tied = torch.full((2, vocab), -5.0)
    tied[0, [7, 3, 900, 12]] = 2.0
    tied[1, :40] = 1.0
    return torch.cat([torch.softmax(peaked, -1), torch.softmax(flat, -1), torch.softmax(tied, -1)])


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_matches_a_full_stable_sort(top_p: float, seed: int) -> None:
    probs = rows(seed)
    for batch in (probs, probs[:4], probs[6:]):  # fast path alone, sort path, ties
        got, want = sampling._top_p_filter(batch, top_p), reference_top_p(batch, top_p)
        assert torch.equal(got > 0, want > 0)  # the same kept set, ties included
        assert torch.allclose(got, want, rtol=1e-6, atol=0)  # renormalised alike (summation order aside)


def test_top_p_fast_path_is_taken_for_a_peaked_row(monkeypatch) -> None:
    probs = rows(0)[:4]
    calls = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: calls.append(1) or real_sort(*a, **k))
    sampling._top_p_filter(probs, 0.9)
    assert not calls  # no full sort for nuclei inside the first candidates
    sampling._top_p_filter(rows(0)[4:6], 0.9)
    assert calls  # and a sort where the nucleus is wider


def test_filters_renormalise_and_greedy_is_one_hot() -> None:
    logits = torch.log(rows(3))
    for config in (SamplingConfig(0.8, top_p=0.9), SamplingConfig(1.0, top_k=5),
                   SamplingConfig(0.7, min_p=0.1), SamplingConfig(0.8, top_k=50, top_p=0.9, min_p=0.05)):
        probs = logits_to_probs(logits, config)
        assert torch.allclose(probs.sum(-1), torch.ones(len(probs)), atol=1e-5)
    greedy = logits_to_probs(logits, SamplingConfig(0.0))
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.equal(greedy.sum(-1), torch.ones(len(logits)))
