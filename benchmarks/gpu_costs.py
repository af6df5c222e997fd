"""Step costs c(n) of Qwen2.5 architectures on whatever device is present, plus nsd's own
per-pass overhead — the numbers a GPU speedup prediction needs (see gpu_predict.py). The
measuring is nsd.bench.gpu_costs; this command picks the models, sizes and output file.

Models are built from the public Qwen2.5 configs with random weights (no downloads): the
cost of a forward depends on the shapes, not on the weight values. For each model:

* ``c(n)``: median wall time of one ``forward`` of ``n`` new tokens (logits for all of
  them) through nsd's transformers backend, with the static KV cache already holding
  ``--context`` tokens and a rewind back to them before every call; n = 1..17. Modes:
  ``eager`` always; on CUDA also ``cudagraph`` (captured CUDA graphs) and, with
  ``--torch-compile``, ``torch`` (torch.compile, reduce-overhead). CUDA is synchronised
  before and after every timed call.
* nsd's overhead per pass: ``logits_to_probs`` + ``verify`` on ``[k + 1, V]`` logits on
  the same device (greedy and sampled, exact and nucleus rules).

    python benchmarks/gpu_costs.py                 # all three models, n = 1..17
    python benchmarks/gpu_costs.py --quick         # 0.5B only, n in {1, 2, 5}: a smoke test

Writes ``benchmarks/results/gpu_costs_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nsd.backends.hf import resolve_device, resolve_dtype
from nsd.bench.gpu_costs import ARCHS, DEFAULT_MODELS, cpu_name, machine, measure


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--models", default=None, help=f"comma-separated, from {', '.join(ARCHS)}")
    parser.add_argument("--max-n", type=int, default=17, help="measure n = 1..max_n")
    parser.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per n (10; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="0.5B only, n in {1, 2, 5}, 3 reps: a smoke run")
    parser.add_argument("--no-graphs", action="store_true", help="eager only, even on CUDA")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also time torch.compile graphs on CUDA (minutes of compile time)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/gpu_costs_<device>.json")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    models = args.models.split(",") if args.models else (["qwen2.5-0.5b"] if args.quick else list(DEFAULT_MODELS))
    unknown = [m for m in models if m not in ARCHS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(ARCHS)}")
    ns = [1, 2, 5] if args.quick else list(range(1, args.max_n + 1))
    reps = args.reps or (3 if args.quick else 10)
    modes = ["eager"]
    if device.type == "cuda" and not args.no_graphs:
        modes.append("cudagraph")
        if args.torch_compile:
            modes.append("torch")
    print(f"device {device} ({machine(device).get('gpu', cpu_name())}), dtype "
          f"{str(dtype).removeprefix('torch.')}, context {args.context}, n = {ns}, modes {modes}",
          flush=True)

    report = measure(models, device, dtype, ns, args.context, reps, args.warmup, modes,
                     log=lambda line: print(line, flush=True))
    out = args.out or Path(__file__).resolve().parent / "results" / f"gpu_costs_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
