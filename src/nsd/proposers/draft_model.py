"""Independent draft model proposer: a small LM sharing the target's tokenizer."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from nsd.backends.base import ModelBackend, cached_tokens, common_prefix_length
from nsd.backends.embedding_input import VocabMap
from nsd import options as optspec
from nsd.errors import NSDError
from nsd.proposers.base import Proposal, Proposer
from nsd.rules.sampling import SamplingConfig, adjust_logits, logits_to_probs, sample_from


__all__ = ["DraftModelProposer", "common_prefix_length"]


class DraftModelProposer(Proposer):
    """Drafts ``k`` tokens autoregressively with a small model.

    ``q`` is the draft's distribution under the *same* sampling transform as the target
    (temperature, top-k, top-p, min-p), so the exact rule stays exact. Under greedy
    decoding the drafts are argmaxes and reported as one-hot (``probs=None``), and so they
    are at any temperature with ``argmax`` (the rules defined for argmax drafts only:
    :data:`nsd.options.ARGMAX_DRAFT_METHODS`; the draft still sees the target's penalties).

    ``prompt_window`` (``--draft-context``; 0: none) bounds the prompt tokens the draft reads
    anew: where more than that many are missing from its cache at a generation's first
    block, it starts over from the prompt's last ``prompt_window`` tokens and drafts from
    that window for the rest of the generation (its positions start there). The target
    verifies against the whole context, so every rule keeps its law; only how often the
    drafts are accepted can change.
    """

    def __init__(self, backend: ModelBackend, sampling: SamplingConfig,
                 target_vocab_size: int | None = None, vocab_map: VocabMap | None = None,
                 reuse_cache: bool = False, argmax: bool = False, prompt_window: int = 0) -> None:
        if vocab_map is not None:
            if backend.vocab_size != len(vocab_map.draft_to_target):
                raise NSDError("the reduced draft's logits do not match its vocabulary map")
        elif target_vocab_size is not None and backend.vocab_size != target_vocab_size:
            raise NSDError(
                f"draft and target vocabularies differ ({backend.vocab_size} vs {target_vocab_size} "
                "logits): the draft must share the target's tokenizer")
        self.backend = backend
        self.sampling = sampling
        self.argmax = argmax or sampling.greedy
        self.vocab_map = vocab_map  # set for a reduced-vocabulary draft
        # Target-vocabulary tokens whose KV the draft cache holds. With ``reuse_cache``, a
        # cache that says what it holds (left by an earlier generation or restored from a
        # prefix cache) is reused as far as it matches; otherwise it is rebuilt. A
        # reduced-vocabulary draft is fed full-vocabulary ids (as input embeddings), and
        # its cache records those ids, so it is reused the same way.
        held = cached_tokens(backend) if reuse_cache else None
        self._fed: list[int] = list(held) if held is not None else []
        # Context tokens the first block found in the draft's cache (not read again).
        self.reused_tokens: int | None = None
        self._prompt_length = 0  # generated tokens start here (for the penalties)
        self.prompt_window = optspec.check("draft_context", prompt_window)
        # The draft sees context[start:]; None until a generation's first block decides it.
        self._start: int | None = None
        self.prefill_s = 0.0  # this generation's forwards that read prompt tokens
        # The logit adjustments need target token ids; a reduced-vocabulary draft skips them
        # (q is still the distribution it drew from, so verification stays exact).
        self._adjust = sampling.adjusts_logits and vocab_map is None
        self._plain = dataclasses.replace(sampling, presence_penalty=0.0, frequency_penalty=0.0,
                                          logit_bias=())

    def begin(self, prompt_length: int) -> None:
        """Called by the decoding loop: the context's first ``prompt_length`` tokens are
        the prompt, the rest generated (penalties count only the generated ones)."""
        self._prompt_length = prompt_length
        self.prefill_s = 0.0
        self._start = None

    def _window_start(self, context: Sequence[int]) -> int:
        """Where the draft's view of ``context`` starts: 0 where its cache lacks at most
        ``prompt_window`` tokens of the prompt (or there is no window), else ``prompt_window``
        tokens before the prompt's end. The window counts prompt tokens only: blocks that
        prompt lookup drafted before the draft's first one (hybrid proposer) have made the
        context longer, and the draft reads those generated tokens besides its window."""
        prompt = self._prompt_length or len(context)  # outside a decoding loop: all of it
        missing = prompt - min(common_prefix_length(self._fed, context), prompt)
        if not self.prompt_window or missing <= self.prompt_window:
            return 0
        return prompt - self.prompt_window

    def propose(self, context: Sequence[int], k: int, generator: torch.Generator,
                lookup: bool = False) -> Proposal:
        if k <= 0:
            return Proposal(torch.zeros(0, dtype=torch.long, device="cpu"), None)
        if self._start is None:  # the generation's first block: from where the draft reads
            self._start = self._window_start(context)
            if self._start:  # what the cache held is of no use from another start
                self._fed = []
        # What the draft sees: the context from its window's start (all of it without one).
        view = context[self._start:] if self._start else context
        # Sync the draft cache with that: keep the common prefix, feed the rest. At least
        # the last token is (re)fed, because we need its logits.
        keep = min(common_prefix_length(self._fed, view), len(view) - 1)
        if self.reused_tokens is None:
            self.reused_tokens = keep
        self.backend.rewind(keep)
        # A reduced-vocabulary draft takes full-vocabulary ids too (it is fed their input
        # embeddings), so the context and the drafted tokens go in as they are.
        t0 = time.perf_counter()
        logits = self.backend.forward(list(view[keep:]), all_logits=False)[-1]  # [Vd]
        if keep + self._start < self._prompt_length:  # it read (part of) the prompt: a per-request cost
            self.prefill_s += time.perf_counter() - t0
        vmap = self.vocab_map
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        greedy = self.argmax
        history = list(context[self._prompt_length:]) if self._adjust else []
        sampling = self.sampling if self._adjust else self._plain
        for i in range(k):
            # The target's transform, penalties counting the tokens drafted so far too.
            seen = history + tokens
            if greedy:
                draft_id = int(adjust_logits(logits, sampling, seen).argmax())
            else:
                probs = logits_to_probs(logits, sampling, seen)  # [Vd]
                uniform = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)
                draft_id = int(sample_from(probs.unsqueeze(0), uniform)[0])
                rows.append(probs if vmap is None else vmap.expand(probs))  # q on the full vocabulary
            tokens.append(draft_id if vmap is None else int(vmap.draft_to_target[draft_id]))
            if i < k - 1:
                logits = self.backend.forward([tokens[-1]])[-1]
        self._fed = list(view) + tokens[:-1]
        # Token ids stay on the CPU (the loop needs them as ints); q stays on the draft's device.
        return Proposal(torch.tensor(tokens, dtype=torch.long, device="cpu"),
                        None if greedy else torch.stack(rows))

