"""Reduced-vocabulary drafts: id maps, the proposer's q on the full vocabulary, losslessness,
and a real GGUF rewrite loaded by llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mock import MockLM
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.models.draft_vocab import build_vocab_map, kept_ids
from nsd.proposers.draft_model import DraftModelProposer
from nsd.sampling import SamplingConfig

V = 16


def _map(keep: int = 6):
    tokens = [f"t{i}" for i in range(V)]
    types = [1] * (V - 2) + [3, 3]  # the last two are control tokens
    kept = kept_ids(tokens, types, keep)
    return kept, build_vocab_map(kept, V, placeholder=0)


def test_kept_ids_and_map_round_trip() -> None:
    kept, vmap = _map()
    assert kept.tolist() == [0, 1, 2, 3, 4, 5, 14, 15]
    assert vmap.to_draft([0, 5, 14, 15]) == [0, 5, 6, 7]
    assert vmap.to_draft([9]) == [0]  # dropped token -> placeholder
    full = vmap.expand(torch.full((8,), 1 / 8))
    assert full.shape == (V,) and full[[6, 7, 8]].tolist() == [0, 0, 0] and full.sum().item() == pytest.approx(1)


def _reduced_draft(kept: np.ndarray, seed: int) -> MockLM:
    full = MockLM(vocab_size=V, seed=seed)
    draft = MockLM(vocab_size=len(kept), seed=seed)
    idx = torch.from_numpy(kept)
    draft.table = full.table[idx][:, idx][:, :, idx].clone()
    return draft


def test_reduced_draft_q_lives_on_kept_tokens_and_sums_to_one() -> None:
    kept, vmap = _map()
    sampling = SamplingConfig(temperature=1.0)
    prop = DraftModelProposer(_reduced_draft(kept, 1), sampling, V, vmap)
    proposal = prop.propose([0, 1, 9], 3, torch.Generator().manual_seed(0))
    assert proposal.probs.shape == (3, V)
    dropped = [i for i in range(V) if i not in set(kept.tolist())]
    assert torch.all(proposal.probs[:, dropped] == 0)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(3))
    assert set(proposal.tokens.tolist()) <= set(kept.tolist())
    # q(x) > 0 for every drafted token: the exact test never divides by zero.
    assert torch.all(proposal.probs.gather(-1, proposal.tokens.unsqueeze(-1)) > 0)


def test_greedy_sd_with_reduced_draft_equals_ar() -> None:
    kept, vmap = _map(keep=10)
    target = MockLM(vocab_size=V, seed=1)
    greedy = SamplingConfig(temperature=0.0)
    ar, _ = run_to_end(decode(target, [1, 2], DecodeConfig(speculative=False, sampling=greedy,
                                                           max_new_tokens=40)))
    sd, stats = run_to_end(decode(target, [1, 2], DecodeConfig(sampling=greedy, k=3, max_new_tokens=40),
                                  DraftModelProposer(_reduced_draft(kept, 1), greedy, V, vmap)))
    assert sd == ar and stats.accepted_tokens > 0


@pytest.mark.llama
def test_reduced_gguf_loads_in_llama_cpp(tmp_path) -> None:
    pytest.importorskip("llama_cpp")
    from nsd.backends.llama_cpp import LlamaCppBackend
    from nsd.models.draft_vocab import reduce_gguf
    from nsd.models.registry import fetch_gguf

    src = fetch_gguf("smollm2-135m-instruct", progress=False)
    vmap = reduce_gguf(src, tmp_path / "small.gguf", keep=2000)
    assert not list(tmp_path.glob("*.partial-*"))
    full = LlamaCppBackend(src, n_threads=1, n_ctx=256)
    small = LlamaCppBackend(tmp_path / "small.gguf", n_threads=1, n_ctx=256)
    assert small.vocab_size == len(vmap.draft_to_target) < full.vocab_size
    ids = [1, 200, 300, 400, 500]  # all below 2000: unchanged ids in the reduced model
    a = full.forward(ids)[-1]
    b = small.forward(vmap.to_draft(ids))[-1]
    # The reduced model's logits are the full model's logits at the kept ids.
    assert torch.allclose(a[vmap.draft_to_target], b, atol=1e-3)
