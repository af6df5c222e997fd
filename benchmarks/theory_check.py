"""The paper's central claim on real weights: sequence TV(NSD, AR) ≤ E[D].

For a few prompts, with the real Qwen2.5-Coder 1.5B target and 0.5B draft:

1. **Exact laws of the first n tokens** (n ≤ k, so every position is a drafted one). A
   position verified from target law ``p`` and draft law ``q`` emits a token with law
   ``P'(x) = q(x)·a(x) + R·r(x)`` (``a = min(1, p/q)`` off the nucleus, 1 on it; ``r`` the
   residual), whether the block goes on or a new one starts there, so the NSD law of the
   first n tokens is ``Π_t P'_t(x_t | x_<t)`` and AR's is ``Π_t p_t``. Both are enumerated
   over every prefix with positive probability (one target and one draft forward each),
   giving the exact sequence TV and the exact bound ``E_{y∼NSD}[Σ_t E_t(y_<t)]``. This
   reference math is written here independently of ``nsd.verify``.
2. **Samples from nsd itself**: ``--samples`` seeded generations of n tokens each with
   ``method=ar`` and ``method=nsd`` through :class:`nsd.api.Engine`; their empirical laws are
   compared with the exact ones (TV and a χ² goodness-of-fit p-value), and the empirical
   TV(NSD, AR) is reported with a bootstrap standard error.

    python benchmarks/theory_check.py --samples 400 --out benchmarks/results/theory_check.json

Timing does not matter here, so it runs on one thread (robust to other load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path

import torch

from nsd.api import BackendOptions, Engine, GenerationConfig, load_engine
from nsd.machine import cpu_description
from nsd.sampling import SamplingConfig, logits_to_probs

PROMPTS = (
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Name a primary colour.",
)


def step_law(p: torch.Tensor, q: torch.Tensor, theta: float) -> tuple[torch.Tensor, float]:
    """NSD's single-step output law and its deviation E (reference math, float64)."""
    p, q = p.double(), q.double()
    order = torch.sort(p, descending=True).values
    cum = torch.cumsum(order, 0) / order.sum()
    cross = order[int(torch.searchsorted(cum, torch.tensor([theta], dtype=torch.float64))[0].clamp(max=len(order) - 1))]
    nucleus = (p >= cross) & (p > 0) if theta > 0 else torch.zeros_like(p, dtype=torch.bool)
    m = torch.where(q > 0, torch.clamp(p / q.clamp_min(1e-300), max=1.0), torch.ones_like(p))
    a = torch.where(nucleus, torch.ones_like(m), m)
    rejected = float((q * (1 - a)).sum())
    residual = (p - q).clamp_min(0)
    z = float(residual.sum())
    law = q * a + (rejected / z) * residual if z > 0 else q * a
    excess = float(((q - p).clamp_min(0) * nucleus).sum())
    return law, excess


def exact_laws(engine: Engine, ids: list[int], sampling: SamplingConfig, theta: float, n: int,
               min_mass: float) -> dict:
    """Enumerate prefixes: AR law, NSD law and E[D] over the first n tokens."""
    target, draft = engine.target, engine.draft
    ar: dict[tuple, float] = {}
    nsd: dict[tuple, float] = {}
    bound = 0.0
    forwards = 0

    # The prompt's KV stays cached; each prefix is fed after it (rewind, then forward).
    for backend in (target, draft):
        backend.reset()
        backend.forward(ids[:-1], all_logits=False)
    base = len(ids) - 1

    def expand(prefix: tuple, p_ar: float, p_nsd: float, spent: float) -> None:
        nonlocal bound, forwards
        if len(prefix) == n:
            ar[prefix] = ar.get(prefix, 0.0) + p_ar
            nsd[prefix] = nsd.get(prefix, 0.0) + p_nsd
            bound += p_nsd * spent  # E_{y~NSD}[Σ E_t]
            return
        fed = [ids[-1]] + list(prefix)
        target.rewind(base), draft.rewind(base)
        p = logits_to_probs(target.forward(fed, all_logits=False)[-1], sampling)
        q = logits_to_probs(draft.forward(fed, all_logits=False)[-1], sampling)
        forwards += 1
        law, excess = step_law(p, q, theta)
        support = torch.nonzero((p > 0) | (law > 0)).flatten().tolist()
        for tok in support:
            pa, pn = p_ar * float(p[tok]), p_nsd * float(law[tok])
            if max(pa, pn) < min_mass:  # negligible branches: their mass is reported
                ar[("other",)] = ar.get(("other",), 0.0) + pa
                nsd[("other",)] = nsd.get(("other",), 0.0) + pn
                continue
            expand(prefix + (tok,), pa, pn, spent + excess)

    expand((), 1.0, 1.0, 0.0)
    keys = set(ar) | set(nsd)
    tv = 0.5 * sum(abs(ar.get(k, 0.0) - nsd.get(k, 0.0)) for k in keys if k != ("other",))
    return {"ar": ar, "nsd": nsd, "tv": tv, "bound": bound, "forwards": forwards,
            "pruned_mass": max(ar.get(("other",), 0.0), nsd.get(("other",), 0.0))}


def empirical(engine: Engine, ids: list[int], config: GenerationConfig, samples: int,
              n: int) -> tuple[Counter, list[float]]:
    """Counts of the first n tokens over seeded generations, and the D nsd reported for each."""
    out: Counter = Counter()
    reported: list[float] = []
    for seed in range(samples):
        result = engine.generate(ids, dataclasses.replace(config, seed=seed))
        out[tuple(result.token_ids[:n])] += 1
        reported.append(result.stats.deviation)
    return out, reported


def mean_and_se(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
    return mean, math.sqrt(var / len(values))


def tv_counts_law(counts: Counter, law: dict) -> float:
    total = sum(counts.values())
    keys = (set(counts) | set(law)) - {("other",)}
    return 0.5 * sum(abs(counts.get(k, 0) / total - law.get(k, 0.0)) for k in keys)


def chi2_pvalue(counts: Counter, law: dict) -> float:
    """χ² goodness of fit, cells with expected count ≥ 5, the rest pooled."""
    total = sum(counts.values())
    big = [k for k, v in law.items() if k != ("other",) and v * total >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [law[k] * total for k in big]
    rest_obs, rest_exp = total - sum(obs), total - sum(exp)
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = max(len(obs) - 1, 1)
    # χ² survival function = regularised upper incomplete gamma Q(df/2, stat/2).
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def tv_counts(a: Counter, b: Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


def bootstrap_se(a: Counter, b: Counter, reps: int = 200, seed: int = 0) -> float:
    rng = random.Random(seed)
    la, lb = list(a.elements()), list(b.elements())
    vals = [tv_counts(Counter(rng.choices(la, k=len(la))), Counter(rng.choices(lb, k=len(lb))))
            for _ in range(reps)]
    mean = sum(vals) / reps
    return math.sqrt(sum((v - mean) ** 2 for v in vals) / (reps - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2, help="first n tokens (n <= k)")
    ap.add_argument("--theta", type=float, default=0.9)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--samples", type=int, default=400, help="nsd generations per method and prompt")
    ap.add_argument("--min-mass", type=float, default=1e-6, help="prune prefixes below this mass")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    k = max(4, args.tokens)
    engine = load_engine("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
                         proposer="draft", options=BackendOptions(threads=args.threads, weights="original"))
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    # One token more than compared: the engine drafts at most remaining - 1 tokens, so with
    # n + 1 to go every one of the first n positions is a drafted (verified) one, as the
    # exact law assumes, and position n + 1 never is (a bonus or plain step, E = 0): the D
    # nsd reports is then exactly E_1 + ... + E_n.
    base = GenerationConfig(theta=args.theta, k=k, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.tokens + 1)
    rows = []
    for prompt in PROMPTS:
        ids = engine.encode(prompt, chat=True)
        exact = exact_laws(engine, ids, sampling, args.theta, args.tokens, args.min_mass)
        row = {"prompt": prompt, "exact_tv": exact["tv"], "exact_bound_mean_D": exact["bound"],
               "forwards": exact["forwards"], "pruned_mass": exact["pruned_mass"]}
        if args.samples:
            ar, _ = empirical(engine, ids, dataclasses.replace(base, method="ar"), args.samples, args.tokens)
            nsd, reported = empirical(engine, ids, dataclasses.replace(base, method="nsd"), args.samples,
                                      args.tokens)
            mean_d, se_d = mean_and_se(reported)
            row.update({
                # nsd's own D, averaged over its generations: an estimate of the exact E[D].
                "reported_mean_D": mean_d, "reported_mean_D_se": se_d,
                "samples": args.samples,
                "empirical_tv_nsd_vs_ar": tv_counts(nsd, ar), "bootstrap_se": bootstrap_se(nsd, ar),
                "tv_ar_samples_vs_exact_ar": tv_counts_law(ar, exact["ar"]),
                "tv_nsd_samples_vs_exact_nsd": tv_counts_law(nsd, exact["nsd"]),
                "chi2_p_ar": chi2_pvalue(ar, exact["ar"]), "chi2_p_nsd": chi2_pvalue(nsd, exact["nsd"]),
            })
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    result = {"cpu": cpu_description(), "settings": vars(args) | {"k": k, "out": str(args.out)},
              "rows": rows, "command": " ".join(["python"] + sys.argv)}
    lines = [f"| prompt | exact TV(NSD, AR) | exact E[D] (bound) | nsd's mean D ± SE | sampled TV ± SE | "
             "χ² p (AR / NSD vs exact law) |", "|---|---|---|---|---|---|"]
    for r in rows:
        sampled = f"{r['empirical_tv_nsd_vs_ar']:.3f} ± {r['bootstrap_se']:.3f}" if "samples" in r else "-"
        mean_d = f"{r['reported_mean_D']:.3f} ± {r['reported_mean_D_se']:.3f}" if "samples" in r else "-"
        chi = f"{r['chi2_p_ar']:.2f} / {r['chi2_p_nsd']:.2f}" if "samples" in r else "-"
        lines.append(f"| {r['prompt']} | {r['exact_tv']:.4f} | {r['exact_bound_mean_D']:.4f} | {mean_d} | "
                     f"{sampled} | {chi} |")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
