"""``llama-speculative``: llama.cpp's own speculative decoding of the same GGUF pair.

This is the peer a CPU user would otherwise pick: llama.cpp's ``llama-speculative-simple``
example, built from the same vendored source, patch and CPU flags as nsd's backend
(``scripts/build_llama_tools.sh``), run on the very files nsd's engine loaded (the weight
formats ``--weights auto`` picked for target and draft), with the same threads, context,
sampling knobs and seed. It drafts greedily with the draft model and accepts a draft token
only where it equals the target's own sample, so it is lossless at any temperature.

Each call is one run of the program; its model loading is not timed. Its own timings are
parsed from its report: ``encoded`` (the prompt, target and draft) is the prefill and
``decoded`` the generation, so the wall time compares with nsd's (prefill included, loading
excluded). The program has no stop strings: it generates to EOS or the token limit, and
stop strings are applied to its text afterwards (its speed counts every token it produced).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from nsd.cache_dir import cache_dir
from nsd.decode import DecodeStats
from nsd.errors import NSDError
from nsd.generation import GenerationConfig

PROGRAM = "llama-speculative-simple"
# llama.cpp's own default draft length for this program (common_params_speculative_draft).
DEFAULT_DRAFT_MAX = 3

_BUILD_HINT = "build it with `bash scripts/build_llama_tools.sh` (a few minutes, once)"


def find_program(name: str = PROGRAM) -> Path:
    """The built llama.cpp program: ``$NSD_LLAMA_TOOLS/<name>`` if that is set, else the
    cache's ``llama-tools/bin/<name>``."""
    folder = os.environ.get("NSD_LLAMA_TOOLS")
    path = (Path(folder).expanduser() if folder else cache_dir() / "llama-tools" / "bin") / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise NSDError(f"llama-speculative needs llama.cpp's {name}, not found at {path}; {_BUILD_HINT}")
    return path


@dataclass(frozen=True)
class SpecReport:
    """What the program reports about one run."""

    prompt_tokens: int
    prefill_s: float
    new_tokens: int
    decode_s: float
    drafted: int
    accepted: int


_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_PATTERNS = {
    "encoded": re.compile(rf"encoded\s+([0-9]+) tokens in\s+{_NUM} seconds"),
    "decoded": re.compile(rf"decoded\s+([0-9]+) tokens in\s+{_NUM} seconds"),
    "n_drafted": re.compile(r"n_drafted\s*=\s*([0-9]+)"),
    "n_accept": re.compile(r"n_accept\s*=\s*([0-9]+)"),
}


def parse_report(stderr: str) -> SpecReport:
    """The timings and counts of one run, from the program's log."""
    found = {key: pattern.search(stderr) for key, pattern in _PATTERNS.items()}
    missing = [key for key, match in found.items() if match is None]
    if missing:
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        raise NSDError(f"{PROGRAM} did not report {', '.join(missing)}; its log ended with:\n{tail}")
    enc, dec = found["encoded"], found["decoded"]
    return SpecReport(prompt_tokens=int(enc.group(1)), prefill_s=float(enc.group(2)),
                      new_tokens=int(dec.group(1)), decode_s=float(dec.group(2)),
                      drafted=int(found["n_drafted"].group(1)), accepted=int(found["n_accept"].group(1)))


def generated_text(stdout: str, prompt_text: str) -> str:
    """The program prints two newlines, the prompt, the generation and two newlines."""
    body = stdout[2:] if stdout.startswith("\n\n") else stdout
    if not body.startswith(prompt_text):
        raise NSDError(f"{PROGRAM}'s output does not start with the prompt it was given")
    body = body[len(prompt_text):]
    return body[:-2] if body.endswith("\n\n") else body


class LlamaSpeculativePeer:
    """Runs ``llama-speculative-simple`` on the engine's target and draft files."""

    def __init__(self, target_file: str, draft_file: str, tokenizer, threads: int | None,
                 n_ctx: int, program: Path | None = None) -> None:
        self.program = program or find_program()
        self.target_file, self.draft_file = target_file, draft_file
        self.tokenizer = tokenizer
        self.threads = threads or os.cpu_count() or 1
        self.n_ctx = n_ctx

    def command(self, prompt_file: str, config: GenerationConfig) -> list[str]:
        k = config.k if isinstance(config.k, int) and config.k > 0 else DEFAULT_DRAFT_MAX
        t = str(self.threads)
        return [
            str(self.program), "-m", self.target_file, "-md", self.draft_file,
            "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
            "-f", prompt_file, "-n", str(config.max_new_tokens),
            "-c", str(self.n_ctx), "-b", str(self.n_ctx),
            "-t", t, "-tb", t, "-td", t, "-tbd", t,
            # Same meaning as nsd's knobs (temperature 0 greedy, top-k 0 and top-p 1 off);
            # llama.cpp's other default samplers (repeat penalty, DRY, XTC...) are off at
            # their neutral values, so both sample from the same distribution.
            "--temp", str(config.temperature), "--top-k", str(config.top_k),
            "--top-p", str(config.top_p), "--min-p", str(config.min_p), "--repeat-penalty", "1.0",
            "--seed", str(config.seed),
        ]

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig
                 ) -> tuple[list[int], str, DecodeStats]:
        # The program tokenizes text (special tokens parsed), so it gets the prompt as the
        # text of its ids; the token count it reports is checked against ours below.
        prompt_text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
            # llama.cpp drops one trailing newline of a prompt file; a chat prompt ends in one.
            f.write(prompt_text + "\n" if prompt_text.endswith("\n") else prompt_text)
            f.flush()
            proc = subprocess.run(self.command(f.name, config), capture_output=True, text=True,
                                  errors="replace", check=False)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
            raise NSDError(f"{PROGRAM} failed (exit {proc.returncode}):\n{tail}")
        report = parse_report(proc.stderr)
        if report.prompt_tokens != len(prompt_ids):
            raise NSDError(f"{PROGRAM} read the prompt as {report.prompt_tokens} tokens, nsd has "
                           f"{len(prompt_ids)}: the comparison would not be on the same input")
        text = generated_text(proc.stdout, prompt_text)
        tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
        stop_reason = "length" if report.new_tokens >= config.max_new_tokens else "eos"
        for s in (s for s in config.stop if s):
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        passes = max(report.new_tokens - report.accepted, 1)  # one token per pass is not accepted
        wall = report.prefill_s + report.decode_s
        stats = DecodeStats(method="llama-speculative", prompt_tokens=report.prompt_tokens,
                            new_tokens=report.new_tokens, target_passes=passes,
                            drafted_tokens=report.drafted, accepted_tokens=report.accepted,
                            relaxed_accepts=0, deviation=0.0, stop_reason=stop_reason,
                            prefill_s=report.prefill_s, wall_s=wall, propose_s=0.0,
                            target_s=report.decode_s)
        return tokens, text, stats
