"""Reduced-vocabulary drafts: the frequency ranking, id maps, the proposer's q on the full
vocabulary, losslessness, and a real GGUF rewrite fed input embeddings in llama.cpp."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mock import MockLM
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.models.draft_vocab import build_vocab_map, kept_ids
from nsd.proposers.draft_model import DraftModelProposer
from nsd.rules.sampling import SamplingConfig
from nsd.models.token_rank import corpus_files, rank
from nsd.rules.verify import RuleConfig

V = 16
TYPES = [1] * (V - 2) + [3, 3]  # the last two are control tokens


def test_rank_is_by_count_then_id() -> None:
    counts = np.array([0, 5, 2, 5, 0, 9])
    assert rank(counts).tolist() == [5, 1, 3, 2, 0, 4]
    assert rank(counts).tolist() == rank(counts.copy()).tolist()


def test_kept_ids_are_the_most_frequent_regular_tokens_plus_every_special_one() -> None:
    counts = np.zeros(V, dtype=np.int64)
    counts[[9, 3, 12, 14]] = [50, 40, 40, 99]  # 14 is special: kept anyway, takes no slot
    kept = kept_ids(TYPES, 4, counts)
    assert kept.tolist() == [0, 3, 9, 12, 14, 15]  # 9, then 3 and 12 (tie by id), then unseen 0
    assert kept_ids(TYPES, 4).tolist() == [0, 1, 2, 3, 14, 15]  # no counts: the first ids
    assert kept_ids(TYPES, 4, counts).tolist() == kept.tolist()


def test_vocab_map_expands_q_with_zeros() -> None:
    vmap = build_vocab_map(np.array([0, 5, 14, 15]), V)
    full = vmap.expand(torch.full((4,), 0.25))
    assert full.shape == (V,) and full[[0, 5, 14, 15]].tolist() == [0.25] * 4
    assert full.sum().item() == pytest.approx(1) and int((full > 0).sum()) == 4


def test_corpus_is_sorted_and_skips_tests_and_other_files(tmp_path: Path) -> None:
    std, pkgs = tmp_path / "lib", tmp_path / "site"
    for rel in ("b.py", "a/z.md", "a/b.txt", "test/t.py", "x.so", "c/tests/u.py"):
        (std / rel).parent.mkdir(parents=True, exist_ok=True)
        (std / rel).write_text("x")
    for rel in ("p-1.0.dist-info/METADATA", "p/README.md", "p/mod.py", "p/METADATA"):
        (pkgs / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkgs / rel).write_text("x")
    files = [p.relative_to(tmp_path).as_posix() for p in corpus_files([std, pkgs])]
    assert files == ["lib/a/b.txt", "lib/a/z.md", "lib/b.py", "site/p-1.0.dist-info/METADATA",
                     "site/p/README.md"]


class KeptColumns:
    """A reduced draft as nsd runs one: fed full-vocabulary ids, logits over ``kept`` only."""

    def __init__(self, full: MockLM, kept: np.ndarray) -> None:
        self.full, self.kept = full, torch.from_numpy(np.sort(kept))

    @property
    def vocab_size(self) -> int:
        return len(self.kept)

    @property
    def num_cached(self) -> int:
        return self.full.num_cached

    def forward(self, tokens, all_logits: bool = True) -> torch.Tensor:
        return self.full.forward(tokens, all_logits)[:, self.kept]

    def rewind(self, n: int) -> None:
        self.full.rewind(n)

    def reset(self) -> None:
        self.full.reset()


def _reduced(kept: list[int], v: int = V, seed: int = 1, sharpness: float = 3.0):
    kept_arr = np.array(kept)
    return KeptColumns(MockLM(vocab_size=v, seed=seed, sharpness=sharpness), kept_arr), build_vocab_map(kept_arr, v)


def test_reduced_draft_q_lives_on_kept_tokens_and_sums_to_one() -> None:
    draft, vmap = _reduced([0, 1, 2, 3, 4, 5, 14, 15])
    prop = DraftModelProposer(draft, SamplingConfig(temperature=1.0), V, vmap)
    # Context token 9 is not kept: the draft still takes it (by its full-vocabulary id).
    proposal = prop.propose([0, 1, 9], 3, torch.Generator().manual_seed(0))
    kept = set(vmap.draft_to_target.tolist())
    assert proposal.probs.shape == (3, V)
    assert torch.all(proposal.probs[:, [i for i in range(V) if i not in kept]] == 0)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(3))
    assert set(proposal.tokens.tolist()) <= kept  # drafted ids are always kept ids
    # q(x) > 0 for every drafted token: the exact test never divides by zero.
    assert torch.all(proposal.probs.gather(-1, proposal.tokens.unsqueeze(-1)) > 0)
    # The draft saw the whole context: its cache holds the context and the drafts, unmapped.
    assert draft.full._tokens[:3] == [0, 1, 9]


def test_greedy_sd_with_reduced_draft_equals_ar() -> None:
    draft, vmap = _reduced(list(range(10)))
    target = MockLM(vocab_size=V, seed=1)
    greedy = SamplingConfig(temperature=0.0)
    ar, _ = run_to_end(decode(target, [1, 2], DecodeConfig(speculative=False, sampling=greedy,
                                                           max_new_tokens=40)))
    sd, stats = run_to_end(decode(target, [1, 2], DecodeConfig(sampling=greedy, k=3, max_new_tokens=40),
                                  DraftModelProposer(draft, greedy, V, vmap)))
    assert sd == ar and stats.accepted_tokens > 0


def test_sampled_sd_with_reduced_draft_samples_the_targets_sequences() -> None:
    # Sequence-level chi-square of exact SD with a draft that can never propose tokens 1
    # and 4; NSD's D, computed from the expanded q, still bounds its deviation.
    v, length = 6, 3
    sample = SamplingConfig(temperature=1.0)
    target = MockLM(vocab_size=v, seed=10, sharpness=1.5)
    exact = {}
    for seq in itertools.product(range(v), repeat=length):
        ctx, pr = [1, 2], 1.0
        for tok in seq:
            pr *= torch.softmax(target.logits_after(ctx), -1)[tok].item()
            ctx.append(tok)
        exact[seq] = pr

    def empirical(rule: RuleConfig, n: int):
        counts, dev = {}, 0.0
        for seed in range(n):
            draft, vmap = _reduced([0, 2, 3, 5], v=v, seed=11, sharpness=1.5)
            tokens, stats = run_to_end(decode(target, [1, 2], DecodeConfig(
                sampling=sample, k=2, max_new_tokens=length, rule=rule, seed=seed),
                DraftModelProposer(draft, sample, v, vmap)))
            counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
            dev += stats.deviation
        return counts, dev / n

    n = 2000
    counts, mean_dev = empirical(RuleConfig(kind="exact"), n)
    chi2 = sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in exact.items())
    dof = len(exact) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), chi2
    assert mean_dev == 0.0
    n = 1000
    counts, mean_dev = empirical(RuleConfig(kind="nucleus", theta=0.9), n)
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - p) for s, p in exact.items())
    noise = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in exact.values())
    assert mean_dev > 0 and tv <= mean_dev + 2 * noise, (tv, mean_dev, noise)


# --- llama.cpp, on SmolLM2-135M -------------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> Path:
    pytest.importorskip("llama_cpp")
    from nsd.errors import NSDError
    from nsd.models.registry import fetch_gguf

    try:
        return fetch_gguf("smollm2-135m-instruct", progress=False)
    except NSDError as exc:
        pytest.skip(f"test model unavailable: {exc}")


PROMPT = [(i * 7919) % 40000 + 100 for i in range(40)]


@pytest.mark.llama
def test_embedding_input_gives_the_token_logits(smol: Path, tmp_path: Path) -> None:
    from nsd.backends.embedding_input import EmbeddingInputBackend, EmbeddingTable
    from nsd.backends.llama_cpp import LlamaCppBackend
    from nsd.models.draft_vocab import write_input_table

    write_input_table(smol, tmp_path / "inputs.gguf")
    by_id = LlamaCppBackend(smol, n_threads=2, n_ctx=256)
    by_embd = EmbeddingInputBackend(LlamaCppBackend(smol, n_threads=2, n_ctx=256),
                                    EmbeddingTable(tmp_path / "inputs.gguf"))
    a = torch.cat([by_id.forward(PROMPT), by_id.forward([321]), by_id.forward([4321, 77])])
    b = torch.cat([by_embd.forward(PROMPT), by_embd.forward([321]), by_embd.forward([4321, 77])])
    # The same graph on the same float inputs: equal up to rounding, and so is a rewind.
    assert (a - b).abs().max().item() <= 1e-4
    by_embd.rewind(len(PROMPT))
    assert torch.allclose(by_embd.forward([321]), a[len(PROMPT):len(PROMPT) + 1], atol=1e-4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        by_embd.forward([by_id.vocab_size])


@pytest.mark.llama
def test_reduced_draft_logits_are_the_full_drafts_on_kept_tokens(smol: Path, tmp_path: Path) -> None:
    import shutil

    from nsd.models import markers
    from nsd.backends.llama_cpp import LlamaCppBackend
    from nsd.models.draft_vocab import ensure_reduced_draft, open_reduced_draft

    src = tmp_path / smol.name
    shutil.copyfile(smol, src)
    counts = np.zeros(49152, dtype=np.int64)
    counts[PROMPT[::2]] = 10  # half the prompt's tokens ranked first; the rest dropped
    reduced = ensure_reduced_draft(src, 2000, counts=counts)  # tied head: gets an explicit one
    assert markers.check_marker(reduced.model.parent) is None and markers.check_marker(reduced.inputs) is None
    kept = set(reduced.vocab_map.draft_to_target.tolist())
    assert set(PROMPT[::2]) <= kept and not set(PROMPT[1::2]) <= kept
    small = open_reduced_draft(reduced, n_threads=2, n_ctx=256)
    full = LlamaCppBackend(src, n_threads=2, n_ctx=256)
    assert small.vocab_size == len(kept) == 2000 + 17 < full.vocab_size
    a = full.forward(PROMPT)
    b = small.forward(PROMPT)  # dropped context tokens are fed exactly, by their embeddings
    assert (a[:, reduced.vocab_map.draft_to_target] - b).abs().max().item() <= 1e-3
    # Built once: a second call reuses the cached files.
    again = ensure_reduced_draft(src, 2000, counts=counts)
    assert again.model == reduced.model and again.model.stat().st_mtime_ns == reduced.model.stat().st_mtime_ns


@pytest.mark.llama
def test_the_next_generation_reuses_a_reduced_drafts_cache(smol: Path, tmp_path: Path) -> None:
    # A reduced draft is fed input embeddings; its cache records the full-vocabulary ids
    # they stand for, so the next turn of a chat feeds the draft only what is new.
    import shutil

    from nsd.models.draft_vocab import ensure_reduced_draft, open_reduced_draft

    src = tmp_path / smol.name
    shutil.copyfile(smol, src)
    counts = np.zeros(49152, dtype=np.int64)
    counts[PROMPT[::2]] = 10  # the other half of the prompt is fed by embedding only
    reduced = ensure_reduced_draft(src, 2000, counts=counts)
    small = open_reduced_draft(reduced, n_threads=2, n_ctx=256)
    greedy = SamplingConfig(temperature=0.0)

    def proposer(reuse: bool) -> DraftModelProposer:
        return DraftModelProposer(small, greedy, vocab_map=reduced.vocab_map, reuse_cache=reuse)

    first = proposer(True).propose(PROMPT, 3, torch.Generator())
    drafted = first.tokens.tolist()
    assert small.cached_tokens == PROMPT + drafted[:2]
    fed: list[list[int]] = []
    forward_many = small.forward_many

    def recording(items):  # type: ignore[no-untyped-def]
        fed.extend([list(map(int, tokens)) for _, tokens, _ in items])
        return forward_many(items)

    small.forward_many = recording  # type: ignore[method-assign]
    turn = PROMPT + drafted[:1] + [PROMPT[1], 555]  # diverges after the first draft
    reused = proposer(True).propose(turn, 2, torch.Generator()).tokens.tolist()
    assert fed[0] == [PROMPT[1], 555]  # only what the cache did not hold
    fed.clear()
    rebuilt = proposer(False).propose(turn, 2, torch.Generator()).tokens.tolist()
    assert fed[0] == turn  # without reuse the whole context is fed again
    assert reused == rebuilt


@pytest.mark.llama
def test_a_tiny_kept_vocabulary_still_makes_a_loadable_draft(smol: Path, tmp_path: Path) -> None:
    import shutil

    from nsd.models.draft_vocab import ensure_reduced_draft, open_reduced_draft

    src = tmp_path / smol.name
    shutil.copyfile(smol, src)
    counts = np.zeros(49152, dtype=np.int64)
    counts[PROMPT[:10]] = 10
    reduced = ensure_reduced_draft(src, 10, counts=counts)  # no BPE merge survives this
    small = open_reduced_draft(reduced, n_threads=2, n_ctx=64)
    assert small.forward(PROMPT[:5]).shape == (5, len(reduced.vocab_map.draft_to_target))


@pytest.mark.llama
def test_token_counts_are_deterministic(smol: Path) -> None:
    from nsd.models.token_rank import count_tokens

    texts = [b"def f(x):\n    return x + 1\n", "caf\u00e9 na\u00efve".encode(), b"\xff\xfe odd bytes"]
    a, b = count_tokens(smol, texts), count_tokens(smol, list(reversed(texts)))
    assert a.shape == (49152,) and a.sum() > 10 and np.array_equal(a, b)


# --- --draft-vocab auto ----------------------------------------------------------------------


class _FakeBackend:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.closed = vocab_size, False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("reduced_ms, kept", [(8.9, "reduced"), (9.1, "full"), (12.0, "full")])
def test_auto_vocab_keeps_the_reduced_head_only_when_it_measures_cheaper_by_the_margin(
        monkeypatch, reduced_ms: float, kept: str) -> None:
    from nsd.models import loader

    full = loader.LoadedModel(_FakeBackend(151_936), "full.gguf", None, "q4_0", candidates={"q4_0": 1.0})
    reduced = loader.LoadedModel(_FakeBackend(33_061), "reduced.gguf", None, "q4_0",
                                 source_file="full.gguf")
    opened: list[tuple] = []

    def open_format(fmt, keep=None):
        opened.append((fmt, keep))
        return reduced

    monkeypatch.setattr(loader, "compare_step_costs",
                        lambda c: {"full": 10.0e-3, "reduced": reduced_ms * 1e-3})
    out = loader._reduce_where_cheaper(full, open_format)
    assert opened == [("q4_0", loader.AUTO_DRAFT_VOCAB)]
    assert out is (reduced if kept == "reduced" else full)
    assert (full.backend.closed, reduced.backend.closed) == (kept == "reduced", kept == "full")
    assert out.vocab_costs == {"full": 10.0e-3, "reduced": reduced_ms * 1e-3}
    assert out.candidates == {"q4_0": 1.0}


def test_auto_vocab_leaves_small_vocabularies_and_unsupported_files_alone(monkeypatch, capsys) -> None:
    from nsd.errors import NSDError
    from nsd.models import loader

    small = loader.LoadedModel(_FakeBackend(2 * loader.AUTO_DRAFT_VOCAB), "s.gguf", None)
    assert loader._reduce_where_cheaper(small, lambda *a: pytest.fail("must not build")) is small

    big = loader.LoadedModel(_FakeBackend(151_936), "b.gguf", None)

    def cannot(*args):
        raise NSDError("no tokenizer in b.gguf")

    assert loader._reduce_where_cheaper(big, cannot) is big
    assert "keeping the draft's full vocabulary (no tokenizer in b.gguf)" in capsys.readouterr().err


def test_draft_vocab_option_takes_a_number_zero_or_auto() -> None:
    from nsd import options as optspec
    from nsd.errors import NSDError
    from nsd.models.loader import BackendOptions

    assert BackendOptions().draft_vocab == "auto"
    assert BackendOptions(draft_vocab=0).draft_vocab == 0
    assert BackendOptions(draft_vocab=32768).draft_vocab == 32768
    with pytest.raises(NSDError, match="draft_vocab must be a whole number >= 0 or .auto."):
        BackendOptions(draft_vocab=-1)
    assert optspec.ALL["draft_vocab"].flag == "--draft-vocab"


def test_too_large_a_draft_vocabulary_names_the_flag(tmp_path: Path) -> None:
    from gguf_files import write_tiny_gguf
    from nsd.errors import NSDError
    from nsd.models.draft_vocab import ensure_reduced_draft

    src = write_tiny_gguf(tmp_path / "draft.gguf")
    with pytest.raises(NSDError, match=r"^--draft-vocab must be .*\[1, 15\].*got 100$"):
        ensure_reduced_draft(src, 100, counts=np.arange(16))
    with pytest.raises(NSDError, match=r"^--draft-vocab must be .*\[1, 16\].*got 17$"):
        kept_ids(TYPES, 17)
