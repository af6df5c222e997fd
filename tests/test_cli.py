"""CLI bad-input handling: clear one-line errors and exit status 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nsd.api import GenerationConfig
from nsd.cli import build_parser, main
from nsd.verify import RuleConfig


@pytest.mark.parametrize("argv, message", [
    (["generate", "--target", "qwen2.5-coder-1.5b-instrct", "--prompt", "x"], "did you mean"),
    (["generate", "--target", "smollm2-135m-instruct", "--theta", "1.5", "--prompt", "x"], "theta"),
    (["generate", "--target", "smollm2-135m-instruct", "--theta", "-0.2", "--prompt", "x"], "theta"),
    (["generate", "--target", "smollm2-135m-instruct", "--budget", "-1", "--prompt", "x"], "budget"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt", "   "], "empty"),
    (["generate", "--target", "smollm2-135m-instruct"], "no prompt"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "-k", "0"], "draft length"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt", "x", "--top-p", "0"], "top-p"),
    (["generate", "--target", "smollm2-135m-instruct", "--prompt-file", "/nonexistent/p.txt"], "cannot read"),
    (["generate", "--target", "smollm2-135m-instruct", "--method", "sd", "--proposer", "draft",
      "--prompt", "x"], "draft model"),
    (["models", "verify", "no-such-model"], "unknown model"),
])
def test_bad_input_exits_2_with_message(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err.lower() and "Traceback" not in err
    assert err.count("\n") == 1


def test_argparse_typos_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "nsd.cli", "generate", "--theta", "abc"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_models_list_runs(capsys) -> None:
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        assert name in out


def test_typical_acceptance_defaults_are_medusas() -> None:
    # Medusa accepts p(x) > min(ε, δ·exp(−H)) with ε = posterior_threshold = 0.09 and
    # δ = posterior_alpha = 0.3; every layer must default to that pair, not the swap.
    assert (RuleConfig().epsilon, RuleConfig().typical_delta) == (0.09, 0.3)
    config = GenerationConfig()
    assert (config.typical_epsilon, config.typical_delta) == (0.09, 0.3)
    rule = GenerationConfig(method="typical").rule()
    assert (rule.epsilon, rule.typical_delta) == (0.09, 0.3)
    parser = build_parser()
    for argv in (["generate", "--target", "t"], ["compare", "--target", "t"], ["bench"]):
        args = parser.parse_args(argv)
        assert (args.typical_epsilon, args.typical_delta) == (0.09, 0.3), argv
