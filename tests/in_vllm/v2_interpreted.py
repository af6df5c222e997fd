"""Model Runner V2's real ``rejection_sample`` against nsd's replacement, on CPU tensors.

V2's verifier is Triton kernels; without a GPU they run in Triton's interpreter
(``TRITON_INTERPRET=1``). vLLM's CPU build disables Triton unless Triton has a CPU
backend, so this module declares one before vLLM is imported. It must therefore run in
a fresh interpreter: ``tests/in_vllm/test_model_runner_v2.py`` starts it as a
subprocess (``python -m pytest tests/in_vllm/v2_interpreted.py``).
"""

from __future__ import annotations

import os
import types

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

triton_backends = pytest.importorskip("triton.backends")


class _InterpreterDriver:
    @staticmethod
    def is_active() -> bool:
        return True


# vLLM's CPU build keeps Triton only when Triton has a "cpu" backend.
triton_backends.backends.setdefault("cpu", types.SimpleNamespace(driver=_InterpreterDriver))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402
from triton.runtime.interpreter import TensorHandle  # noqa: E402


def _interpreted_log1p(x):  # the interpreter has no libdevice; V2's residual calls log1p
    return tl.tensor(TensorHandle(np.log1p(x.handle.data), x.handle.dtype), x.type)


libdevice.log1p = _interpreted_log1p

pytest.importorskip("vllm")
from vllm.triton_utils import HAS_TRITON  # noqa: E402

if not HAS_TRITON:
    pytest.skip("vLLM did not enable Triton under the interpreter", allow_module_level=True)

from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as v2  # noqa: E402

from nsd.integrations.vllm.sampler_v2 import nsd_rejection_sample_v2  # noqa: E402
from nsd.rules.verify import RuleConfig  # noqa: E402

STOCK = getattr(v2.rejection_sample, "__wrapped__", v2.rejection_sample)
NOTHING_RELAXED = [RuleConfig(kind="exact"), RuleConfig(kind="nucleus", theta=0.0),
                   RuleConfig(kind="nucleus", theta=0.9, budget=0.0)]


def v2_case(seed: int, mode: str, with_q: bool, vocab: int = 64, steps: int = 4,
            placeholder: bool = False, peaked: bool = True) -> dict:
    """A V2 batch: per request 0..K drafts + the bonus row, in shuffled request states."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = 5
    max_reqs = num_reqs + 2
    drafts = [int(torch.randint(0, steps + 1, (1,), generator=g)) for _ in range(num_reqs)]
    drafts[0] = steps
    counts = [n + 1 for n in drafts]
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    num_logits = int(cu[-1])
    states = torch.randperm(max_reqs, generator=g)[:num_reqs]
    temperature = torch.zeros(max_reqs)
    for r, s in enumerate(states.tolist()):
        greedy = mode == "greedy" or (mode == "mixed" and r % 2 == 1)
        temperature[s] = 0.0 if greedy else float(torch.empty(1).uniform_(0.5, 1.2, generator=g))
    scale = 4.0 if peaked else 1.0
    logits = torch.randn(num_logits, vocab, generator=g) * scale
    draft_logits = torch.randn(max_reqs, steps, vocab, generator=g) * scale if with_q else None
    # Drafts: mostly the target's favourite tokens, so that blocks get accepted.
    top = logits.topk(3, dim=-1).indices
    pick = torch.randint(0, 3, (num_logits,), generator=g)
    favourite = top[torch.arange(num_logits), pick]
    draft_sampled = torch.randint(0, vocab, (num_logits,), generator=g)
    for r in range(num_reqs):
        start = int(cu[r])
        for i in range(drafts[r]):
            draft_sampled[start + i + 1] = favourite[start + i]
    if placeholder:
        draft_sampled[2] = -1
    expanded = torch.repeat_interleave(states, torch.tensor(counts))
    local = torch.cat([torch.arange(c) for c in counts])
    return dict(target_logits=logits, draft_logits=draft_logits, draft_sampled=draft_sampled,
                cu_num_logits=cu, pos=(local + 7 + torch.randint(0, 50, (1,), generator=g)).long(),
                idx_mapping=states.to(torch.int32), expanded_idx_mapping=expanded.to(torch.int32),
                expanded_local_pos=local.to(torch.int32), temperature=temperature,
                seed=torch.randint(0, 2**40, (max_reqs,), generator=g), num_speculative_steps=steps)


def run_stock(case: dict, use_fp64: bool = False) -> list[list[int]]:
    sampled, num_sampled = STOCK(case["target_logits"].clone(), case["draft_logits"],
                                 case["draft_sampled"], case["cu_num_logits"], case["pos"],
                                 case["idx_mapping"], case["expanded_idx_mapping"],
                                 case["expanded_local_pos"], case["temperature"], case["seed"],
                                 case["num_speculative_steps"], use_fp64=use_fp64)
    return [sampled[r, :int(n)].tolist() for r, n in enumerate(num_sampled)]


def run_nsd(rule: RuleConfig, case: dict, use_fp64: bool = False, spent=None):
    sampled, num_sampled, result = nsd_rejection_sample_v2(
        rule, case["target_logits"], case["draft_logits"], case["draft_sampled"],
        case["cu_num_logits"], case["pos"], case["idx_mapping"], case["temperature"],
        case["seed"], case["num_speculative_steps"], spent=spent, use_fp64=use_fp64)
    return [sampled[r, :int(n)].tolist() for r, n in enumerate(num_sampled)], result


@pytest.mark.parametrize("mode", ["greedy", "random", "mixed"])
@pytest.mark.parametrize("with_q", [False, True])
def test_nothing_relaxed_equals_v2_stock(mode: str, with_q: bool) -> None:
    for trial in range(3):
        case = v2_case(100 * trial + 3, mode, with_q, placeholder=trial == 1)
        stock = run_stock(case)
        for rule in NOTHING_RELAXED:
            ours, result = run_nsd(rule, case)
            assert ours == stock, (rule, trial)
            assert float(result.deviation.sum()) == 0.0


def test_fp64_gumbel_equals_v2_stock() -> None:
    case = v2_case(7, "random", True)
    assert run_nsd(RuleConfig(kind="exact"), case, use_fp64=True)[0] == run_stock(case, use_fp64=True)


def test_v2_signature_is_the_one_the_plugin_wraps() -> None:
    import inspect
    names = list(inspect.signature(STOCK).parameters)[:12]
    assert names == ["target_logits", "draft_logits", "draft_sampled", "cu_num_logits", "pos",
                     "idx_mapping", "expanded_idx_mapping", "expanded_local_pos", "temperature",
                     "seed", "num_speculative_steps", "synthetic_conditional_rates"]


def test_nsd_relaxes_on_v2_inputs() -> None:
    accepted = {"stock": 0, "nsd": 0}
    for trial in range(3):
        case = v2_case(40 + trial, "mixed", trial != 1, peaked=False)
        stock = run_stock(case)
        ours, result = run_nsd(RuleConfig(kind="nucleus", theta=0.9), case)
        for s, o in zip(stock, ours):
            assert len(o) >= len(s)  # the same uniforms: NSD accepts a superset
        accepted["stock"] += sum(len(s) for s in stock)
        accepted["nsd"] += sum(len(o) for o in ours)
        assert float(result.deviation.sum()) >= 0.0
    assert accepted["nsd"] > accepted["stock"]


def test_plugin_installs_nsd_in_v2_and_keeps_the_ledger() -> None:
    """register() on a vLLM whose Triton works: V2's verifier becomes nsd's, per chunk."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2_rs

    from nsd.integrations.vllm import plugin
    from nsd.integrations.vllm.config import NSDVllmConfig
    from nsd.integrations.vllm.ledger import FidelityLedger

    plugin.register()
    assert plugin.ACTIVE.v2_patched and getattr(v2_rs.rejection_sample, "_nsd_patched", False)
    case = v2_case(9, "mixed", True, peaked=False)
    num_reqs = case["cu_num_logits"].shape[0] - 1
    args = [case[k] for k in ("target_logits", "draft_logits", "draft_sampled", "cu_num_logits", "pos",
                              "idx_mapping", "expanded_idx_mapping", "expanded_local_pos",
                              "temperature", "seed", "num_speculative_steps")]
    ids = [f"req-{i}" for i in range(num_reqs)]
    try:
        for rule, expect in [(RuleConfig(kind="nucleus", theta=0.0), run_stock(case)),
                             (RuleConfig(kind="nucleus", theta=0.9),
                              run_nsd(RuleConfig(kind="nucleus", theta=0.9), case)[0])]:
            plugin.ACTIVE.config = NSDVllmConfig(rule=rule, log_requests=False)
            plugin.ACTIVE.ledger = FidelityLedger(log_requests=False)
            plugin.ACTIVE.req_ids, plugin.ACTIVE.req_offset = ids, 0
            # As V2's RejectionSampler calls it (rates positional, the rest by keyword).
            sampled, num_sampled = v2_rs.rejection_sample(*args, None, use_fp64=False,
                                                          use_block_verification=False)
            got = [sampled[r, :int(n)].tolist() for r, n in enumerate(num_sampled)]
            assert got == expect, rule
            assert plugin.ACTIVE.req_offset == num_reqs
            plugin.ACTIVE.ledger._fold()
            drafted = sum(s.drafted for s in plugin.ACTIVE.ledger.requests.values())
            assert drafted == int(case["cu_num_logits"][-1]) - num_reqs
            if rule.relaxes:
                assert sum(s.relaxed for s in plugin.ACTIVE.ledger.requests.values()) > 0
    finally:
        plugin.ACTIVE.config = plugin.ACTIVE.ledger = plugin.ACTIVE.req_ids = None
