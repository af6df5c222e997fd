"""Several requests decoded at once: draft lengths chosen for the whole batch (the joint
plan, ``nsd.batchplan``) against each request choosing alone, and AR, in one process.

One engine is split into slots (``Engine.batched``), as ``nsd serve --parallel`` does; at
each concurrency level ``c``, ``c`` threads each generate one answer to their own prompt,
all members of the batch before any forward, for three modes run one after another: AR,
NSD with each request choosing its draft length alone (by what its block adds to the
shared forwards), and NSD with the joint plan. Rounds repeat the levels, every other
round in reverse mode order. Reported per mode and level: aggregate tokens/s (all
generated tokens over the level's wall time), its median over rounds, the paired median of
joint / alone and of each mode / AR (ratios within a round), mean τ and k per pass, and the
share of the plan's cycles that drafted, and the time per round spent outside the models'
forwards (the requests' own work and their meeting: what the plan itself could add).

    python benchmarks/batch_plan.py --levels 4,16 --rounds 3 --max-tokens 128 \\
        --proposer draft --json benchmarks/results/zen4-host/batch-plan.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from nsd.api import GenerationConfig, load_engine
from nsd.bench.datasets import DatasetConfig, load_prompts
from nsd.bench.store import write_json_atomic
from nsd.machine import cpu_description
from nsd.models.loader import BackendOptions

MODES = ("ar", "alone", "joint")


def run_level(slots: list, batcher, planner, prompts: list[list[int]], mode: str,
              max_tokens: int, temperature: float, theta: float) -> dict:
    for slot in slots:
        slot._shared.joint = planner if mode == "joint" else None
    before = list(planner.cycles) if planner is not None else [0, 0]
    rounds, seconds = batcher.rounds, batcher.stats.seconds
    method = "ar" if mode == "ar" else "nsd"
    config = GenerationConfig(method=method, k="auto" if method != "ar" else 4, theta=theta,
                              max_new_tokens=max_tokens, temperature=temperature, seed=0)
    results: list = [None] * len(prompts)
    ready = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        with batcher.member():
            ready.wait()
            results[i] = slots[i].generate(prompts[i], config)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    rounds, seconds = batcher.rounds - rounds, batcher.stats.seconds - seconds
    tokens = sum(len(r.token_ids) for r in results)
    passes = [k for r in results for k in r.stats.k_per_pass]
    cycles = [a - b for a, b in zip(planner.cycles, before)] if planner is not None else [0, 0]
    return {
        "mode": mode, "clients": len(prompts), "tokens": tokens, "wall_s": wall,
        "tok_s": tokens / wall,
        "tau": statistics.fmean(r.stats.tau for r in results) if method != "ar" else 1.0,
        "k_mean": statistics.fmean(passes) if passes else 0.0,
        "drafting_cycles": cycles[1] / sum(cycles) if sum(cycles) else None,
        # What the level spent outside the models' forwards, per round: the members' own
        # work (sampling, verification, the plan) and their meeting.
        "rounds": rounds, "outside_ms_per_round": 1000 * (wall - seconds) / max(rounds, 1),
        "texts": [r.text for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--proposer", default=None, help="default: the engine's for this pair")
    p.add_argument("--levels", default="4,16", help="concurrent requests, comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--theta", type=float, default=0.9)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--backend", default="auto", choices=("auto", "llama", "hf"),
                   help="hf: the transformers float32 backend, where a wider forward costs "
                        "little more than a narrow one on a CPU (its weights' reads dominate)")
    p.add_argument("--json", help="write the rows here (atomically)")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    engine = load_engine(args.target, args.draft, proposer=args.proposer,
                         options=BackendOptions(n_ctx=args.n_ctx, backend=args.backend))
    slots, batcher = engine.batched(max(levels))
    planner = slots[0]._shared.joint
    if planner is None:
        print("no joint plan for this engine (a draft model and -k auto are needed)", file=sys.stderr)
        return 1
    texts = [p.text for p in load_prompts(DatasetConfig(names=("humaneval",), limit=max(levels)))]
    prompts = [engine.encode(t, chat=True) for t in texts]
    rows = []
    for r in range(args.rounds):
        for level in (levels if r % 2 == 0 else levels[::-1]):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                row = run_level(slots[:level], batcher, planner, prompts[:level], mode,
                                args.max_tokens, args.temperature, args.theta)
                row["round"] = r
                rows.append(row)
                print(f"round {r} clients {level:2d} {mode:5s} {row['tok_s']:6.1f} tok/s "
                      f"tau {row['tau']:.2f} k {row['k_mean']:.2f} drafting cycles "
                      f"{row['drafting_cycles']}", file=sys.stderr)
    print(f"CPU: {cpu_description()}; proposer: {engine.proposer_kind}")
    print("| clients | mode | tok/s (median) | × AR (paired) | joint / alone (paired) | τ | k per pass | drafting cycles | ms/round outside forwards |")
    print("|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        cell = {(row["mode"], row["round"]): row for row in rows if row["clients"] == level}
        for mode in MODES:
            mine = [cell[(mode, r)] for r in range(args.rounds)]
            vs_ar = statistics.median(cell[(mode, r)]["tok_s"] / cell[("ar", r)]["tok_s"]
                                      for r in range(args.rounds))
            joint = statistics.median(cell[("joint", r)]["tok_s"] / cell[("alone", r)]["tok_s"]
                                      for r in range(args.rounds)) if mode == "joint" else None
            drafting = [m["drafting_cycles"] for m in mine if m["drafting_cycles"] is not None]
            print(f"| {level} | {mode} | {statistics.median(m['tok_s'] for m in mine):.1f} | "
                  f"{vs_ar:.2f}x | {f'{joint:.2f}x' if joint else '-'} | "
                  f"{statistics.fmean(m['tau'] for m in mine):.2f} | "
                  f"{statistics.fmean(m['k_mean'] for m in mine):.2f} | "
                  f"{f'{statistics.fmean(drafting):.0%}' if drafting else '-'} | "
                  f"{statistics.median(m['outside_ms_per_round'] for m in mine):.1f} |")
    if args.json:
        target, draft = planner.costs
        grids = {name: {"seqs": c.seqs, "widths": c.widths, "seconds": c.seconds}
                 for name, c in (("target", target), ("draft", draft))}
        write_json_atomic(Path(args.json), {"cpu": cpu_description(), "args": vars(args),
                                            "batched_costs": grids, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
