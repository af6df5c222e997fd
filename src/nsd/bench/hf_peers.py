"""Outside peers: transformers' own ``generate`` with assisted and prompt-lookup decoding.

They run on float32 transformers copies of the same models (converted from the GGUFs),
with transformers' defaults for everything we do not pin, so the comparison is with the
library as users get it. Their speedups are measured against ``hf-ar`` (plain greedy
``generate`` on the same copies), never against our llama.cpp AR run, whose kernels and
weights differ. Only greedy decoding: transformers' sampling paths are not comparable.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from nsd.api import GenerationConfig
from nsd.decode import DecodeStats
from nsd.errors import NSDError

# transformers' documented example value for prompt lookup decoding.
PLD_TOKENS = 10


class HFPeers:
    """The target (and, for ``hf-assisted``, the draft) as transformers models."""

    def __init__(self, target: str, draft: str | None, need_draft: bool,
                 threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from nsd.models.hf_convert import ensure_hf_folder

        if need_draft and not draft:
            raise NSDError("hf-assisted needs a draft model (--draft)")
        if threads:
            torch.set_num_threads(threads)

        def load(name: str):
            folder = ensure_hf_folder(name)
            try:
                model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
            except (OSError, ValueError) as exc:
                raise NSDError(f"transformers could not load {name} from {folder}: {exc}") from exc
            return model.eval(), folder

        self.model, folder = load(target)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.assistant = load(draft)[0] if need_draft else None
        # Forward hooks count target passes (one forward = one pass, so hf-* methods get a τ
        # comparable to ours) and time the target and the assistant.
        self._target = _ForwardClock(self.model)
        self._draft = _ForwardClock(self.assistant) if self.assistant is not None else None
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    @torch.inference_mode()
    def generate(self, family: str, prompt_ids: Sequence[int], config: GenerationConfig
                 ) -> tuple[list[int], str, DecodeStats]:
        """Greedy ``generate`` for ``hf-ar``, ``hf-assisted`` or ``hf-pld``."""
        if config.temperature > 0:
            raise NSDError("the hf-* peers are greedy only; use --temperature 0 or drop them")
        kwargs: dict[str, object] = {}
        if family == "hf-assisted":
            kwargs["assistant_model"] = self.assistant
        elif family == "hf-pld":
            kwargs["prompt_lookup_num_tokens"] = PLD_TOKENS
        elif family != "hf-ar":
            raise NSDError(f"unknown transformers peer {family!r}")
        stops = [s for s in config.stop if s]
        if stops:
            # A custom criterion rather than `stop_strings=`: transformers copies
            # stop_strings into the assistant's generate call without the tokenizer and fails.
            from transformers import StoppingCriteriaList

            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [_StopOnStrings(self.tokenizer, stops, len(prompt_ids))])
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        pad = self.tokenizer.pad_token_id
        self._target.reset()
        if self._draft is not None:
            self._draft.reset()
        start = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=config.max_new_tokens, do_sample=False,
                                  pad_token_id=pad if pad is not None else min(self.eos_token_ids, default=0),
                                  **kwargs)
        wall = time.perf_counter() - start
        tokens = out[0, ids.shape[1]:].tolist()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        stop_reason = "eos" if tokens and tokens[-1] in self.eos_token_ids else "length"
        for s in stops:
            if s in text:
                text, stop_reason = text[:text.find(s)], "stop"
        stats = DecodeStats(method=family, prompt_tokens=len(prompt_ids), new_tokens=len(tokens),
                            target_passes=self._target.calls, drafted_tokens=0, accepted_tokens=0,
                            relaxed_accepts=0, deviation=0.0, stop_reason=stop_reason,
                            prefill_s=math.nan, wall_s=wall, target_s=self._target.seconds,
                            propose_s=self._draft.seconds if family == "hf-assisted" else math.nan)
        return tokens, text, stats


class _StopOnStrings:
    """Stop once any stop string appears in the generated text (batch size 1)."""

    def __init__(self, tokenizer, stops: list[str], prompt_len: int) -> None:
        self.tokenizer, self.stops, self.prompt_len = tokenizer, stops, prompt_len
        self.tail = max(len(s) for s in stops) + 16

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        text = self.tokenizer.decode(input_ids[0, self.prompt_len:][-self.tail:])
        hit = any(s in text for s in self.stops)
        return torch.full((input_ids.shape[0],), hit, dtype=torch.bool)


class _ForwardClock:
    """Counts and times the forward calls of one module through hooks."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self.seconds = 0.0
        self._start = 0.0
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0

    def _before(self, *_: object) -> None:
        self._start = time.perf_counter()

    def _after(self, *_: object) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - self._start
