"""What `--weights auto` measured and kept on this machine: c(1) of every weight format of
each model, measured side by side (from the calibration cache when this machine has
measured them before, else measured now, on a quiet machine please).

    python benchmarks/weights_pick.py qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse

from nsd.draftlen.machine import cpu_description
from nsd.models.loader import BackendOptions, load_backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"CPU: {cpu['model']} ({cpu['cores']} cores, AMX {cpu['amx']}), threads {args.threads or 'all'}")
    for model in args.models:
        loaded = load_backend(model, BackendOptions(backend="llama", weights="auto", threads=args.threads),
                              calibrate_n=2)
        shown = ", ".join(f"{fmt} {1e3 * c:.1f} ms" for fmt, c in loaded.candidates.items())
        print(f"{model}: c(1) {shown}; auto keeps {loaded.weights}")
        loaded.backend.close()


if __name__ == "__main__":
    main()
