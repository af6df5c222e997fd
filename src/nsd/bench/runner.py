"""The benchmark loop: every method on every prompt, interleaved prompt by prompt.

Interleaving (and rotating which method goes first) spreads slow drift in machine load
over all methods alike, so per-prompt rates of different methods stay comparable. Only
the generation itself is timed; the log-likelihood forward and the HumanEval execution
happen after the clock stops. Each finished record goes to the journal at once.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from nsd.api import GenerationConfig
from nsd.bench.datasets import BenchPrompt
from nsd.bench.humaneval_exec import is_scored, score_humaneval, stops_for
from nsd.bench.methods import MethodSpec
from nsd.bench.metrics import mean_log_likelihood
from nsd.bench.schedule import method_order, missing
from nsd.bench.speed import tokens_per_s, visible_tokens
from nsd.bench.store import Journal
from nsd.draftlen.cpu_load import LoadMonitor
from nsd.errors import NSDError
from nsd.options import NEEDS_DRAFT

# New tokens of each untimed warm-up call (here and in ``nsd compare``): enough to run a
# prefill and a few decoding passes on every code path.
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class RunConfig:
    """How each (prompt, method) call is made and scored."""

    methods: tuple[MethodSpec, ...]
    generation: GenerationConfig = GenerationConfig()  # method/θ/budget replaced per method
    loglik: bool = True  # score every output under the target (one forward each)
    execute: bool = True  # run HumanEval tests for pass@1
    exec_timeout_s: float = 10.0
    dataset_stops: bool = True  # end HumanEval generations at its stop sequences
    warmup: bool = True  # one short untimed call per method family and proposer before timing

    def __post_init__(self) -> None:
        if not self.methods:
            raise NSDError("no methods to benchmark")
        labels = [m.label for m in self.methods]
        if len(set(labels)) != len(labels):
            raise NSDError("a method is listed twice")
        if self.exec_timeout_s <= 0:
            raise NSDError(f"the execution timeout must be > 0, got {self.exec_timeout_s}")


def pending(journal: Journal, prompts: Sequence[BenchPrompt], methods: Sequence[MethodSpec]) -> int:
    """How many (prompt, method) calls the journal still lacks."""
    return missing(((p.uid, m.label) for p in prompts for m in methods), journal)


def collect(journal: Journal, prompts: Sequence[BenchPrompt], methods: Sequence[MethodSpec]) -> list[dict]:
    """The selection's records, prompt-major, from a complete journal."""
    return [journal.records[(p.uid, m.label)] for p in prompts for m in methods]


class BenchRunner:
    """Runs the (prompt × method) grid, skipping records already in the journal.

    ``engine`` is an :class:`nsd.api.Engine` (or anything with ``encode``, ``generate``,
    ``target`` and ``use_proposer``); ``peers`` an :class:`~nsd.bench.hf_peers.HFPeers`
    when hf-* methods are selected; ``llama_peers`` llama.cpp's own programs by family
    (``llama-generate``, ``llama-speculative``) when those are.
    """

    def __init__(self, engine, config: RunConfig, journal: Journal, peers=None,
                 monitor: LoadMonitor | None = None, progress: bool = True,
                 llama_peers: Mapping[str, Any] | None = None) -> None:
        if any(m.is_hf for m in config.methods) and peers is None:
            raise NSDError("hf-* methods need the transformers peers loaded")
        self.llama_peers = dict(llama_peers or {})
        missing = [m.family for m in config.methods if m.is_llama_peer and m.family not in self.llama_peers]
        if missing:
            raise NSDError(f"{missing[0]} needs its llama.cpp peer loaded")
        self.engine = engine
        self.config = config
        self.journal = journal
        self.peers = peers
        self.monitor = monitor or LoadMonitor()
        self.progress = progress

    def run(self, prompts: Sequence[BenchPrompt]) -> list[dict]:
        """Fill in the missing records; return all records of this selection."""
        from tqdm import tqdm

        methods = self.config.methods
        total = len(prompts) * len(methods)
        todo = pending(self.journal, prompts, methods)
        if todo and self.config.warmup:
            self._warmup(prompts[0])
        bar = tqdm(total=total, initial=total - todo, file=sys.stderr, unit="call",
                   disable=not self.progress, dynamic_ncols=True)
        try:
            for index, prompt in enumerate(prompts):
                if all((prompt.uid, m.label) in self.journal for m in methods):
                    continue
                ids = self.engine.encode(prompt.text, chat=prompt.chat)
                for spec in method_order(methods, index):
                    if (prompt.uid, spec.label) in self.journal:
                        continue
                    record = self._one(prompt, ids, spec)
                    self.journal.append(record)
                    bar.set_postfix_str(f"{spec.label} {record['tokens_per_s']:.1f} tok/s")
                    bar.update(1)
        finally:
            bar.close()
        return collect(self.journal, prompts, methods)

    def _config(self, prompt: BenchPrompt, spec: MethodSpec) -> GenerationConfig:
        config = spec.generation_config(self.config.generation)
        if self.config.dataset_stops and stops_for(prompt):
            config = dataclasses.replace(config, stop=tuple(config.stop) + stops_for(prompt))
        return config

    def _generate(self, spec: MethodSpec, ids: list[int], config: GenerationConfig):
        if spec.is_hf:
            return self.peers.generate(spec.family, ids, config)
        if spec.is_llama_peer:
            return self.llama_peers[spec.family].generate(ids, config)
        if spec.proposer is not None:
            self.engine.use_proposer(spec.proposer)
        result = self.engine.generate(ids, config)
        return result.token_ids, result.text, result.stats

    def _warmup(self, prompt: BenchPrompt) -> None:
        """Untimed calls so lazy allocations and caches are not billed to the first method:
        one per method family and proposer (SD, NSD and typical acceptance share the
        proposer but not the rule, whose own work is measured and allocated on first use)."""
        ids = self.engine.encode(prompt.text, chat=prompt.chat)
        seen: set[tuple] = set()
        for spec in self.config.methods:
            path = (spec.family, spec.proposer)
            if path in seen:
                continue
            seen.add(path)
            config = dataclasses.replace(self._config(prompt, spec), max_new_tokens=WARMUP_TOKENS)
            self._generate(spec, ids, config)

    def _one(self, prompt: BenchPrompt, ids: list[int], spec: MethodSpec) -> dict:
        config = self._config(prompt, spec)
        with self.monitor.measure() as load:
            tokens, text, stats = self._generate(spec, ids, config)
        output = visible_tokens(self.engine.tokenizer, tokens, text) if stats.stop_reason == "stop" \
            else list(tokens)
        record = {
            "prompt": prompt.uid, "dataset": prompt.dataset, "category": prompt.category,
            "method": spec.label, "family": spec.family, "proposer": spec.proposer,
            "theta": spec.theta, "budget": spec.budget, "knobs": dict(spec.knobs),
            "text": text, "token_ids": list(tokens), "output_ids": output,
            # Visible tokens per second (nsd.bench.speed): a speculative pass can overshoot a
            # stop string by up to k tokens that nobody sees.
            "tokens_per_s": tokens_per_s(len(output), stats.wall_s),
            "stats": stats.to_dict(),
            "load": load.sample.to_dict(),
            "weights": self._weights(spec),
            "loglik": None, "passed": None, "exec_status": None, "exec_detail": None, "completion": None,
        }
        if self.config.loglik:
            record["loglik"] = mean_log_likelihood(self.engine.target, ids, output)
        if is_scored(prompt):  # after the clock stopped
            record.update(score_humaneval(prompt, text, self.config.exec_timeout_s, self.config.execute))
        return record

    def _weights(self, spec: MethodSpec) -> dict:
        """The weight formats this call ran on (``--weights auto`` picks per machine, and a
        resumed run may pick differently). The transformers peers load their own weights."""
        if spec.is_hf:
            return {}
        out = {"target": getattr(getattr(self.engine, "target_model", None), "weights", None)}
        if spec.proposer in NEEDS_DRAFT or spec.family == "llama-speculative":
            draft = getattr(self.engine, "draft_model", None)
            out["draft"] = getattr(draft, "weights", None)
            vmap = getattr(draft, "vocab_map", None)
            if vmap is not None and spec.family != "llama-speculative":  # the peer runs the full file
                out["draft_vocab"] = len(vmap.draft_to_target)
        return out
