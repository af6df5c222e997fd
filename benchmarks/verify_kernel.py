"""The target's verification forward with and without nsd's small-batch kernels.

Two patches give ggml a small-batch path, and ``--kernel`` picks which one to measure:

* ``--kernel amx`` (AMX CPUs): ``scripts/patches/ggml-amx-vnni-small-batch.patch`` gives ggml's AMX backend a second path for
Q4_0 weights: batches of up to ``GGML_AMX_SMALL_M`` rows (default 10) go through an AVX-512
VNNI kernel that unpacks each weight block once for a group of up to 4 rows, instead of
the AMX tile kernel, whose fixed cost per call made two tokens cost ~1.7 one-token steps.
* ``--kernel vnni`` (any CPU with AVX-512 VNNI): ``scripts/patches/ggml-vnni-small-batch.patch``
  gives ggml's repacked Q4_0 layout (the path of every x86 CPU without AMX) and plain Q8_0
  weights (the output head of nsd's Q4_0 files) kernels that read each weight block once
  for a group of up to 16 rows, instead of one pass per 4 rows plus one per remaining row.
  By default the Q4_0 kernel takes every batch (prompts too) and the Q8_0 kernel 1..16
  rows; ``--small-m`` sets ``GGML_VNNI_SMALL_M``, which bounds both. On an AMX CPU the script sets
  ``GGML_NO_AMX=1`` (before llama.cpp loads), so the weights take the repacked layout a
  CPU without AMX would use: the same kernels, this machine's memory.

* ``--kernel avx2`` (any x86 CPU with AVX2 and FMA whose llama.cpp was built without the
  AVX-512 VNNI kernels: an AVX2-only CPU, or ``NSD_CPU_LEVEL=avx2 bash scripts/install.sh``
  elsewhere): ``scripts/patches/ggml-avx2-small-batch.patch`` gives the same two weight
  types AVX2 kernels that read each weight block once for up to 16 rows (Q4_0: prompts in
  groups of 16) and accumulate every row in one order whatever the number of rows, so the
  one-token step goes through them too (``GGML_AVX2_SMALL_M``). Its agreement table adds
  ``batch rows == one-token steps``: whether each row of a batch is bitwise the logits of
  decoding the same tokens one at a time, for both paths.

``--prefill N`` also times a prompt of N tokens (no cache) on both paths, interleaved.

The patched library reads the ``*_SMALL_M`` variable on every matmul, so this script measures
both paths in one process, interleaved:

* ``c(n)``: one forward of ``n`` new tokens (all logits) after a ~260-token code prompt,
  rewound before every call, for each path in turn within every repetition; medians;
* agreement: for each ``n``, the logits of the two paths over the same tokens, per
  position: argmax agreement and the total variation between the softmaxes (T = 1), and
  for scale the same figures between the one-token path (n = 1, unchanged by the patch)
  and each batched path at the first position. Where ``n`` exceeds ``--small-m`` both
  settings run the tile path, so their agreement says nothing and is marked so.

Usage (llama-cpp-python built with the patch, i.e. after ``scripts/install.sh``)::

    python benchmarks/verify_kernel.py --target qwen2.5-coder-1.5b-instruct \\
        --repeats 9 --out benchmarks/results/verify_kernel.json

``--kernel amx`` is only meaningful on a CPU with AMX, ``--kernel vnni`` on one with
AVX-512 VNNI (with or without AMX); elsewhere both settings run the same kernels and the
script says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from nsd.backends.llama_cpp import LlamaCppBackend
from nsd.errors import NSDError
from nsd.draftlen.machine import cpu_description
from nsd.models.loader import BackendOptions, load_backend, load_tokenizer

NS = (1, 2, 3, 5, 9, 17)
# The two kernels: the variable each reads, its default (the patch's), and the name of each
# side of the comparison (variable 0 = ggml's own path).
KERNELS = {
    "amx": ("GGML_AMX_SMALL_M", 10, ("amx tiles", "vnni small-batch")),
    "vnni": ("GGML_VNNI_SMALL_M", None, ("ggml", "vnni small-batch")),  # None: the patch's bounds
    "avx2": ("GGML_AVX2_SMALL_M", None, ("ggml", "avx2 small-batch")),
}
PROMPT = (
    "import json\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass Record:\n"
    "    sku: str\n    name: str\n    quantity: int\n    unit_price: float\n\n"
    "    @property\n    def total(self) -> float:\n        return self.quantity * self.unit_price\n\n\n"
    "def load_records(path: str) -> list[Record]:\n    with open(path) as f:\n"
    "        rows = json.load(f)\n    return [Record(**row) for row in rows]\n\n\n"
    "def low_stock(records, threshold: int = 5):\n    return [r for r in records if r.quantity < threshold]\n\n\n"
    "def summarize(records):\n    totals = [r.total for r in records]\n"
    "    return {'count': len(totals), 'value': sum(totals), 'max': max(totals, default=0.0)}\n\n\n"
    "class Inventory:\n    \"\"\"Records by SKU, with the few queries the reports need.\"\"\"\n\n"
    "    def __init__(self, records):\n        self.by_sku = {r.sku: r for r in records}\n\n"
    "    def restock(self, sku: str, amount: int) -> None:\n"
)


def _set_path(variable: str, value: str | None) -> None:
    # os.environ writes through to the C environment; unset = the patch's default bounds
    if value is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = value


def _same(n: int, small_m: int | None) -> bool:
    """Whether both settings run ggml's kernels at n tokens (n above an explicit bound)."""
    return small_m is not None and n > small_m


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), dim=-1)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    tv = 0.5 * (_softmax(a) - _softmax(b)).abs().sum(-1)
    return {"argmax_agree": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
            "tv_max": float(tv.max()), "tv_mean": float(tv.mean()),
            "max_abs_logit": float((a - b).abs().max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--weights", default="q4_0", help="the patch covers Q4_0 (default)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gguf", default=None,
                    help="measure this GGUF file instead (same tokenizer as --target)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="amx",
                    help="which small-batch path to measure against ggml's own (default: %(default)s)")
    ap.add_argument("--small-m", type=int, default=None,
                    help="the *_SMALL_M value of the small-batch side (default: the patch's own, "
                         + ", ".join(f"{k} {v[1] or 'unset'}" for k, v in KERNELS.items()) + ")")
    ap.add_argument("--ns", default=",".join(map(str, NS)),
                    help="comma-separated token counts n, starting with 1 (default: %(default)s)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="also time a prompt of this many tokens on both paths (default: none)")
    ap.add_argument("--prefill-repeats", type=int, default=3,
                    help="timed prompts per path (default: %(default)s; each is a long forward)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        ns = tuple(int(x) for x in args.ns.split(","))
    except ValueError:
        ap.error(f"--ns takes comma-separated integers, got {args.ns!r}")
    if ns[0] != 1 or any(n < 1 for n in ns) or list(ns) != sorted(set(ns)):
        ap.error("--ns must start with 1 and increase")
    variable, default_m, names = KERNELS[args.kernel]
    small_m = default_m if args.small_m is None else args.small_m
    if small_m is not None and small_m < 1:
        ap.error("--small-m must be at least 1")
    if args.kernel in ("vnni", "avx2"):
        os.environ["GGML_NO_AMX"] = "1"  # read once, when llama.cpp lists its weight layouts
    try:
        loaded = load_backend(args.target, BackendOptions(weights=args.weights, threads=args.threads))
        prompt = load_tokenizer(loaded.tokenizer_dir)(PROMPT)["input_ids"]
        if args.gguf:
            loaded.backend.close()
            loaded.backend, loaded.file, loaded.weights = (
                LlamaCppBackend(Path(args.gguf), n_threads=args.threads), args.gguf, "given file")
    except NSDError as exc:
        print(f"verify_kernel: {exc}", file=sys.stderr)
        return 2
    backend: LlamaCppBackend = loaded.backend
    backend.reset()
    last = backend.forward(prompt, all_logits=False)[-1]
    cont = []
    for _ in range(max(ns)):  # realistic ids: the model's own greedy continuation
        cont.append(int(last.argmax()))
        last = backend.forward([cont[-1]])[-1]
    backend.rewind(len(prompt))

    ours, theirs = names[1], names[0]
    paths = {theirs: "0", ours: None if small_m is None else str(small_m)}
    times: dict[str, dict[int, list[float]]] = {p: {n: [] for n in ns} for p in paths}
    logits: dict[str, dict[int, torch.Tensor]] = {p: {} for p in paths}
    for rep in range(args.repeats + 1):  # the first round warms up and is not timed
        for n in ns:
            for name, value in paths.items():
                _set_path(variable, value)
                t0 = time.perf_counter()
                out = backend.forward(cont[:n])
                dt = time.perf_counter() - t0
                backend.rewind(len(prompt))
                if rep == 0:
                    logits[name][n] = out.clone()
                else:
                    times[name][n].append(dt)
    prefill_times: dict[str, list[float]] = {p: [] for p in paths}
    long_prompt = (prompt * (args.prefill // max(len(prompt), 1) + 1))[:args.prefill]
    for rep in range(args.prefill_repeats + 1 if args.prefill else 0):
        for name, value in paths.items():
            _set_path(variable, value)
            backend.reset()
            t0 = time.perf_counter()
            backend.forward(long_prompt, all_logits=False)
            dt = time.perf_counter() - t0
            if rep:
                prefill_times[name].append(dt)
    if args.prefill:  # back to the state the agreement check below assumes
        backend.reset()
        backend.forward(prompt, all_logits=False)
    # Batch invariance: the rows of a batch against the same tokens decoded one at a time.
    invariant: dict[str, dict[int, bool]] = {}
    for name, value in paths.items():
        _set_path(variable, value)
        steps = []
        for t in cont[:max(ns)]:
            steps.append(backend.forward([t])[-1])
        backend.rewind(len(prompt))
        invariant[name] = {n: all(torch.equal(logits[name][n][i], steps[i]) for i in range(n)) for n in ns}
    os.environ.pop(variable, None)
    result: dict = {"kernel": args.kernel, "small_m": small_m, "cpu": cpu_description(),
                    "file": Path(loaded.file).name, "weights": loaded.weights,
                    "threads": backend.n_threads, "prompt_tokens": len(prompt),
                    "repeats": args.repeats, "buffers": list(backend.weight_buffers),
                    "paths": {}, "agreement": {}}
    for name in paths:
        med = {n: statistics.median(times[name][n]) for n in ns}
        result["paths"][name] = {"c_ms": {n: 1000 * med[n] for n in ns},
                                 "ratio": {n: med[n] / med[1] for n in ns}}
    if args.prefill:
        result["prefill"] = {"tokens": len(long_prompt), "repeats": args.prefill_repeats,
                             "ms": {p: 1000 * statistics.median(prefill_times[p]) for p in paths}}
    result["batch_rows_equal_one_token_steps"] = invariant
    one = {name: logits[name][1] for name in paths}
    for n in ns[1:]:
        a, b = logits[theirs][n], logits[ours][n]
        result["agreement"][n] = {"new vs old": _agreement(a, b), "same path": _same(n, small_m)}
    # Scale: the one-token path against each batched path at the first position, at the
    # largest n that the small-batch setting sends down its own path.
    n_cmp = max([n for n in ns[1:] if not _same(n, small_m)] or [ns[-1]])
    result["agreement"][f"first position of n={n_cmp} vs one-token step"] = {
        name: _agreement(logits[name][n_cmp][:1], one[name]) for name in paths}
    print(f"CPU: {result['cpu']}; {backend.n_threads} threads; weight buffers: {result['buffers']}")
    wanted = "AMX" if args.kernel == "amx" else "CPU_REPACK"  # the Q8_0 head has no buffer of its own
    if wanted not in result["buffers"]:
        print(f"no {wanted} weight buffers: both settings ran the same kernels", file=sys.stderr)
    print("n  " + "  ".join(f"{name:>24}" for name in paths))
    for n in ns:
        cells = [f"{result['paths'][p]['c_ms'][n]:8.1f} ms ({result['paths'][p]['ratio'][n]:.2f}x)" for p in paths]
        print(f"{n:<3}" + "  ".join(f"{c:>24}" for c in cells))
    for n in ns[1:]:
        g = result["agreement"][n]["new vs old"]
        same = " (same path: n > --small-m)" if _same(n, small_m) else ""
        print(f"n={n}: argmax agree {g['argmax_agree']:.3f}, TV max {g['tv_max']:.4f} "
              f"mean {g['tv_mean']:.4f}, max |dlogit| {g['max_abs_logit']:.3f}{same}")
    ratio1 = result["paths"][ours]["c_ms"][1] / result["paths"][theirs]["c_ms"][1]
    print(f"one-token step: {ours} / {theirs} = {ratio1:.3f}")
    for name in paths:
        rows = invariant[name]
        print(f"{name}: batch rows bitwise equal to one-token steps for n = "
              + (",".join(str(n) for n in ns if rows[n]) or "none"))
    if args.prefill:
        pm = result["prefill"]["ms"]
        print(f"prefill of {len(long_prompt)} tokens: {theirs} {pm[theirs]:.0f} ms, {ours} {pm[ours]:.0f} ms "
              f"({pm[theirs] / pm[ours]:.2f}x)")
    if args.out:
        path = Path(args.out)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
