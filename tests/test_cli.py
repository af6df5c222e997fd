"""CLI bad-input handling: clear one-line errors and exit status 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nsd.api import GenerationConfig
from nsd.cli import build_parser, main
from nsd.rules.verify import RuleConfig


@pytest.mark.parametrize("argv, message", [
    (["generate", "--target", "qwen2.5-coder-1.5b-instrct", "--prompt", "x"], "did you mean"),
    (["generate", "--target", "smollm2-135m-instruct", "--theta", "1.5", "--prompt", "x"], "theta"),
    (["generate", "--target", "smollm2-135m-instruct", "--theta", "-0.2", "--prompt", "x"], "theta"),
    (["generate", "--target", "smollm2-135m-instruct", "--budget", "-1", "--prompt", "x"], "budget"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt", "   "], "empty"),
    (["generate", "--target", "smollm2-135m-instruct"], "no prompt"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "-k", "0"], "draft-length"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--top-p", "0"], "top-p"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt-file", "/nonexistent/p.txt"], "cannot read"),
    (["generate", "--target", "smollm2-135m-instruct", "--method", "sd", "--proposer", "draft",
      "--prompt", "x"], "draft model"),
    (["models", "verify", "no-such-model"], "unknown model"),
    (["compare", "--target", "smollm2-135m-instruct", "--methods", "ar,nsd,ar"], "more than once"),
])
def test_bad_input_exits_2_with_message(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err.lower() and "Traceback" not in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("extra, message", [
    (["--methods", ""], "no methods"),
    (["--methods", " , "], "no methods"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "  \n"], "the prompt is empty"),
])
def test_compare_rejects_empty_methods_and_prompt_before_loading(extra, message, monkeypatch,
                                                                 capsys) -> None:
    import nsd.cli

    monkeypatch.setattr(nsd.cli, "make_engine", lambda args: pytest.fail("loaded a model"))
    assert main(["compare", "--target", "smollm2-135m-instruct", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nsd: error: {message}")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_compare_warms_up_unless_told_not_to(monkeypatch, capsys) -> None:
    import nsd.cli
    from test_compare import _counting_engine

    for flags, warm_calls in (([], 2), (["--no-warmup"], 0)):
        engine, calls = _counting_engine()
        monkeypatch.setattr(nsd.cli, "make_engine", lambda args: engine)
        argv = ["compare", "--target", "t", "--methods", "ar,sd", "--prompt", "abc",
                "--max-new-tokens", "6", *flags]
        assert main(argv) == 0
        assert len(calls) == warm_calls + 2 and calls[-1].max_new_tokens == 6
        assert "| sd |" in capsys.readouterr().out


def test_argparse_typos_exit_2() -> None:
    for argv, command in ((["generate", "--theta", "abc"], "nsd generate"),
                          (["bench", "--methods", "ar", "--no-such-flag"], "nsd bench"),
                          (["models", "fetch", "x", "--nope"], "nsd models fetch"),
                          (["genrate"], "nsd")):
        proc = subprocess.run([sys.executable, "-m", "nsd.cli", *argv], capture_output=True, text=True)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        # One line: what is wrong and the help of the command it was given to, not the
        # whole usage block first.
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"{command}: error:") \
            and f"(see {command} --help)" in proc.stderr, proc.stderr
    bare = subprocess.run([sys.executable, "-m", "nsd.cli"], capture_output=True, text=True)
    assert bare.returncode == 2 and "generate" in bare.stderr and "serve" in bare.stderr


def test_models_list_runs(capsys) -> None:
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        assert name in out


def test_typical_acceptance_defaults_are_medusas() -> None:
    # Medusa accepts p(x) > min(ε, δ·exp(−H)) with ε = posterior_threshold = 0.09 and
    # δ = posterior_alpha = 0.3; every layer must default to that pair, not the swap.
    assert (RuleConfig().typical_epsilon, RuleConfig().typical_delta) == (0.09, 0.3)
    config = GenerationConfig()
    assert (config.typical_epsilon, config.typical_delta) == (0.09, 0.3)
    rule = GenerationConfig(method="typical").rule()
    assert (rule.typical_epsilon, rule.typical_delta) == (0.09, 0.3)
    parser = build_parser()
    for argv in (["generate", "--target", "t"], ["compare", "--target", "t"], ["bench"]):
        args = parser.parse_args(argv)
        assert (args.typical_epsilon, args.typical_delta) == (0.09, 0.3), argv


# --- damaged model files: one `nsd: error:` line naming the file, exit 2 ----------------


def _damaged(kind: str, tmp_path):
    import json
    import os
    import struct

    from gguf_files import metadata_end, write_tiny_gguf

    good = write_tiny_gguf(tmp_path / "good.gguf")
    raw = good.read_bytes()
    path = tmp_path / "bad.gguf"
    if kind.startswith("hf-"):
        path = tmp_path / "bad-hf"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
        if kind != "hf-no-tokenizer":
            (path / "tokenizer.json").write_text("{}")
        if kind != "hf-no-weights":
            header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
            (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
        return path, {"hf-no-weights": "no model weights", "hf-no-tokenizer": "no tokenizer"}[kind]
    if kind == "no-tokenizer":
        return write_tiny_gguf(path, tokenizer=False), "has no tokenizer"
    if kind == "unknown-arch":
        return write_tiny_gguf(path, arch="nosucharch"), "unsupported architecture 'nosucharch'"
    content, expected = {
        "cut-header": (raw[:16], "truncated"),
        "cut-metadata": (raw[:metadata_end(good) - 30], "truncated"),
        "cut-data": (raw[:len(raw) - 4000], "truncated"),
        "wrong-magic": (b"GGML" + raw[4:], "not a GGUF file"),
        "zero-bytes": (b"", "empty"),
        "random-bytes": (os.urandom(4096).replace(b"G", b"g"), "not a GGUF file"),
    }[kind]
    path.write_bytes(content)
    return path, expected


@pytest.mark.parametrize("kind", ["cut-header", "cut-metadata", "cut-data", "wrong-magic",
                                  "zero-bytes", "random-bytes", "no-tokenizer", "unknown-arch",
                                  "hf-no-weights", "hf-no-tokenizer"])
def test_damaged_model_file_gives_one_error_line(kind, tmp_path, capsys) -> None:
    path, expected = _damaged(kind, tmp_path)
    for backend in ("auto", "hf"):
        assert main(["generate", "--target", str(path), "--prompt", "hi", "--backend", backend]) == 2
        err = capsys.readouterr().err
        assert err.startswith("nsd: error: ") and err.count("\n") == 1, err
        assert str(path) in err and expected in err and "Traceback" not in err


def test_damaged_draft_is_named_too(tmp_path, capsys) -> None:
    from gguf_files import write_tiny_gguf

    target = write_tiny_gguf(tmp_path / "target.gguf")
    draft, _ = _damaged("cut-data", tmp_path)
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "hi",
                 "--backend", "llama"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nsd: error: ") and err.count("\n") == 1
    assert str(draft) in err and "truncated" in err


def test_models_verify_a_damaged_file_path(tmp_path, capsys) -> None:
    path, _ = _damaged("cut-data", tmp_path)
    assert main(["models", "verify", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nsd: error: ") and "truncated" in err and err.count("\n") == 1


@pytest.mark.parametrize("command", ["generate", "compare", "serve", "bench", "models"])
def test_every_subcommands_help_prints(command, capsys) -> None:
    """Help texts come from the option specs, which are plain text (a "10%" once broke
    argparse's %-formatting of --help)."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0 and "usage:" in capsys.readouterr().out


def test_more_bad_input_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    cases = [
        (["generate", "--target", "smollm2-135m-instruct", "--prompt-file", str(binary)],
         "is not utf-8 text (byte 0xff at offset 0)"),
        (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--system", "be nice"],
         "--system needs --chat"),
        (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--threads", "5000"], "--threads"),
        (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--k-max", "65"], "--k-max"),
        # A range error names the flag by every spelling, the one-letter alias too.
        (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "-k", "0"],
         "-k/--draft-length must be a whole number in [1, 64]"),
        (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--stop", ""],
         "--stop takes a non-empty string"),
        (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "-k", "10", "--k-max", "4",
          "--adaptive-k"], "--k-max (4) must be >= -k (10) with --adaptive-k"),
        (["serve", "--target", "smollm2-135m-instruct", "--served-model-name", " "],
         "--served-model-name is empty"),
        # A flag that cannot act is refused before any model loads (SmolLM2 has no draft).
        (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--draft-vocab", "1000"],
         "--draft-vocab sets the draft model's vocabulary"),
        # fetch takes registry names only; every name is checked before any download.
        (["models", "fetch", "smollm2-135m-instruct", "nosuchmodel"],
         "unknown model 'nosuchmodel': not a registry name."),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err.lower() and "Traceback" not in err and err.count("\n") == 1, (argv, err)


def test_compile_on_the_llama_backend_is_refused_not_ignored(tmp_path) -> None:
    pytest.importorskip("llama_cpp")
    from gguf_files import write_tiny_gguf
    from nsd.api import BackendOptions
    from nsd.errors import NSDError
    from nsd.models.loader import load_backend

    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(NSDError, match=r"--compile torch is for the transformers backend"):
        load_backend(str(gguf), BackendOptions(backend="llama", compile="torch"))
    with pytest.raises(NSDError, match=r"--dtype float16 is for the transformers backend"):
        load_backend(str(gguf), BackendOptions(backend="llama", dtype="float16"))


def test_a_flag_no_chosen_method_uses_gets_a_note(capsys) -> None:
    from nsd.cli_args import note_unused

    args = build_parser().parse_args(["generate", "--target", "t", "--method", "sd", "--theta", "0.5",
                                      "--typical-delta", "0.2", "--cap", "1", "-k", "4"])
    note_unused(args, ["sd"])
    err = capsys.readouterr().err.splitlines()
    assert err == ["nsd: --theta 0.5 does nothing with --method sd (it acts on nsd)",
                   "nsd: --cap 1.0 does nothing with --method sd (it acts on nsd, typical, topk_delta, "
                   "threshold, fly)",
                   "nsd: --typical-delta 0.2 does nothing with --method sd (it acts on typical)"]
    note_unused(args, ["ar", "nsd"], flag="--methods")  # θ and the cap act on nsd; k on nsd too
    assert capsys.readouterr().err.splitlines() == [
        "nsd: --typical-delta 0.2 does nothing with --methods ar,nsd (it acts on typical)"]
    note_unused(args, ["ar"])
    assert "-k/--draft-length 4 does nothing with --method ar" in capsys.readouterr().err
    default = build_parser().parse_args(["generate", "--target", "t", "--method", "sd"])
    note_unused(default, ["sd"])  # defaults say nothing
    assert capsys.readouterr().err == ""
    # --k-max bounds -k auto and --adaptive-k; beside a fixed k it does nothing.
    fixed = build_parser().parse_args(["generate", "--target", "t", "-k", "4", "--k-max", "4"])
    note_unused(fixed, ["nsd"])
    assert capsys.readouterr().err == "nsd: --k-max 4 does nothing with a fixed -k 4 (it bounds -k auto and --adaptive-k)\n"
    for argv in (["-k", "auto", "--k-max", "4"], ["-k", "4", "--adaptive-k", "--k-max", "6"]):
        note_unused(build_parser().parse_args(["generate", "--target", "t", *argv]), ["nsd"])
        assert capsys.readouterr().err == ""
    # --draft-context sets what the draft model reads: prompt lookup alone (named, or
    # the default without --draft) never reads it; with a draft model it acts.
    for argv in (["--draft-context", "32"], ["--draft", "d", "--proposer", "ngram", "--draft-context", "32"]):
        note_unused(build_parser().parse_args(["generate", "--target", "t", *argv]), ["sd"])
        proposer = "ngram"
        assert capsys.readouterr().err == (f"nsd: --draft-context 32 does nothing with the {proposer} "
                                           "proposer (only a draft model reads it)\n")
    for argv in (["--draft", "d"], ["--draft", "d", "--proposer", "hybrid"]):
        note_unused(build_parser().parse_args(["generate", "--target", "t", *argv, "--draft-context", "32"]), ["sd"])
        assert capsys.readouterr().err == ""
    # serve and bench, where any method may run: the proposer alone decides.
    from nsd.cli_args import note_unread_by_proposers

    note_unread_by_proposers(build_parser().parse_args(["serve", "--target", "t", "--draft-context", "32"]))
    assert capsys.readouterr().err == ("nsd: --draft-context 32 does nothing with the ngram proposer "
                                       "(only a draft model reads it)\n")
    args = build_parser().parse_args(["serve", "--target", "t", "--draft", "d", "--draft-context", "32"])
    note_unread_by_proposers(args)
    note_unread_by_proposers(args, ["ngram", "draft"])  # bench: one of its proposers reads it
    assert capsys.readouterr().err == ""
    note_unread_by_proposers(args, ["ngram"])
    assert "--draft-context 32 does nothing with the ngram proposer" in capsys.readouterr().err
    # With ar only, the method rule says it first (and once).
    note_unused(build_parser().parse_args(["generate", "--target", "t", "--draft-context", "32"]), ["ar"])
    assert capsys.readouterr().err.count("--draft-context 32 does nothing") == 1


def test_generate_json_reports_the_method_asked_for_and_the_one_that_ran(monkeypatch, capsys) -> None:
    # As the server's usage.nsd does: nsd with budget 0 cannot relax, so it ran as sd.
    import json

    import nsd.cli
    from mock import CharTokenizer, MockLM
    from nsd.api import Engine

    engine = Engine.from_backends(MockLM(seed=1), CharTokenizer(), draft=MockLM(seed=2), proposer="draft")
    monkeypatch.setattr(nsd.cli, "make_engine", lambda args, needs_proposer=True: engine)
    for flags, ran in ((["--budget", "0"], "sd"), ([], "nsd")):
        assert main(["generate", "--target", "t", "--prompt", "abc", "--method", "nsd", "-k", "2",
                     "--max-new-tokens", "4", "--json", *flags]) == 0
        stats = json.loads(capsys.readouterr().out)["stats"]
        assert (stats["method"], stats["effective_method"], stats["theta"]) == ("nsd", ran, 0.9)
        assert stats["budget"] == (0.0 if flags else None)


def test_transformers_flags_reach_only_the_model_on_transformers(monkeypatch) -> None:
    # A transformers target beside a llama.cpp draft takes --dtype; the draft is loaded
    # without it. Where neither model runs on transformers it is refused before any load.
    from types import SimpleNamespace

    import nsd.engine as eng
    from mock import CharTokenizer, MockLM
    from nsd.api import BackendOptions, load_engine
    from nsd.errors import NSDError

    seen: dict[str, tuple[str, str]] = {}

    class Loaded(Exception):
        pass

    def load(model, options, *args, **kwargs):
        seen[model] = (options.dtype, options.compile)
        if model == "D":
            raise Loaded
        return SimpleNamespace(backend=MockLM(), tokenizer_dir="t")

    monkeypatch.setattr(eng, "resolve_model", lambda model: None)
    monkeypatch.setattr(eng, "load_backend", load)
    monkeypatch.setattr(eng, "load_tokenizer", lambda folder: CharTokenizer())
    options = BackendOptions(dtype="float32", compile="torch")
    monkeypatch.setattr(eng, "backend_kind", lambda model, o: "hf" if model == "T" else "llama")
    with pytest.raises(Loaded):
        load_engine("T", draft="D", proposer="draft", options=options)
    assert seen == {"T": ("float32", "torch"), "D": ("auto", "none")}
    seen.clear()
    monkeypatch.setattr(eng, "backend_kind", lambda model, o: "llama")
    with pytest.raises(NSDError, match="--compile torch is for the transformers backend"):
        load_engine("T", draft="D", proposer="draft", options=options)
    assert seen == {}


def test_version_prints_the_package_version(capsys) -> None:
    # `nsd --version` answers with the version pip installed (pyproject's), exit status 0,
    # and the source tree's __version__ says the same, so neither can drift alone.
    import re
    from pathlib import Path

    import nsd

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)  # tomllib is 3.11+
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"nsd {declared}"
    assert nsd.__version__ == declared
