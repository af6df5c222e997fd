"""Command-line interface: ``nsd generate``, ``nsd compare``, ``nsd serve``, ``nsd models``,
``nsd bench``.

argparse lives here and only here; everything below it takes frozen configs. Errors the
user can cause print one line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

from nsd.errors import NSDError


def _float_arg(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _k_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number or 'auto': {text!r}") from None


def add_model_args(p: argparse.ArgumentParser, need_target: bool = True) -> None:
    p.add_argument("--target", required=need_target, default=None,
                   help="target model: registry name (see `nsd models list`), .gguf file or HF folder")
    p.add_argument("--draft", default=None, help="draft model (same tokenizer as the target)")
    p.add_argument("--proposer", choices=["draft", "ngram"], default=None,
                   help="where drafts come from (default: draft if --draft is given, else ngram)")
    p.add_argument("--backend", choices=["auto", "llama", "hf"], default="auto",
                   help="model engine: llama.cpp for GGUF (auto when installed) or transformers")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights dtype for the transformers backend (auto: bfloat16 on CUDA, "
                        "float32 on CPU)")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where the transformers backend runs (auto: CUDA when torch sees a GPU; "
                        "then --backend auto picks transformers)")
    p.add_argument("--compile", nargs="?", const="torch", default="none",
                   choices=["none", "torch", "cudagraph"],
                   help="transformers backend: graph the short forwards with torch.compile (CUDA "
                        "graphs on CUDA), or capture plain CUDA graphs (cudagraph; CUDA only)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="draft over a reduced vocabulary: the N most frequent tokens plus the "
                        "special ones (llama.cpp drafts; cheaper draft steps, SD stays exact)")
    p.add_argument("--weights", choices=["auto", "original", "q4_0", "q8_0"], default="auto",
                   help="GGUF weight format: the file as given, a Q4_0/Q8_0 copy derived from it "
                        "once, or auto: the one with the cheapest step measured on this machine")
    p.add_argument("--draft-weights", choices=["auto", "original", "q4_0", "q8_0"], default=None,
                   help="weight format of the draft (default: as --weights)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--n-ctx", type=int, default=4096,
                   help="context length (llama.cpp; the transformers backend's static KV cache)")


def add_decoding_args(p: argparse.ArgumentParser, with_method: bool = True) -> None:
    if with_method:
        p.add_argument("--method", choices=["ar", "sd", "nsd", "typical"], default="nsd",
                       help="ar: autoregressive; sd: exact speculative sampling; nsd: nucleus "
                            "speculative decoding; typical: Medusa-style typical acceptance")
    p.add_argument("--theta", type=_float_arg, default=0.9, help="NSD nucleus threshold θ in [0, 1]")
    p.add_argument("--budget", type=_float_arg, default=math.inf,
                   help="hard fidelity budget B: cap on the summed deviation D per sequence")
    p.add_argument("--cap", type=_float_arg, default=math.inf,
                   help="per-position cap δ: positions with E_t > δ are verified exactly")
    p.add_argument("--smooth", action="store_true",
                   help="spend the last remainder of the budget with a partial relaxation")
    # Medusa's defaults: ε = posterior_threshold, δ = posterior_alpha.
    p.add_argument("--typical-epsilon", type=_float_arg, default=0.09,
                   help="typical acceptance ε: p(x) > min(ε, δ·exp(−H)) (default 0.09, as Medusa)")
    p.add_argument("--typical-delta", type=_float_arg, default=0.3,
                   help="typical acceptance δ (default 0.3, as Medusa)")
    p.add_argument("-k", "--draft-length", dest="k", type=_k_arg, default="auto",
                   help="draft tokens per block, or auto (default): before each block the cost "
                        "model picks the k (0 = plain step) with the most expected tokens/s")
    p.add_argument("--k-max", type=int, default=8, help="largest k for -k auto and --adaptive-k")
    p.add_argument("--adaptive-k", action="store_true", help="grow/shrink k with acceptance")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=_float_arg, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--top-p", type=_float_arg, default=1.0, help="1 disables")
    p.add_argument("--min-p", type=_float_arg, default=0.0, help="0 disables")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def generation_config(args: argparse.Namespace, method: str | None = None):
    from nsd.api import GenerationConfig

    cfg = GenerationConfig(
        method=method or args.method, theta=args.theta, budget=args.budget, cap=args.cap,
        smooth=args.smooth, typical_epsilon=args.typical_epsilon, typical_delta=args.typical_delta,
        k=args.k, k_max=args.k_max, adaptive_k=args.adaptive_k, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        seed=args.seed, stop=tuple(args.stop))
    cfg.decode_config()  # validate every knob before any model is loaded
    return cfg


def make_engine(args: argparse.Namespace, needs_proposer: bool = True):
    from nsd.api import BackendOptions, Engine

    options = BackendOptions(backend=args.backend, dtype=args.dtype, threads=args.threads,
                             n_ctx=args.n_ctx, weights=args.weights, draft_weights=args.draft_weights,
                             device=args.device, compile=args.compile)
    proposer = args.proposer if needs_proposer else ("draft" if args.draft else "ngram")
    return Engine(args.target, draft=args.draft, proposer=proposer, options=options,
                  draft_vocab=args.draft_vocab, k_max=getattr(args, "k_max", 8))


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise NSDError("give either --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            text = sys.stdin.read() if args.prompt_file == "-" else open(args.prompt_file, encoding="utf-8").read()
        except OSError as exc:
            raise NSDError(f"cannot read prompt file {args.prompt_file}: {exc.strerror}") from exc
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise NSDError("no prompt: give --prompt TEXT or --prompt-file FILE")
    if not text.strip():
        raise NSDError("the prompt is empty")
    return text


def summary_line(stats) -> str:
    parts = [f"{stats.method}: {stats.new_tokens} tokens in {stats.wall_s:.2f}s "
             f"({stats.tokens_per_s:.1f} tok/s)", f"target passes {stats.target_passes}",
             f"tau {stats.tau:.2f}"]
    if stats.drafted_tokens:
        parts.append(f"accepted {stats.accepted_tokens}/{stats.drafted_tokens} "
                     f"({100 * stats.acceptance_rate:.0f}%)")
        parts.append(f"relaxed {stats.relaxed_accepts}")
        parts.append(f"D {stats.deviation:.3f}")
    if stats.k_per_pass:
        parts.append(f"mean k {sum(stats.k_per_pass) / len(stats.k_per_pass):.1f}")
    parts.append(f"stop: {stats.stop_reason}")
    return " | ".join(parts)


def cmd_generate(args: argparse.Namespace) -> int:
    config = generation_config(args)
    prompt = _read_prompt(args)
    engine = make_engine(args, needs_proposer=config.method != "ar")
    ids = engine.encode(prompt, chat=args.chat, system=args.system)
    stream = engine.stream(ids, config)
    while True:
        try:
            chunk = next(stream)
        except StopIteration as done:
            result = done.value
            break
        if not args.json:
            sys.stdout.write(chunk)
            sys.stdout.flush()
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print(summary_line(result.stats), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from nsd.serve import ServerConfig, run_server
    from nsd.serve.server import default_model_name

    config = ServerConfig(
        model_name=args.served_model_name or default_model_name(args.target),
        defaults=generation_config(args), host=args.host, port=args.port, api_key=args.api_key,
        queue_size=args.queue_size, request_timeout_s=args.request_timeout,
        shutdown_timeout_s=args.shutdown_timeout)
    run_server(config, lambda: make_engine(args), log_level=args.log_level)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from nsd.compare import DEFAULT_PROMPTS, run_compare

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    configs = [generation_config(args, method=m) for m in methods]
    prompts = [args.prompt] if args.prompt else list(DEFAULT_PROMPTS)
    engine = make_engine(args)
    print(run_compare(engine, prompts, configs, chat=args.chat))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from nsd import models

    if args.models_cmd == "list":
        for spec, present in models.list_models():
            mark = "fetched" if present else "not fetched"
            print(f"{spec.name:32s} {mark:12s} {spec.description}")
        print(f"cache: {models.cache_dir()}")
    elif args.models_cmd == "fetch":
        for name in args.names:
            path = models.fetch_gguf(name)
            if args.hf:
                models.ensure_hf_folder(name)
            print(path)
    elif args.models_cmd == "verify":
        for name in args.names:
            if name in models.REGISTRY:
                for line in models.verify_model(name):
                    print(line)
                continue
            models.resolve_model(name)  # checks a file's structure, or says it is unknown
            print(f"{name}: structure ok (not a registry model: no pinned SHA-256 to compare)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nsd", description="Nucleus Speculative Decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with AR, SD, NSD or typical acceptance")
    add_model_args(gen)
    add_decoding_args(gen)
    gen.add_argument("--prompt", default=None)
    gen.add_argument("--prompt-file", default=None, help="file with the prompt ('-' = stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--json", action="store_true", help='print {"text": ..., "stats": {...}}')
    gen.set_defaults(func=cmd_generate)

    cmp_ = sub.add_parser("compare", help="AR vs SD vs NSD side by side on a few prompts")
    add_model_args(cmp_)
    add_decoding_args(cmp_, with_method=False)
    cmp_.add_argument("--methods", default="ar,sd,nsd", help="comma-separated methods")
    cmp_.add_argument("--prompt", default=None, help="one prompt instead of the built-in ones")
    cmp_.add_argument("--chat", action="store_true")
    cmp_.set_defaults(func=cmd_compare)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_model_args(srv)
    add_decoding_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    srv.add_argument("--api-key", default=os.environ.get("NSD_API_KEY"),
                     help="require 'Authorization: Bearer KEY' (default: $NSD_API_KEY, else none)")
    srv.add_argument("--served-model-name", default=None,
                     help="the id clients send as 'model' (default: the --target name)")
    srv.add_argument("--queue-size", type=int, default=16,
                     help="requests that may wait behind the running one; more get 429")
    srv.add_argument("--request-timeout", type=_float_arg, default=600.0, metavar="S",
                     help="seconds from arrival to the last token, queueing included")
    srv.add_argument("--shutdown-timeout", type=_float_arg, default=30.0, metavar="S",
                     help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    srv.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    srv.set_defaults(func=cmd_serve)

    mod = sub.add_parser("models", help="list, fetch or verify the registry models")
    msub = mod.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="registry models and whether they are in the cache")
    fetch = msub.add_parser("fetch", help="download, join and hash-check models")
    fetch.add_argument("names", nargs="+")
    fetch.add_argument("--hf", action="store_true", help="also convert for the transformers backend")
    verify = msub.add_parser("verify", help="re-hash fetched models against the pinned SHA-256")
    verify.add_argument("names", nargs="+")
    mod.set_defaults(func=cmd_models)

    from nsd.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except NSDError as exc:
        print(f"nsd: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("nsd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
