"""GPU check of nsd's vLLM-side math: nsd.rules.ragged on CUDA tensors against the CPU results.

For a machine with a GPU and PyTorch (Triton and transformers optional), no vLLM and no
network. Run from the repository root:

    PYTHONPATH=src python scripts/gpu_check.py [--out results.json]

What it checks, on the same random inputs moved to both devices (the random numbers are
drawn on the CPU and copied, so the devices see identical uniforms and noise):

1. the exact rule and every rule that relaxes nothing give identical tokens on CUDA and CPU;
2. NSD (θ 0.5 / 0.9, with and without a budget, greedy / sampled / mixed batches, with and
   without draft probabilities): tokens identical except where a nucleus boundary falls
   within float rounding of a draft's probability (reported, must stay rare); deviation
   equal to 1e-6 where the decisions agree; the budget never exceeded on CUDA;
3. the recovered-token race (``recover_tokens_ragged``) identical on both devices.

Model Runner V2's adapter (``nsd.integrations.vllm.sampler_v2``) calls V2's own Triton
helpers and so needs vLLM; it is checked against V2's real function by
``tests/in_vllm/v2_interpreted.py`` (Triton's interpreter on CPU, or the GPU where vLLM is
installed). ``--device cpu`` runs this script's comparison CPU against CPU (a dry run).

Exit status 0 when every check passes; a JSON summary is printed (and written to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from nsd.rules.ragged import recover_tokens_ragged, verify_ragged
from nsd.rules.verify import RuleConfig

RULES = {
    "exact": RuleConfig(kind="exact"),
    "theta0": RuleConfig(kind="nucleus", theta=0.0),
    "budget0": RuleConfig(kind="nucleus", theta=0.9, budget=0.0),
    "nsd0.5": RuleConfig(kind="nucleus", theta=0.5),
    "nsd0.9": RuleConfig(kind="nucleus", theta=0.9),
    "nsd0.9_B1": RuleConfig(kind="nucleus", theta=0.9, budget=1.0),
    "nsd0.9_B1_smooth": RuleConfig(kind="nucleus", theta=0.9, budget=1.0, smooth=True),
}
NOTHING_RELAXED = {"exact", "theta0", "budget0"}


def make_case(seed: int, mode: str, with_q: bool, batch: int, max_k: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_k + 1, (batch,), generator=g)
    counts[0] = max_k
    t = int(counts.sum())
    logits = 3.0 * torch.randn(t, vocab, generator=g)
    probs = logits.softmax(-1)
    q = None
    if with_q:
        q = (logits + 2.0 * torch.randn(t, vocab, generator=g)).softmax(-1)
        drafts = torch.multinomial(q, 1, generator=g).squeeze(-1)
    else:
        top = logits.topk(3, dim=-1).indices
        drafts = top[torch.arange(t), torch.randint(0, 3, (t,), generator=g)]
    if mode == "greedy":
        greedy = torch.ones(batch, dtype=torch.bool)
    elif mode == "random":
        greedy = torch.zeros(batch, dtype=torch.bool)
    else:
        greedy = torch.rand(batch, generator=g) < 0.5
    return dict(
        target_probs=probs, target_argmax=logits.argmax(-1), draft_token_ids=drafts.to(torch.int32),
        cu_num_draft_tokens=counts.cumsum(0).to(torch.int32), max_spec_len=max_k, draft_probs=q,
        bonus_token_ids=torch.randint(0, vocab, (batch, 1), generator=g), is_greedy=greedy,
        accept_uniforms=torch.rand(t, generator=g, dtype=torch.float64),
        inv_exp=torch.empty(batch, vocab).exponential_(generator=g).reciprocal(),
        spent=torch.rand(batch, generator=g, dtype=torch.float64) * 0.5,
    )


def to(case: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def run(rule: RuleConfig, case: dict):
    recovered = recover_tokens_ragged(case["target_probs"], case["draft_probs"], case["draft_token_ids"],
                                      case["cu_num_draft_tokens"], case["inv_exp"])
    res = verify_ragged(rule, case["target_probs"], case["target_argmax"], case["draft_token_ids"],
                        case["cu_num_draft_tokens"], case["max_spec_len"], case["draft_probs"],
                        case["bonus_token_ids"], case["is_greedy"], case["accept_uniforms"],
                        recovered, case["spent"])
    return recovered, res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the JSON summary here too")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="the device compared with the CPU")
    args = parser.parse_args()
    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    summary: dict = {"device": torch.cuda.get_device_name(0) if on_cuda else args.device,
                     "torch": torch.__version__,
                     "cases": [], "failures": []}
    try:
        import triton
        summary["triton"] = triton.__version__
    except ImportError:
        summary["triton"] = None
    for seed, (mode, with_q) in enumerate([(m, q) for m in ("greedy", "random", "mixed") for q in (False, True)]):
        case = make_case(100 + seed, mode, with_q, args.batch, 5, args.vocab)
        gpu = to(case, args.device)
        for name, rule in RULES.items():
            rec_c, cpu_res = run(rule, case)
            sync()
            start = time.perf_counter()
            rec_g, gpu_res = run(rule, gpu)
            sync()
            ms = 1000 * (time.perf_counter() - start)
            same_rec = torch.equal(rec_c, rec_g.cpu())
            rows_same = (cpu_res.output_token_ids == gpu_res.output_token_ids.cpu()).all(-1)
            mismatch = int((~rows_same).sum())
            dev_ok = torch.allclose(cpu_res.deviation[rows_same], gpu_res.deviation.cpu()[rows_same], atol=1e-6)
            # A request already past B (the random starting spend) may not be charged more.
            cap = torch.clamp(case["spent"], min=rule.budget)
            over = bool((gpu_res.spent.cpu() > cap + 1e-12).any())
            row = dict(mode=mode, with_q=with_q, rule=name, gpu_ms=round(ms, 2), recovered_equal=same_rec,
                       rows=args.batch, rows_differing=mismatch, deviation_equal=dev_ok, budget_exceeded=over)
            summary["cases"].append(row)
            ok = same_rec and dev_ok and not over and (mismatch == 0 if name in NOTHING_RELAXED
                                                        else mismatch <= max(1, args.batch // 50))
            if not ok:
                summary["failures"].append(row)
    summary["ok"] = not summary["failures"]
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
