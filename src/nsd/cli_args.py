"""Command-line flags generated from the option specs of :mod:`nsd.options`.

Every subcommand (``generate``, ``compare``, ``serve``, ``bench``) adds its flags from
here, so a flag's spelling, default, choices and help come from the one definition of its
option. A value of the wrong type is an argparse error (exit 2); a value out of range is
refused by the frozen config built from the parsed flags, with the option's own message.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence

from nsd import options as optspec
from nsd.options import Option


def _number(kind: type, allow_auto: bool) -> Callable[[str], Any]:
    noun = "a whole number" if kind is int else "a number"

    def parse(text: str) -> Any:
        if allow_auto and text == "auto":
            return text
        try:
            return kind(text)
        except ValueError:
            extra = " or 'auto'" if allow_auto else ""
            raise argparse.ArgumentTypeError(f"not {noun}{extra}: {text!r}") from None

    return parse


def _flag_label(option: Option) -> str:
    """The flag as errors and notes name it: every spelling a user may have typed
    (``-k/--draft-length``), so the message matches whichever one they used."""
    return "/".join(filter(None, (option.short, option.flag)))


def add_option(parser: argparse.ArgumentParser | Any, option: Option, **override: Any) -> None:
    """Add ``option`` as a flag; ``override`` replaces argparse keywords (e.g. a subcommand
    that takes several θ values)."""
    names = [option.short, option.flag] if option.short else [option.flag]
    kw: dict[str, Any] = {"dest": option.name, "default": option.default, "help": option.help}
    if option.type is bool:
        kw["action"] = "store_true"
    else:
        if option.choices is not None:
            kw["choices"] = list(option.choices)
        elif option.type in (int, float):
            kw["type"] = _number(option.type, option.auto)
        if option.metavar:
            kw["metavar"] = option.metavar
        if option.default is not None and option.type is not bool and "(default" not in option.help:
            kw["help"] = f"{option.help} (default: {option.default})"
    kw.update(override)
    kw["help"] = kw["help"].replace("%", "%%")  # argparse %-formats help; the specs are plain text
    parser.add_argument(*names, **kw)


def add_options(parser: argparse.ArgumentParser | Any, group: Mapping[str, Option],
                skip: Iterable[str] = ()) -> None:
    """Every option of ``group`` (e.g. ``options.DECODING``) but those in ``skip``."""
    skipped = set(skip)
    for name, option in group.items():
        if name not in skipped:
            add_option(parser, option)


def add_model_args(p: argparse.ArgumentParser, need_target: bool = True) -> None:
    """Which models, where drafts come from, and the backend options."""
    p.add_argument("--target", required=need_target, default=None,
                   help="target model: registry name (see `nsd models list`), .gguf file or HF folder")
    p.add_argument("--draft", default=None, help="draft model (same tokenizer as the target)")
    p.add_argument("--proposer", choices=optspec.PROPOSERS, default=None,
                   help="where drafts come from: the draft model, prompt lookup (ngram), or "
                        "hybrid: both, the cheaper per block (default: "
                        f"{optspec.DEFAULT_PROPOSER} with a draft model whose prompt-lookup "
                        "estimates are stored, as the built-in pair's; draft with another; "
                        f"{optspec.default_proposer(False)} without --draft)")
    add_options(p, optspec.BACKEND)
    # --compile alone means torch.compile.
    for action in p._actions:
        if action.dest == "compile":
            action.nargs, action.const = "?", "torch"


def add_decoding_args(p: argparse.ArgumentParser, with_method: bool = True,
                      skip: Iterable[str] = ()) -> None:
    """The decoding rule, sampling and draft-length options, plus stop strings."""
    skipped = set(skip) | (set() if with_method else {"method"})
    add_options(p, optspec.DECODING, skip=skipped)
    add_options(p, optspec.DRAFT_LENGTH, skip=skipped)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def generation_config(args: argparse.Namespace, **overrides: Any):
    """The validated :class:`~nsd.api.GenerationConfig` of parsed flags (before any model
    loads, so a bad value fails fast)."""
    from nsd.api import GenerationConfig
    from nsd.errors import NSDError

    if "" in (getattr(args, "stop", None) or []):
        raise NSDError("--stop takes a non-empty string: an empty one would stop nothing")
    k, k_max = getattr(args, "k", "auto"), getattr(args, "k_max", None)
    if getattr(args, "adaptive_k", False) and k != "auto" and k_max is not None and k_max < k:
        # The library says "k_max (4) must be >= k (10)"; here the flags are named.
        raise NSDError(f"--k-max ({k_max}) must be >= -k ({k}) with --adaptive-k")
    try:
        return GenerationConfig.from_mapping(vars(args), **overrides)
    except NSDError as err:  # checked once, by the library; here the flag is named as typed
        raise NSDError(_flag_named(str(err))) from None


def _flag_named(message: str) -> str:
    """A range error of :mod:`nsd.options` ("top_p must be ...") naming the flag instead
    ("--top-p must be ...")."""
    name, sep, rest = message.partition(" must be ")
    option = optspec.ALL.get(name)
    if not sep or option is None:
        return message
    return _flag_label(option) + sep + rest


def note_unused(args: argparse.Namespace, methods: Sequence[str], flag: str = "--method") -> None:
    """Say so where a flag set away from its default acts on none of the methods that will
    run (``--theta`` with ``--method sd``): it would change nothing. A note, not an error:
    the same flags are often passed to every method in turn."""
    given = _set_flags(args, (*optspec.DECODING, *optspec.DRAFT_LENGTH))
    proposer = _proposer(args)
    for name, why in optspec.inert_options(given, methods, getattr(args, "k", "auto"),
                                           getattr(args, "adaptive_k", False), proposer):
        option, value = optspec.ALL[name], given[name]
        if why == "fixed_k":
            print(f"nsd: --k-max {value} does nothing with a fixed -k {args.k} (it bounds -k auto "
                  "and --adaptive-k)", file=sys.stderr)
            continue
        named = _flag_label(option)
        if option.type is not bool:  # a switch is named alone: "--smooth", not "--smooth True"
            named = f"{named} {value}"
        if why == "proposer":
            _proposer_note(named, [proposer])
            continue
        print(f"nsd: {named} does nothing with {flag} {','.join(methods)} (it acts on "
              f"{', '.join(option.methods)})", file=sys.stderr)


def note_unread_by_proposers(args: argparse.Namespace, proposers: Sequence[str] | None = None) -> None:
    """Where no proposer that will run drafts with a draft model (``proposers``; None: the
    one the flags choose), say so of the options only a draft model reads
    (``--draft-context``). For front ends where any method may run (serve, bench), so only
    the proposer part of the inert-options rule applies."""
    proposers = list(proposers) if proposers is not None else [_proposer(args)]
    given = _set_flags(args, optspec.DRAFT_MODEL_OPTIONS)
    inert = [set(optspec.inert_options(given, optspec.SPECULATIVE, proposer=p)) for p in proposers]
    for name in given:
        if all((name, "proposer") in found for found in inert):
            _proposer_note(f"{_flag_label(optspec.ALL[name])} {given[name]}", proposers)


def _set_flags(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options of ``names`` the command line set away from their defaults."""
    given = {}
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value != optspec.ALL[name].default:
            given[name] = value
    return given


def _proposer(args: argparse.Namespace) -> str:
    """The proposer the flags choose, as far as a draft model is concerned: without
    --proposer, one that drafts with the draft model where one is given, else prompt lookup."""
    return getattr(args, "proposer", None) or optspec.default_proposer(bool(getattr(args, "draft", None)))


def _proposer_note(named: str, proposers: Sequence[str]) -> None:
    print(f"nsd: {named} does nothing with the {','.join(proposers)} proposer (only a draft model "
          "reads it)", file=sys.stderr)


def backend_options(args: argparse.Namespace):
    from nsd.api import BackendOptions

    check_flags(args, optspec.BACKEND)
    _warn_threads(getattr(args, "threads", None), os.cpu_count() or 1)
    return BackendOptions.from_mapping(vars(args))


@functools.lru_cache(maxsize=None)  # once per process, however often the options are read
def _warn_threads(threads: int | None, cores: int) -> None:
    if threads is not None and threads > cores:
        print(f"nsd: --threads {threads} on {cores} cores: llama.cpp runs slower with more "
              "threads than cores", file=sys.stderr)


def check_flags(args: argparse.Namespace, names: Mapping[str, Option] | Iterable[str]) -> None:
    """Range errors name the flag as typed (``--top-p``), not the field. ``names``: a group
    of :mod:`nsd.options` (``optspec.SERVING``) or names of :data:`nsd.options.ALL`."""
    group = names if isinstance(names, Mapping) else {n: optspec.ALL[n] for n in names}
    for name, option in group.items():
        value = getattr(args, name, None)
        if value is not None and not isinstance(value, list):  # bench's θ/B lists: per value
            option.check(value, label=_flag_label(option))
