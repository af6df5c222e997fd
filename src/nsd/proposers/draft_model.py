"""Independent draft model proposer: a small LM sharing the target's tokenizer."""

from __future__ import annotations

from typing import Sequence

import torch

from nsd.backends.base import ModelBackend
from nsd.draft_vocab import VocabMap
from nsd.errors import NSDError
from nsd.proposers.base import Proposal
from nsd.sampling import SamplingConfig, logits_to_probs, sample_from


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    """Drafts ``k`` tokens autoregressively with a small model.

    ``q`` is the draft's distribution under the *same* sampling transform as the target
    (temperature, top-k, top-p, min-p), so the exact rule stays exact. Under greedy
    decoding the drafts are argmaxes and reported as one-hot (``probs=None``).
    """

    def __init__(self, backend: ModelBackend, sampling: SamplingConfig,
                 target_vocab_size: int | None = None, vocab_map: VocabMap | None = None) -> None:
        if vocab_map is not None:
            if backend.vocab_size != len(vocab_map.draft_to_target):
                raise NSDError("the reduced draft's logits do not match its vocabulary map")
        elif target_vocab_size is not None and backend.vocab_size != target_vocab_size:
            raise NSDError(
                f"draft and target vocabularies differ ({backend.vocab_size} vs {target_vocab_size} "
                "logits): the draft must share the target's tokenizer")
        self.backend = backend
        self.sampling = sampling
        self.vocab_map = vocab_map  # set for a reduced-vocabulary draft
        self._fed: list[int] = []  # target-vocabulary tokens whose KV the draft cache holds

    def propose(self, context: Sequence[int], k: int, generator: torch.Generator) -> Proposal:
        if k <= 0:
            return Proposal(torch.zeros(0, dtype=torch.long, device="cpu"), None)
        # Sync the draft cache with the context: keep the common prefix, feed the rest.
        # At least the last context token is (re)fed, because we need its logits.
        keep = min(common_prefix_length(self._fed, context), len(context) - 1)
        self.backend.rewind(keep)
        # A reduced-vocabulary draft takes full-vocabulary ids too (it is fed their input
        # embeddings), so the context and the drafted tokens go in as they are.
        logits = self.backend.forward(list(context[keep:]), all_logits=False)[-1]  # [Vd]
        vmap = self.vocab_map
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        greedy = self.sampling.greedy
        for i in range(k):
            if greedy:
                draft_id = int(logits.argmax())
            else:
                probs = logits_to_probs(logits, self.sampling)  # [Vd]
                uniform = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)
                draft_id = int(sample_from(probs.unsqueeze(0), uniform)[0])
                rows.append(probs if vmap is None else vmap.expand(probs))  # q on the full vocabulary
            tokens.append(draft_id if vmap is None else int(vmap.draft_to_target[draft_id]))
            if i < k - 1:
                logits = self.backend.forward([tokens[-1]])[-1]
        self._fed = list(context) + tokens[:-1]
        # Token ids stay on the CPU (the loop needs them as ints); q stays on the draft's device.
        return Proposal(torch.tensor(tokens, dtype=torch.long, device="cpu"),
                        None if greedy else torch.stack(rows))

