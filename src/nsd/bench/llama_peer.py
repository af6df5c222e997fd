"""``llama-generate``: llama.cpp's own generation of the target file, as an outside peer.

nsd's AR baseline runs llama.cpp through its C API with nsd's sampling; this peer runs
the same GGUF file (the weight format nsd's engine picked) through llama-cpp-python's
``Llama.generate``, llama.cpp's samplers included, with the same threads and context.
The report's ``speedup_vs_ar`` for it then says how nsd's plain decoding compares with
what a llama.cpp user gets from the same file on the same machine, in the same run.
"""

from __future__ import annotations

import time
from typing import Sequence

from nsd.api import GenerationConfig
from nsd.decode import DecodeStats
from nsd.errors import NSDError


class LlamaGeneratePeer:
    def __init__(self, model_file: str, tokenizer, eos_token_ids: Sequence[int],
                 threads: int | None, n_ctx: int) -> None:
        import os

        try:
            import llama_cpp
        except ImportError as exc:
            raise NSDError("llama-generate needs llama-cpp-python (scripts/install.sh)") from exc
        threads = threads or os.cpu_count() or 1
        self.file = model_file
        self.llm = llama_cpp.Llama(model_path=model_file, n_ctx=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig
                 ) -> tuple[list[int], str, DecodeStats]:
        stops = tuple(s for s in config.stop if s)
        longest = max((len(s) for s in stops), default=0)
        self.llm.set_seed(config.seed)
        # Llama.generate keeps the previous call's KV cache and skips the common prefix of
        # the next prompt (the warm-up's whole prompt, a chat template's system turn). nsd's
        # engine prefills every prompt in full, so the peer must too, or it gets free work.
        self.llm.reset()
        tokens: list[int] = []
        stop_reason = "length"
        start = time.perf_counter()
        first = None
        # Same meaning as nsd's knobs: temperature 0 is greedy, top-k 0 and top-p 1 are off.
        for tok in self.llm.generate(list(prompt_ids), temp=config.temperature, top_k=config.top_k,
                                     top_p=config.top_p, min_p=config.min_p, repeat_penalty=1.0,
                                     reset=True):
            if first is None:
                first = time.perf_counter() - start
            tokens.append(int(tok))
            if tok in self.eos:
                stop_reason = "eos"
                break
            if stops and any(s in self.tokenizer.decode(tokens[-(longest + 8):]) for s in stops):
                stop_reason = "stop"
                break
            if len(tokens) >= config.max_new_tokens:
                break
        wall = time.perf_counter() - start
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for s in stops:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        # prefill_s is the measured time to the first token: the prompt *and* the first
        # token's step, while nsd's prefill stops before that step. Per-step comparisons
        # count one step fewer for the peer (benchmarks/paired_speedup.py).
        prefill = first or 0.0
        stats = DecodeStats(method="llama-generate", prompt_tokens=len(prompt_ids),
                            new_tokens=len(tokens), target_passes=len(tokens), drafted_tokens=0,
                            accepted_tokens=0, relaxed_accepts=0, deviation=0.0,
                            stop_reason=stop_reason, prefill_s=prefill, wall_s=wall, propose_s=0.0,
                            target_s=wall - prefill)
        return tokens, text, stats
