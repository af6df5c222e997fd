"""The vLLM plugin's start-up checks and version handling, without vLLM installed.

Which vLLM releases are accepted, and which engine configurations are refused (one
NSDError line naming the setting to change) on each model runner. The same checks run
inside vLLM in ``tests/in_vllm/test_model_runner_v2.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nsd.errors import NSDError
from nsd.integrations.vllm import plugin
from nsd.integrations.vllm.config import SUPPORTED_TEXT, check_engine, check_vllm_version, config_from_vllm


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.0+cpu", "0.33.2rc1"])
def test_supported_vllm_releases_are_accepted(version: str) -> None:
    check_vllm_version(version)
    assert config_from_vllm({"nsd": {"theta": 0.9}}, version) is not None


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0"])
def test_other_vllm_releases_are_refused_with_the_range(version: str) -> None:
    with pytest.raises(NSDError, match=SUPPORTED_TEXT.replace(".", r"\.")):
        config_from_vllm({"nsd": {"theta": 0.9}}, version)
    assert config_from_vllm(None, version) is None  # not configured: the plugin stays out


def engine(method: str = "standard", watermark: bool = False, adaptive: bool = False,
           speculative: bool = True) -> SimpleNamespace:
    spec = SimpleNamespace(rejection_sample_method=method, enable_adaptive_verification=adaptive,
                           draft_sample_method="greedy") if speculative else None
    return SimpleNamespace(speculative_config=spec, watermark_config=object() if watermark else None)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_standard_verification_is_accepted_on_both_runners(runner: str) -> None:
    check_engine(engine(), runner, v2_patched=True)
    check_engine(engine(speculative=False), runner, v2_patched=True)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("method", ["synthetic", "block", "fly"])
def test_other_verification_methods_are_refused(runner: str, method: str) -> None:
    with pytest.raises(NSDError, match=f"rejection_sample_method='{method}'.*'standard'"):
        check_engine(engine(method), runner, v2_patched=True)


def test_model_runner_v2_is_refused_where_the_plugin_could_not_patch_it() -> None:
    with pytest.raises(NSDError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_engine(engine(), "v2", v2_patched=False)
    check_engine(engine(), "v1", v2_patched=False)  # V1 does not need the V2 patch


def test_v2_only_features_nsd_does_not_verify_are_refused() -> None:
    with pytest.raises(NSDError, match="watermark"):
        check_engine(engine(watermark=True), "v2")
    with pytest.raises(NSDError, match="enable_adaptive_verification"):
        check_engine(engine(adaptive=True), "v2")


def test_error_messages_are_one_line() -> None:
    for kwargs, runner, patched in [({"method": "fly"}, "v1", True), ({}, "v2", False),
                                    ({"watermark": True}, "v2", True), ({"adaptive": True}, "v2", True)]:
        with pytest.raises(NSDError) as err:
            check_engine(engine(**kwargs), runner, v2_patched=patched)
        assert "\n" not in str(err.value)


def test_v1_wrapper_passes_vllm_033_keywords_to_the_stock_function(monkeypatch) -> None:
    """vLLM 0.33's V1 rejection_sample gained FLy keywords; the wrapper must forward them."""
    seen = {}

    def stock(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
              target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False,
              synthetic_conditional_rates=None, use_fp64_gumbel=False, fly_window_size=None,
              fly_entropy_threshold=None, fly_entropy_top_k=3):
        seen.update(fly_window_size=fly_window_size, fly_entropy_threshold=fly_entropy_threshold,
                    fly_entropy_top_k=fly_entropy_top_k)
        return torch.full((1, 2), 7, dtype=torch.int32)

    wrapped = plugin._wrap_rejection_sample(stock)
    monkeypatch.setattr(plugin.ACTIVE, "config", None)
    args = (torch.zeros(1, dtype=torch.int32), [1], 1, torch.ones(1, dtype=torch.int32), None,
            torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int64), SimpleNamespace())
    out = wrapped(*args, fly_window_size=2, fly_entropy_threshold=0.5, fly_entropy_top_k=4)
    assert out.tolist() == [[7, 7]]
    assert seen == dict(fly_window_size=2, fly_entropy_threshold=0.5, fly_entropy_top_k=4)
    wrapped(*args)  # and on 0.32, without them
    assert seen["fly_window_size"] is None
