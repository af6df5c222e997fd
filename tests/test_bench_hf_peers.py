"""transformers' own generate as peers, on a tiny random Llama saved to a temp folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from nsd.api import GenerationConfig
from nsd.errors import NSDError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = {f"w{i}": i for i in range(64)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", unk_token="w0")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=128, eos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_peers_generate_greedy_and_count_passes(tiny_folder: Path) -> None:
    from nsd.bench.hf_peers import HFPeers

    peers = HFPeers(str(tiny_folder), str(tiny_folder), need_draft=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    config = GenerationConfig(method="ar", max_new_tokens=10)
    outputs = {}
    for family in ("hf-ar", "hf-assisted", "hf-pld"):
        tokens, text, stats = peers.generate(family, prompt, config)
        outputs[family] = tokens
        assert stats.new_tokens == len(tokens) and 1 <= stats.target_passes <= len(tokens)
        assert stats.wall_s > 0 and stats.target_s > 0
    # Greedy assisted and prompt-lookup decoding are lossless: the same tokens as plain AR.
    assert outputs["hf-assisted"] == outputs["hf-ar"] == outputs["hf-pld"]
    _, _, assisted = peers.generate("hf-assisted", prompt, config)
    assert assisted.target_passes < assisted.new_tokens  # the draft is the target: all accepted
    with pytest.raises(NSDError, match="greedy only"):
        peers.generate("hf-ar", prompt, GenerationConfig(method="ar", temperature=0.7))


def test_assisted_needs_a_draft(tiny_folder: Path) -> None:
    from nsd.bench.hf_peers import HFPeers

    with pytest.raises(NSDError, match="needs a draft"):
        HFPeers(str(tiny_folder), None, need_draft=True)
