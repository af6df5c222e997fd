"""Command-line interface: ``nsd generate``, ``nsd compare``, ``nsd serve``, ``nsd models``,
``nsd bench``.

argparse lives here and only here; everything below it takes frozen configs. Errors the
user can cause print one line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn, Sequence

from nsd import options as optspec
from nsd.cli_args import (add_decoding_args, add_model_args, add_options, backend_options,
                          check_flags, generation_config, note_unread_by_proposers,
                          note_unused)
from nsd.errors import NSDError


def _int_in(low: int, high: int | None = None):
    """An argparse type: a whole number in [low, high], so a bad value names its flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def _float_arg(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def make_engine(args: argparse.Namespace, needs_proposer: bool = True):
    from nsd.api import load_engine

    proposer = args.proposer if needs_proposer else optspec.default_proposer(bool(args.draft))
    return load_engine(args.target, draft=args.draft, proposer=proposer,
                       options=backend_options(args), k_max=args.k_max)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise NSDError("give either --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            text = sys.stdin.read() if args.prompt_file == "-" else open(args.prompt_file, encoding="utf-8").read()
        except OSError as exc:
            raise NSDError(f"cannot read prompt file {args.prompt_file}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            where = "standard input" if args.prompt_file == "-" else f"prompt file {args.prompt_file}"
            raise NSDError(f"{where} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                           f"offset {exc.start})") from None
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise NSDError("no prompt: give --prompt TEXT or --prompt-file FILE")
    return _nonblank(text)


def _nonblank(text: str) -> str:
    # On the command line a blank prompt is a mistake (the library would take its tokens).
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
        bound = stats.method in optspec.DEVIATION_BOUND_METHODS  # FLy: a bound, not exact
        parts.append(f"D {'≤ ' if bound else ''}{stats.deviation:.3f}")
    if stats.k_per_pass:
        parts.append(f"mean k {sum(stats.k_per_pass) / len(stats.k_per_pass):.1f}")
    parts.append(f"stop: {stats.stop_reason}")
    return " | ".join(parts)


def cmd_generate(args: argparse.Namespace) -> int:
    config = generation_config(args)
    note_unused(args, [config.method])
    prompt = _read_prompt(args)
    if args.system is not None and not args.chat:  # before the models load
        raise NSDError("--system needs --chat: the system message goes into the chat template")
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
        from nsd.api import method_report

        # The server's usage.nsd shape: the method asked for, and the one that ran.
        out = result.to_dict()
        out["stats"].update(method_report(config, result.stats.method))
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print(summary_line(result.stats), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from nsd.serve import ServerConfig, run_server
    from nsd.serve.server import default_model_name

    check_flags(args, optspec.SERVING)  # range errors name the flag (--parallel), not the field
    note_unread_by_proposers(args)  # any method may be asked for: the proposer alone decides
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise NSDError("--served-model-name is empty: give the name clients will send, or leave "
                       "the flag out to serve the target's name")
    config = ServerConfig(
        model_name=args.served_model_name or default_model_name(args.target),
        defaults=generation_config(args), host=args.host, port=args.port, api_key=args.api_key,
        queue_size=args.queue_size, request_timeout_s=args.request_timeout,
        shutdown_timeout_s=args.shutdown_timeout, prefix_cache_mb=args.prefix_cache_mb,
        parallel=args.parallel, prefill_chunk=args.prefill_chunk, max_stop=args.max_stop)
    run_server(config, lambda: make_engine(args), log_level=args.log_level)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from nsd.bench.compare import DEFAULT_PROMPTS, check_methods, run_compare

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    check_methods(methods)  # before the models load
    configs = [generation_config(args, method=m) for m in methods]
    note_unused(args, methods, flag="--methods")
    # An empty --prompt is a mistake, as in generate, not a request for the built-in ones.
    prompts = [_nonblank(args.prompt)] if args.prompt is not None else list(DEFAULT_PROMPTS)
    engine = make_engine(args)
    print(run_compare(engine, prompts, configs, chat=args.chat, warmup=args.warmup))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from nsd import models

    if args.models_cmd == "list":
        for spec, present in models.list_models():
            mark = "fetched" if present else "not fetched"
            print(f"{spec.name:32s} {mark:12s} {spec.description}")
        print(f"cache: {models.cache_dir()}")
    elif args.models_cmd == "fetch":
        for name in args.names:  # registry models only: a file or folder needs no fetching
            if name not in models.REGISTRY:
                from nsd.models.registry import unknown_model_message

                raise NSDError(unknown_model_message(name, paths=False))
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


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the usage block it prints first buries the line that
    says what is wrong (subcommands' parsers are made of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    """The installed package's version (its metadata, as pip reports it); the source
    tree's own where nsd runs uninstalled."""
    import importlib.metadata

    from nsd import __version__

    try:
        return importlib.metadata.version("nsd")
    except importlib.metadata.PackageNotFoundError:
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nsd", description="Nucleus Speculative Decoding")
    parser.add_argument("--version", action="version", version=f"nsd {version()}")
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
    cmp_.add_argument("--no-warmup", dest="warmup", action="store_false",
                      help="skip the short untimed warm-up call of each method")
    cmp_.set_defaults(func=cmd_compare)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_model_args(srv)
    add_decoding_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=_int_in(0, 65535), default=8000,
                     help="0 picks a free port (default: 8000)")
    srv.add_argument("--api-key", default=os.environ.get("NSD_API_KEY"),
                     help="require 'Authorization: Bearer KEY' (default: $NSD_API_KEY, else none)")
    srv.add_argument("--served-model-name", default=None,
                     help="the id clients send as 'model' (default: the --target name)")
    add_options(srv, optspec.SERVING)
    srv.add_argument("--queue-size", type=_int_in(0), default=16,
                     help="requests that may wait behind the running ones; more get 429 (default: 16)")
    srv.add_argument("--request-timeout", type=_float_arg, default=600.0, metavar="S",
                     help="seconds from arrival to the last token, queueing included")
    srv.add_argument("--shutdown-timeout", type=_float_arg, default=30.0, metavar="S",
                     help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    srv.add_argument("--prefix-cache-mb", type=_float_arg, default=1024.0, metavar="MB",
                     help="memory for KV snapshots of recent sequences, reused by later prompts "
                          "sharing their prefix (default: 1024). The server's memory grows by up "
                          "to this much as it serves; a snapshot costs its tokens' KV (~40 KB per "
                          "token for a 1.5B Qwen2.5 target with its 0.5B draft). Least recently "
                          "used evicted first; 0 keeps only the live cache. /metrics: "
                          "nsd_prefix_cache_bytes_held against nsd_prefix_cache_budget_bytes")
    srv.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    srv.set_defaults(func=cmd_serve)

    mod = sub.add_parser("models", help="list, fetch or verify the registry models")
    msub = mod.add_subparsers(dest="models_cmd", required=True, metavar="{list,fetch,verify}")
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


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parsed flags; an unknown one is reported by the (sub)command it was given to, so
    the error points at that command's help, not the top level's."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = parser
        while True:
            sub = next((a for a in command._actions if isinstance(a, argparse._SubParsersAction)), None)
            if sub is None or getattr(args, sub.dest, None) not in sub.choices:
                break
            command = sub.choices[getattr(args, sub.dest)]
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # bare `nsd`: what it can do, not an error about a missing argument
        parser.print_help(sys.stderr)
        return 2
    args = _parse(parser, argv)
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
