"""The ``llama-speculative`` benchmark peer: llama.cpp's own speculative decoding.

Most checks run a stand-in program that prints what ``llama-speculative-simple`` prints, so
the parsing, the prompt check and the stop handling are tested on every machine; the last
test runs the real program where ``scripts/build_llama_tools.sh`` has built it.
"""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from nsd.bench.llama_spec_peer import (DEFAULT_DRAFT_MAX, LlamaSpeculativePeer, find_program,
                                       generated_text, parse_report)
from nsd.bench.methods import expand_methods
from nsd.errors import NSDError
from nsd.generation import GenerationConfig

LOG = """\
main: encoded   12 tokens in    0.250 seconds, speed:   48.000 t/s
main: decoded   20 tokens in    1.500 seconds, speed:   13.333 t/s

main: n_draft   = 4
main: n_predict = 20
main: n_drafted = 24
main: n_accept  = 15
main: accept    = 62.500%
"""


class CharTokenizer:
    """One token per character: ids are code points."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_report_is_parsed_from_the_programs_log() -> None:
    r = parse_report("noise\n" + LOG)
    assert (r.prompt_tokens, r.prefill_s, r.new_tokens, r.decode_s, r.drafted, r.accepted) == \
        (12, 0.25, 20, 1.5, 24, 15)


def test_a_log_without_the_figures_is_an_error_naming_them() -> None:
    with pytest.raises(NSDError, match="did not report n_drafted, n_accept"):
        parse_report(LOG.split("main: n_drafted")[0])


def test_generated_text_is_what_follows_the_echoed_prompt() -> None:
    assert generated_text("\n\nPROMPT and more\n\n", "PROMPT") == " and more"
    with pytest.raises(NSDError, match="does not start with the prompt"):
        generated_text("\n\nsomething else\n\n", "PROMPT")


def test_command_uses_the_methods_k_and_nsds_sampling_meaning(tmp_path: Path) -> None:
    peer = LlamaSpeculativePeer("t.gguf", "d.gguf", CharTokenizer(), threads=2, n_ctx=512,
                                program=tmp_path / "prog")
    cmd = peer.command("p.txt", GenerationConfig(k=5, temperature=0.8, top_p=0.95, seed=7))
    flag = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert (flag["-m"], flag["-md"], flag["--spec-draft-n-max"]) == ("t.gguf", "d.gguf", "5")
    assert (flag["--temp"], flag["--top-p"], flag["--top-k"], flag["--seed"]) == ("0.8", "0.95", "0", "7")
    assert flag["--repeat-penalty"] == "1.0" and flag["-t"] == flag["-td"] == "2"
    auto = peer.command("p.txt", GenerationConfig(k="auto"))
    assert auto[auto.index("--spec-draft-n-max") + 1] == str(DEFAULT_DRAFT_MAX)


def test_method_grid_runs_the_peer_once_per_whole_number_k() -> None:
    labels = [m.label for m in expand_methods(["ar", "llama-speculative"], [0.9], [], ["draft"],
                                              ks=["auto", 2, 4])]
    assert labels == ["ar", "llama-speculative/k=2", "llama-speculative/k=4"]
    plain = expand_methods(["llama-speculative"], [0.9], [], ["draft"])
    assert [(m.label, m.is_llama_peer, m.is_peer) for m in plain] == [("llama-speculative", True, True)]


def test_a_missing_program_names_the_build_script(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NSD_LLAMA_TOOLS", str(tmp_path))
    with pytest.raises(NSDError, match="scripts/build_llama_tools.sh"):
        find_program()


def _stand_in(tmp_path: Path, generated: str, prompt_tokens: int | None = None, exit_code: int = 0) -> Path:
    """A program that echoes its prompt file and the generation, and logs like llama.cpp."""
    script = tmp_path / "llama-speculative-simple"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        args = sys.argv[1:]
        prompt = open(args[args.index("-f") + 1], encoding="utf-8").read()
        prompt = prompt[:-1] if prompt.endswith("\\n") else prompt  # as llama.cpp reads -f
        n = {prompt_tokens!r} if {prompt_tokens!r} is not None else len(prompt)
        sys.stdout.write("\\n\\n" + prompt + {generated!r} + "\\n\\n")
        sys.stderr.write("encoded %4d tokens in 0.100 seconds\\n" % n)
        sys.stderr.write("decoded %4d tokens in 0.900 seconds\\n" % len({generated!r}))
        sys.stderr.write("n_drafted = 9\\nn_accept  = 6\\n")
        sys.exit({exit_code})
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_generate_parses_a_run_and_cuts_stop_strings_afterwards(tmp_path: Path) -> None:
    prog = _stand_in(tmp_path, "abc\ndef")
    peer = LlamaSpeculativePeer("t.gguf", "d.gguf", CharTokenizer(), threads=1, n_ctx=64, program=prog)
    prompt = [ord(c) for c in "Hi\n"]  # a trailing newline survives the prompt file
    tokens, text, stats = peer.generate(prompt, GenerationConfig(max_new_tokens=7, stop=("\n",)))
    assert text == "abc"  # cut at the stop string ...
    assert tokens == [ord(c) for c in "abc\ndef"] and stats.new_tokens == 7  # ... every token counted
    assert stats.stop_reason == "length" and (stats.drafted_tokens, stats.accepted_tokens) == (9, 6)
    assert stats.wall_s == pytest.approx(1.0) and stats.prefill_s == pytest.approx(0.1)
    assert stats.target_passes == 1  # 7 tokens, 6 of them accepted drafts


def test_a_prompt_read_differently_is_refused(tmp_path: Path) -> None:
    prog = _stand_in(tmp_path, "x", prompt_tokens=5)
    peer = LlamaSpeculativePeer("t.gguf", "d.gguf", CharTokenizer(), threads=1, n_ctx=64, program=prog)
    with pytest.raises(NSDError, match="read the prompt as 5 tokens, nsd has 2"):
        peer.generate([72, 105], GenerationConfig(max_new_tokens=4))


def test_a_failing_program_is_an_error_with_its_log(tmp_path: Path) -> None:
    prog = _stand_in(tmp_path, "x", exit_code=3)
    peer = LlamaSpeculativePeer("t.gguf", "d.gguf", CharTokenizer(), threads=1, n_ctx=64, program=prog)
    with pytest.raises(NSDError, match="failed \\(exit 3\\)"):
        peer.generate([72], GenerationConfig(max_new_tokens=4))


def test_real_program_drafts_with_the_target_itself_and_accepts_nearly_all(tmp_path: Path) -> None:
    """Draft = target, greedy: llama.cpp accepts a draft where it equals the target's own
    choice, so nearly every draft is accepted (batched rounding may flip a near-tie)."""
    try:
        program = find_program()
    except NSDError as exc:
        pytest.skip(str(exc))
    from nsd.models.loader import load_tokenizer
    from nsd.models.hf_convert import ensure_tokenizer_folder
    from nsd.models.registry import fetch_gguf

    if os.environ.get("NSD_SKIP_REAL_MODELS") == "1":
        pytest.skip("NSD_SKIP_REAL_MODELS=1")
    try:
        gguf = fetch_gguf("smollm2-135m-instruct", progress=False)
    except NSDError as exc:
        pytest.skip(f"test model unavailable: {exc}")
    tok = load_tokenizer(str(ensure_tokenizer_folder("smollm2-135m-instruct")))
    peer = LlamaSpeculativePeer(str(gguf), str(gguf), tok, threads=2, n_ctx=512, program=program)
    ids = tok.encode("def fibonacci(n):\n", add_special_tokens=False)
    tokens, text, stats = peer.generate(ids, GenerationConfig(temperature=0.0, k=4, max_new_tokens=32))
    assert stats.prompt_tokens == len(ids) and stats.new_tokens >= 1 and text
    assert stats.drafted_tokens > 0 and stats.accepted_tokens >= 0.9 * stats.drafted_tokens
    assert stats.wall_s > 0
