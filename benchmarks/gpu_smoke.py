"""Smoke test of the transformers backend and the decoding loop on a device (CUDA by
default), on tiny random Qwen2 models in float32 so that results are exact:

* rewind-and-refeed logits equal a fresh forward;
* greedy SD produces exactly the greedy AR tokens, on the same device and dtype;
* NSD's deviation accounting is sane (greedy: D = number of relaxed accepts; sampled:
  0 ≤ D ≤ accepted drafts, finite);
* the same with graphed short forwards (``cudagraph``, ``torch``): a graph mode that
  cannot run here is reported as unavailable, a graph mode that runs but gives other
  tokens is a failure.

Exit status 0 when every required check passes, 1 otherwise.

    python benchmarks/gpu_smoke.py [--device cuda] [--modes none,cudagraph,torch]

(Checked on CPU with ``--device cpu --modes none,torch``: the torch.compile path gives the
same tokens, after ~5 minutes of compilation on 2 cores.)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback

import torch

from nsd.backends.hf import HFBackend, resolve_device
from nsd.decode import DecodeConfig, decode, run_to_end
from nsd.proposers.draft_model import DraftModelProposer
from nsd.rules.sampling import SamplingConfig
from nsd.rules.verify import RuleConfig

VOCAB = 1024
GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=1.0)


def tiny_qwen2(layers: int, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)  # same seed: the 1-layer draft shares the target's embeddings
    return Qwen2ForCausalLM(config).to(device=device, dtype=torch.float32).eval()


def check_mode(mode: str, target_model, draft_model, device: torch.device) -> list[str]:
    """Failures (empty = pass) of one graph mode."""
    failures: list[str] = []
    target = HFBackend.from_model(target_model, max_len=512, compile=mode)
    draft = HFBackend.from_model(draft_model, max_len=512)
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    with torch.no_grad():
        fresh = target_model(input_ids=torch.tensor([seq], device=device)).logits[0].float()
    target.forward(seq[:30], all_logits=False)
    target.forward(seq[:5])  # a rejected block
    target.rewind(30)
    refed = torch.cat([target.forward(seq[30:35]), target.forward([seq[35]])])
    if refed.device.type != device.type:
        failures.append(f"logits on {refed.device}, expected {device.type}")
    err = (refed - fresh[30:36]).abs().max().item()
    if not err < 1e-3:
        failures.append(f"rewind-and-refeed logits differ from a fresh forward by {err:.2e}")

    prompt = seq[:12]
    ar, ar_stats = run_to_end(decode(target, prompt, DecodeConfig(speculative=False, max_new_tokens=64)))
    sd, sd_stats = run_to_end(decode(target, prompt, DecodeConfig(k=4, max_new_tokens=64),
                                     DraftModelProposer(draft, GREEDY, VOCAB)))
    if sd != ar:
        first = next((i for i, (a, b) in enumerate(zip(ar, sd)) if a != b), min(len(ar), len(sd)))
        failures.append(f"greedy SD differs from greedy AR from token {first} on")
    if sd_stats.deviation != 0.0:
        failures.append(f"SD reported deviation {sd_stats.deviation}")
    nsd_cfg = DecodeConfig(rule=RuleConfig(kind="nucleus", theta=0.9), k=4, max_new_tokens=64)
    _, nsd = run_to_end(decode(target, prompt, nsd_cfg, DraftModelProposer(draft, GREEDY, VOCAB)))
    if not math.isclose(nsd.deviation, nsd.relaxed_accepts):
        failures.append(f"greedy NSD: D = {nsd.deviation} but {nsd.relaxed_accepts} relaxed accepts")
    sampled_cfg = DecodeConfig(rule=RuleConfig(kind="nucleus", theta=0.9), sampling=SAMPLED, k=4,
                               max_new_tokens=64, seed=5)
    _, samp = run_to_end(decode(target, prompt, sampled_cfg, DraftModelProposer(draft, SAMPLED, VOCAB)))
    if not (math.isfinite(samp.deviation) and 0 <= samp.deviation <= samp.accepted_tokens + 1e-9):
        failures.append(f"sampled NSD: D = {samp.deviation} with {samp.accepted_tokens} accepted drafts")
    print(f"  [{mode}] AR {len(ar)} tokens in {ar_stats.target_passes} passes; SD tau {sd_stats.tau:.2f}; "
          f"greedy NSD tau {nsd.tau:.2f} D {nsd.deviation:.0f}; sampled NSD tau {samp.tau:.2f} "
          f"D {samp.deviation:.3f}; refeed max |diff| {err:.1e}", flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    # torch.compile compiles one graph per forward length: minutes, so it is opt-in here.
    parser.add_argument("--modes", default=None,
                        help="graph modes to check, of none,cudagraph,torch (default: none,cudagraph "
                             "on CUDA, none on CPU)")
    args = parser.parse_args()
    device = resolve_device(args.device)
    modes = (args.modes or ("none,cudagraph" if device.type == "cuda" else "none")).split(",")
    print(f"smoke test on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""), flush=True)
    target_model, draft_model = tiny_qwen2(2, device), tiny_qwen2(1, device)
    failed: dict[str, list[str]] = {}
    unavailable: dict[str, str] = {}
    for mode in modes:
        start = time.perf_counter()
        try:
            failures = check_mode(mode, target_model, draft_model, device)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            if mode == "none":  # the eager path must work
                traceback.print_exc()
                failures = [f"crashed: {reason}"]
            else:
                unavailable[mode] = reason
                print(f"  [{mode}] unavailable here: {reason}", flush=True)
                continue
        if failures:
            failed[mode] = failures
        print(f"  [{mode}] {'FAIL' if failures else 'ok'} ({time.perf_counter() - start:.0f}s)", flush=True)
    print("\nsmoke summary:")
    for mode in modes:
        state = "FAIL: " + "; ".join(failed[mode]) if mode in failed else \
            f"unavailable ({unavailable[mode]})" if mode in unavailable else "ok"
        print(f"  {mode:10s} {state}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
