"""Step costs of the derived Q4_0 target with llama.cpp's default output head (Q6_K where
the rows allow) against nsd's Q8_0 head, side by side in one process.

    python benchmarks/head_format.py --target qwen2.5-coder-1.5b-instruct --repeats 9

The Q6_K-head copy is quantised into a temporary folder (llama.cpp's default recipe, as
nsd derived Q4_0 files before) and removed afterwards; the Q8_0-head one is nsd's own
derived file. For each n: one forward of n tokens after 260 cached tokens, rewound, the
two files in turn within every repetition; medians.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nsd.backends.llama_cpp import LlamaCppBackend, import_llama_cpp
from nsd.errors import NSDError
from nsd.draftlen.machine import cpu_description
from nsd.models.registry import fetch_gguf
from nsd.models.weights import gguf_for


def _default_head_q4_0(source: Path, out: Path) -> None:
    lib = import_llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = 2, True  # LLAMA_FTYPE_MOSTLY_Q4_0
    if lib.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise NSDError(f"llama.cpp could not quantise {source}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    ns = (1, 2, 5, 8)
    try:
        source = fetch_gguf(args.target, progress=False)
        with tempfile.TemporaryDirectory() as tmp:
            default = Path(tmp) / "q4_0-default-head.gguf"
            _default_head_q4_0(source, default)
            files = {"default head": default, "Q8_0 head": gguf_for(source, "q4_0")}
            backends = {k: LlamaCppBackend(p, n_threads=args.threads) for k, p in files.items()}
            prompt = [(i * 7919) % 140000 + 100 for i in range(260)]
            for b in backends.values():
                b.forward(prompt, all_logits=False)
            times: dict[tuple[str, int], list[float]] = {}
            for rep in range(args.repeats + 1):  # the first round warms up
                for n in ns:
                    for name, b in backends.items():
                        t0 = time.perf_counter()
                        b.forward(list(range(3000, 3000 + n)))
                        dt = time.perf_counter() - t0
                        b.rewind(len(prompt))
                        if rep:
                            times.setdefault((name, n), []).append(dt)
            for b in backends.values():
                b.close()
    except NSDError as exc:
        print(f"head_format: {exc}", file=sys.stderr)
        return 2
    print(f"CPU: {cpu_description()}; median of {args.repeats}, ms per forward")
    print("n   " + "  ".join(f"{k:>13}" for k in files))
    for n in ns:
        print(f"{n:<4}" + "  ".join(f"{1000 * statistics.median(times[(k, n)]):13.1f}" for k in files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
