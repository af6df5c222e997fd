"""nsd's ragged rule against vLLM's real stock ``rejection_sample`` (needs vLLM installed).

Run with the vLLM venv's interpreter (``tests/test_vllm_integration.py`` does this as a
subprocess). The model-free twin of this test, against a reference of the stock rule,
is ``tests/test_ragged.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from test_ragged import NOTHING_RELAXED, metadata, ragged_case, run_nsd, run_reference  # noqa: E402

stock = pytest.importorskip("vllm.v1.sample.rejection_sampler")
from vllm.platforms import current_platform  # noqa: E402

# Without Triton (vLLM's CPU build), the stock kernels are C++ fallbacks registered by the
# platform at engine start-up; register them here the same way.
ON_CPU = current_platform.is_cpu()
if ON_CPU:
    current_platform.register_triton_kernel_overrides()


def run_stock(case: dict, seed: int) -> torch.Tensor:
    # The plugin may have replaced the module attribute; the original is kept on it.
    fn = getattr(stock.rejection_sample, "__wrapped__", stock.rejection_sample)
    torch.manual_seed(seed)
    return fn(case["draft_token_ids"], case["num_draft_tokens"], case["max_spec_len"],
              case["cu_num_draft_tokens"], case["draft_probs"], case["target_logits"].clone(),
              case["bonus_token_ids"], metadata(case))


@pytest.mark.parametrize("mode", ["greedy", "random", "mixed"])
@pytest.mark.parametrize("with_q", [False, True])
def test_nothing_relaxed_equals_real_stock_rejection_sample(mode: str, with_q: bool) -> None:
    for trial in range(4):
        # vLLM's CPU fallback kernel does not check for padded (-1) drafts: it reads the
        # probability at index -1 and may "accept" the -1. Only the GPU kernel handles them.
        case = ragged_case(10 * trial + 1, mode, with_q, padded_draft=not ON_CPU)
        real = run_stock(case, seed=trial)
        ref = run_reference(case, seed=trial, float32_uniforms=ON_CPU)
        assert torch.equal(real, ref), "the reference drifted from vLLM"
        for rule in NOTHING_RELAXED:
            res = run_nsd(rule, case, seed=trial, float32_uniforms=ON_CPU)
            assert torch.equal(res.output_token_ids, real), rule
