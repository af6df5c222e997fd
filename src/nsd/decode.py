"""The decoding loop: autoregressive and speculative (exact, NSD, typical) in one place.

:func:`decode` is a generator: it yields the token ids each target pass adds and returns
a :class:`DecodeStats`. Printing, detokenising and progress bars live in the caller.

Cache discipline: after every round the target cache holds the whole context except its
last token. A round feeds ``[last] + drafts`` (``k + 1`` tokens) and gets ``k + 1`` rows of
logits: the distributions for each draft position plus the bonus position. After
verification the cache is rewound to keep ``last`` and the accepted drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Sequence

import torch

from nsd import options as optspec
from nsd.backends.base import ModelBackend, cached_tokens, common_prefix_length
from nsd.draftlen.costmodel import AdaptiveK, FixedK, KPolicy
from nsd.errors import NSDError
from nsd.proposers.base import Proposal, Proposer
from nsd.rules.sampling import (SamplingConfig, adjust_logits, logits_to_probs, plausibility_probs,
                          sample_from)
from nsd.rules.entry import verify
from nsd.rules.lossy import topk_delta_inputs
from nsd.rules.verify import RuleConfig, VerifyResult, charge, method_of_rule


@dataclass(frozen=True)
class DecodeConfig:
    """One decoding run. ``speculative=False`` is plain autoregressive decoding.

    The draft length per block: ``k`` fixed, grown and shrunk by ``adaptive_k``, or, with
    ``auto_k``, chosen by the cost model (up to ``k_max``, 0 = a plain step) through the
    ``k_policy`` the caller hands :func:`decode`.
    """

    speculative: bool = True
    rule: RuleConfig = RuleConfig()
    sampling: SamplingConfig = SamplingConfig()
    k: int = 4
    adaptive_k: bool = False
    auto_k: bool = False
    k_max: int = optspec.default("k_max")
    draft_context: int = optspec.default("draft_context")  # read by the engine's draft proposer
    max_new_tokens: int = 128
    seed: int = 0
    # Log-probabilities of each emitted token and of the ``logprobs`` most likely ones
    # (None: none are computed): see :class:`TokenLogprob`.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and self.logprobs < 0:
            raise NSDError(f"logprobs must be >= 0, got {self.logprobs}")
        if not isinstance(self.k, int) or isinstance(self.k, bool):  # "auto" is auto_k=True here
            raise NSDError(f"the loop's draft length k is a number (auto_k chooses it), got {self.k!r}")
        # Each option's range is defined and checked once, in nsd.options; here the checks
        # that combine options.
        optspec.check_fields(self, {**optspec.DRAFT_LENGTH, **optspec.DECODING})
        if self.adaptive_k and self.k_max < self.k:
            raise NSDError(f"k_max ({self.k_max}) must be >= k ({self.k})")
        if self.adaptive_k and self.auto_k:
            raise NSDError("choose either adaptive k or auto k, not both")
        if self.speculative and self.rule.kind == "threshold" and self.sampling.greedy:
            raise NSDError("threshold: SGLang's thresholds act at temperature > 0 only (its greedy "
                           "verification is plain argmax matching); use --temperature > 0")

    def default_policy(self) -> KPolicy:
        """The policy for a fixed or adaptive ``k``, or plain decoding (``auto_k`` needs
        measured costs, so its policy comes from whoever holds them: see
        :mod:`nsd.draftlen.costmodel`)."""
        if not self.speculative:
            return FixedK(0)
        if self.auto_k:
            raise NSDError("auto k needs step costs: pass a CostModelK policy to decode()")
        return AdaptiveK(self.k, self.k_max) if self.adaptive_k else FixedK(self.k)

    def draft_catchup(self, prompt_tokens: int) -> int:
        """The prompt tokens a draft model reads before its first block, as ``-k auto``
        prices that catch-up: all of them, or at most ``draft_context``."""
        return min(prompt_tokens, self.draft_context) if self.draft_context else prompt_tokens

    @property
    def longest_block(self) -> int:
        """The longest block the policy can ask for: ``k_max`` bounds ``-k auto`` and
        adaptive k; a fixed k is its own bound (so lookup can cover a fixed block longer
        than ``k_max``)."""
        return self.k_max if self.auto_k or self.adaptive_k else self.k


@dataclass(frozen=True)
class DecodeStats:
    """What one generation cost and gained. Field names are the JSON schema of ``--json``."""

    method: str
    prompt_tokens: int
    new_tokens: int
    target_passes: int  # target forwards after the prompt prefill
    drafted_tokens: int
    accepted_tokens: int
    relaxed_accepts: int  # accepted only thanks to the relaxed set
    deviation: float  # D = Σ_t λ_t·E_t: bound on the sequence-level total variation
    stop_reason: str  # "eos", "stop" or "length"
    prefill_s: float
    wall_s: float
    propose_s: float  # time in the proposer (draft model forwards, n-gram lookup)
    target_s: float  # time in target forwards after the prefill
    position_attempts: list[int] = field(default_factory=list)  # blocks reaching draft position i
    position_accepts: list[int] = field(default_factory=list)
    # Of position_accepts, those accepted only thanks to the relaxed set; and the deviation
    # charged at each draft position (Σ λ_t·E_t over the blocks reaching it, so
    # Σ_i position_deviation[i] = deviation up to float rounding: D adds block by block).
    # Where a relaxed rule gains and what it costs, position by position: the reading of
    # the rules' frontier.
    position_relaxed: list[int] = field(default_factory=list)
    position_deviation: list[float] = field(default_factory=list)
    accepted_per_pass: list[int] = field(default_factory=list)  # accepted per pass that verified drafts
    k_per_pass: list[int] = field(default_factory=list)  # tokens drafted per pass (0: a plain step)
    predicted_tokens_per_s: float | None = None  # the cost model's expectation (-k auto)
    lookup_blocks: int = 0  # blocks proposed by prompt lookup instead of the draft model
    # Of drafted_tokens / accepted_tokens, those of lookup blocks: each proposer's own
    # acceptance (the draft model's is the rest), which the shared totals hide.
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV was already in the cache
    # What the -k auto policy learns from, per source of blocks: "draft" (the proposer's
    # own blocks: the draft model's, or prompt lookup's when it drafts alone) and "lookup:N"
    # (the hybrid proposer's copies after a matched n-gram of N tokens), each as [tests,
    # accepts] over draft positions whose test ran (up to the first rejection), so
    # accepts / tests is that source's per-position conditional acceptance. Stored starting
    # estimates (:mod:`nsd.draftlen.priors`) are made from these counts.
    acceptance_counts: dict[str, list[int]] = field(default_factory=dict)
    # Of propose_s, the draft model reading the prompt (its first catch-up): once per
    # request, so not a cost of the blocks (the target's own prompt is in prefill_s).
    draft_prefill_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean accepted length: new tokens per target pass (1.0 for AR)."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.position_accepts, self.position_attempts)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.wall_s - self.prefill_s
        return self.new_tokens / decode if decode > 0 else 0.0

    @property
    def overhead_per_pass_s(self) -> float:
        """nsd's own time per target pass: sampling transform, verification, bookkeeping."""
        rest = self.wall_s - self.prefill_s - self.propose_s - self.target_s
        return rest / self.target_passes if self.target_passes else 0.0

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        for name in ("tau", "acceptance_rate", "acceptance_by_position", "tokens_per_s",
                     "decode_tokens_per_s", "overhead_per_pass_s"):
            out[name] = getattr(self, name)
        out["deviation_per_token"] = self.deviation / self.new_tokens if self.new_tokens else 0.0
        return out


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target distribution of its position,
    and the ``top`` most likely tokens there as ``(id, logprob)`` (most likely first).

    The distribution is ``p``, the one the target samples from (after penalties and bias,
    temperature, top-k, top-p and min-p; tokens they remove have ``-inf``). At temperature
    0, where ``p`` is one-hot, it is the plausibility distribution p̂ instead: the softmax
    at temperature 1 of the adjusted logits, whose argmax is the emitted token.

    Where ``p`` keeps fewer than ``top`` tokens, the remaining entries are the tokens the
    filters removed that the target found likeliest (by its adjusted logits, before top-k,
    top-p and min-p), each with ``-inf``: real runners-up, not arbitrary zero-probability ids.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _logprobs(logits: torch.Tensor, probs: torch.Tensor | None, tokens: Sequence[int],
              sampling: SamplingConfig, history: Sequence[int], drafts: Sequence[int],
              top_n: int) -> list[TokenLogprob]:
    """:class:`TokenLogprob` of ``tokens``, token ``i`` emitted at row ``i`` of ``logits``."""
    rows = logits[:len(tokens)]
    if sampling.greedy:
        logp = torch.log_softmax(adjust_logits(rows, sampling, history, drafts).float(), dim=-1)
    else:
        if probs is None:
            probs = logits_to_probs(rows, sampling, history, drafts)
        logp = torch.log(probs[:len(tokens)].double()).float()
    logp = logp.cpu()
    top_n = min(top_n, logp.shape[-1])
    top_values, top_ids = torch.topk(logp, top_n, dim=-1) if top_n else (None, None)
    if top_values is not None and not torch.isfinite(top_values).all():
        _fill_removed(top_values, top_ids, logp, rows, sampling, history, drafts)
    out = []
    for i, tok in enumerate(tokens):
        top = () if top_ids is None else tuple(zip(top_ids[i].tolist(), top_values[i].tolist()))
        out.append(TokenLogprob(int(tok), float(logp[i, tok]), top))
    return out


def _fill_removed(top_values: torch.Tensor, top_ids: torch.Tensor, logp: torch.Tensor,
                  rows: torch.Tensor, sampling: SamplingConfig, history: Sequence[int],
                  drafts: Sequence[int]) -> None:
    """Replace, in place, the ``-inf`` entries of each row's top list (more entries asked
    for than the filters kept tokens) by the removed tokens the target ranks highest.

    Among tokens of probability 0, ``topk`` picks arbitrary ids (often special tokens); the
    adjusted logits, before temperature and the filters, rank them as the target does
    (temperature divides every logit alike, so it changes no order).
    """
    adjusted = adjust_logits(rows, sampling, history, drafts).float().cpu()
    removed = adjusted.masked_fill(torch.isfinite(logp), float("-inf"))
    top_n = top_values.shape[-1]
    _, fill_ids = torch.topk(removed, top_n, dim=-1)
    for i in range(top_values.shape[0]):
        kept = int(torch.isfinite(top_values[i]).sum())  # finite entries come first
        top_ids[i, kept:] = fill_ids[i, :top_n - kept]
        top_values[i, kept:] = float("-inf")


def method_name(config: DecodeConfig) -> str:
    """The method a run is named by: what it did (a rule that cannot relax verifies
    exactly, so it is ``sd``); see :func:`nsd.rules.verify.method_of_rule`."""
    return method_of_rule(config.rule, config.speculative)


@dataclass
class DecodeTally:
    """The counters of one generation, filled pass by pass; :meth:`to_stats` freezes them.

    Statistics cover emitted tokens only: an accepted EOS ends the output, and the drafts
    after it are neither output nor candidates for it.
    """

    speculative: bool
    prompt_tokens: int
    cached_prompt_tokens: int
    start: float  # perf_counter() when the generation began
    prefill_s: float
    spent: torch.Tensor  # [1] float64: D, the deviation charged so far
    generated: list[int] = field(default_factory=list)
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    relaxed: int = 0
    # Per draft position: blocks whose test reached it, and those it passed.
    attempts: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)
    relaxed_at: list[int] = field(default_factory=list)  # relaxed accepts per draft position
    deviation_at: list[float] = field(default_factory=list)  # D charged per draft position
    # Seconds in the proposer and in the target's forwards after the prefill.
    propose_s: float = 0.0
    target_s: float = 0.0
    accepted_per_pass: list[int] = field(default_factory=list)
    k_per_pass: list[int] = field(default_factory=list)
    lookup_blocks: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    acceptance_counts: dict[str, list[int]] = field(default_factory=dict)
    stop_reason: str = "length"

    def record_pass(self, drafted: int, propose_s: float, target_s: float) -> None:
        """One target pass, after ``drafted`` tokens were proposed (0: a plain step)."""
        self.passes += 1
        self.propose_s += propose_s
        self.target_s += target_s
        if self.speculative:  # what was drafted: prompt lookup may find fewer than k
            self.k_per_pass.append(drafted)

    def record_block(self, result: VerifyResult, emitted: int, lookup_match: int | None) -> None:
        """A verified block of ``n`` drafts of which ``emitted`` tokens were output (the
        accepted run and the recovered or bonus token, cut at an EOS); ``lookup_match``:
        the matched n-gram length if prompt lookup drafted it, else None.

        Token ``i`` of the output is draft position ``i`` (the last may be the recovered
        token at the rejected position, or the bonus one past the drafts).
        """
        n = result.accepted.shape[-1]
        n_acc = int(result.num_accepted[0])
        eos_cut = emitted < n_acc + 1  # an accepted draft was an EOS
        emitted_drafts = min(emitted, n)
        emitted_acc = min(n_acc, emitted)
        # D is charged only where a token is emitted; the deviation is 0 past the
        # rejection, so a prefix sum (in the budget scan's order) is the exact charge.
        self.spent = charge(self.spent.to(result.deviation.device),
                            result.deviation[:, :emitted_drafts])
        # Drafts past a rejection were tried and failed, so they count; past an EOS not.
        tried = emitted if eos_cut else n
        self.drafted += tried
        self.accepted += emitted_acc
        if lookup_match is not None:
            self.lookup_drafted += tried
            self.lookup_accepted += emitted_acc
        source = "draft" if lookup_match is None else f"lookup:{lookup_match}"
        counts = self.acceptance_counts.setdefault(source, [0, 0])
        counts[0] += min(n_acc + 1, n)  # as the policy counts them (an EOS cut aside)
        counts[1] += n_acc
        # One transfer per block for both rows (not one .item() per position).
        relaxed, charged = torch.stack((result.relaxed[0, :emitted_drafts].to(torch.float64),
                                        result.deviation[0, :emitted_drafts].to(torch.float64))).tolist()
        self.relaxed += int(sum(relaxed))
        _add_at(self.relaxed_at, [int(r) for r in relaxed])
        _add_at(self.deviation_at, charged)
        _add_at(self.attempts, [1] * min(emitted_acc + 1, emitted_drafts))  # positions reached
        _add_at(self.accepts, [1] * emitted_acc)
        self.accepted_per_pass.append(emitted_acc)

    def to_stats(self, method: str, predicted_tokens_per_s: float | None,
                 draft_prefill_s: float = 0.0) -> DecodeStats:
        attempts = _trim_zeros(self.attempts)
        return DecodeStats(
            method=method, prompt_tokens=self.prompt_tokens, new_tokens=len(self.generated),
            target_passes=self.passes, drafted_tokens=self.drafted,
            accepted_tokens=self.accepted, relaxed_accepts=self.relaxed,
            deviation=float(self.spent[0]), stop_reason=self.stop_reason,
            prefill_s=self.prefill_s, wall_s=time.perf_counter() - self.start,
            propose_s=self.propose_s, target_s=self.target_s, position_attempts=attempts,
            position_accepts=(self.accepts + [0] * len(attempts))[:len(attempts)],
            # Both are as long as attempts: each block adds to the positions it reached.
            position_relaxed=list(self.relaxed_at), position_deviation=list(self.deviation_at),
            accepted_per_pass=self.accepted_per_pass, k_per_pass=self.k_per_pass,
            predicted_tokens_per_s=predicted_tokens_per_s, lookup_blocks=self.lookup_blocks,
            lookup_drafted=self.lookup_drafted, lookup_accepted=self.lookup_accepted,
            cached_prompt_tokens=self.cached_prompt_tokens, draft_prefill_s=draft_prefill_s,
            acceptance_counts=self.acceptance_counts)


def choose_block(policy: KPolicy, proposer: Proposer | None, context: Sequence[int],
                 remaining: int, longest: int) -> tuple[int, int | None]:
    """The next block: ``(k, lookup_match)``, ``k`` tokens to draft (0: a plain step) and,
    where prompt lookup drafts them, the length of the n-gram it matched (else None).

    ``proposer`` None: plain decoding. A proposer with a free source (prompt lookup beside
    a draft model) says how many tokens it could propose for nothing; a policy that can
    price both picks per block, otherwise the proposer's own rule does.
    """
    if proposer is None:
        return 0, None
    free, match = proposer.free_length(context, min(longest, remaining - 1))
    k, from_lookup = policy.plan(remaining, free, match)
    if from_lookup is None:
        from_lookup = proposer.fixed_k_lookup(free, k, match)
    k = max(0, min(k, remaining - 1))
    return k, (match if from_lookup else None)


def _prefill(target: ModelBackend, context: list[int], reuse_cache: bool) -> int:
    """Feed all but the prompt's last token; return how many the cache already held.

    With ``reuse_cache``, keep the longest prefix of the prompt the cache holds (the last
    conversation, or a prefix-cache entry restored into it) and feed only the rest."""
    held = cached_tokens(target) if reuse_cache else None
    reused = 0 if held is None else common_prefix_length(held, context[:-1])
    if reused:
        target.rewind(reused)
    else:
        target.reset()
    if len(context) - 1 > reused:
        target.forward(context[reused:-1], all_logits=False)
    return reused


def _verify_drafts(config: DecodeConfig, logits: torch.Tensor, proposal: Proposal,
                   generated: list[int], generator: torch.Generator, spent: torch.Tensor
                   ) -> tuple[VerifyResult, torch.Tensor]:
    """The rule on one block: ``(result, target_probs)``. ``logits``: ``[n + 1, V]``, the
    target's rows at the ``n`` draft positions and the bonus one."""
    sampling, rule = config.sampling, config.rule
    draft, n = proposal.tokens.tolist(), len(proposal)
    device = logits.device  # the target's; draft tokens, uniforms and D move there
    # Row i follows the generated tokens and drafts[:i] (penalties count both).
    target_probs = logits_to_probs(logits, sampling, generated, draft)  # [n+1, V]
    plaus = plausibility_probs(logits[:n], sampling, target_probs[:n], generated, draft) \
        if rule.relaxes else target_probs[:n]
    # Uniforms come from the CPU generator, so a seed means the same on any device.
    accept_uniforms = torch.rand(1, n, dtype=torch.float64, generator=generator,
                                 device=generator.device).to(device)
    sample_uniforms = torch.rand(1, dtype=torch.float64, generator=generator,
                                 device=generator.device).to(device)
    # Top-K/δ at temperature > 0 (Modular MAX) reads two more inputs; asked for after the
    # uniforms above because its own uniforms must come last (other rules' streams unchanged).
    relaxed_probs, mix_uniforms = topk_delta_inputs(rule, sampling, logits[:n], generator, generated, draft)
    result = verify(
        rule,
        target_probs.unsqueeze(0),
        plaus.unsqueeze(0),
        proposal.tokens.to(device).unsqueeze(0),
        None if proposal.probs is None else proposal.probs.to(device).unsqueeze(0),
        accept_uniforms,
        sample_uniforms,
        spent.to(device),
        greedy=sampling.greedy,  # all-or-nothing relaxation: greedy output is seed-free
        relaxed_probs=relaxed_probs,
        mix_uniforms=mix_uniforms,
    )
    return result, target_probs


def decode(
    target: ModelBackend,
    prompt_ids: Sequence[int],
    config: DecodeConfig,
    proposer: Proposer | None = None,
    eos_token_ids: Sequence[int] = (),
    stop_check: Callable[[list[int]], bool] | None = None,
    k_policy: KPolicy | None = None,
    logprob_sink: list[TokenLogprob] | None = None,
    reuse_cache: bool = False,
) -> Generator[list[int], None, DecodeStats]:
    """Generate up to ``config.max_new_tokens`` tokens after ``prompt_ids``.

    Yields the tokens each target pass adds (EOS included when it ends the generation);
    returns the :class:`DecodeStats`. ``stop_check(generated)`` may end the run early (stop
    strings). ``k_policy`` chooses each block's draft length (default: from ``config``).
    With ``config.logprobs``, each emitted token's :class:`TokenLogprob` goes to
    ``logprob_sink`` before its pass is yielded. ``reuse_cache``: the prefill keeps what the
    target's cache holds of the prompt (off by default: compared runs all pay their prefill).
    """
    _check_inputs(prompt_ids, config, proposer)
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    eos, context = set(eos_token_ids), list(prompt_ids)
    reused = _prefill(target, context, reuse_cache)
    spent = torch.zeros(1, dtype=torch.float64, device=generator.device)  # D so far
    tally = DecodeTally(config.speculative, len(context), reused, start, time.perf_counter() - start, spent)
    policy = k_policy if k_policy is not None else config.default_policy()
    policy.begin(config.draft_catchup(len(context)))
    if proposer is not None:  # where the generated tokens start (penalties count only those)
        proposer.begin(len(context))
    drafter = proposer if config.speculative else None
    sink = logprob_sink if config.logprobs is not None else None
    generated = tally.generated
    while len(generated) < config.max_new_tokens:
        remaining = config.max_new_tokens - len(generated)
        k, lookup_match = choose_block(policy, drafter, context, remaining, config.longest_block)
        tally.lookup_blocks += int(lookup_match is not None and k > 0)
        t0 = time.perf_counter()
        proposal = drafter.propose(context, k, generator, lookup=lookup_match is not None) \
            if drafter is not None and k > 0 else None
        draft = proposal.tokens.tolist() if proposal is not None else []
        t1 = time.perf_counter()
        logits = target.forward([context[-1]] + draft)  # [len(draft) + 1, V]
        t2 = time.perf_counter()
        tally.record_pass(len(draft), t1 - t0, t2 - t1)
        new, n_acc, probs = _accept(target, context, logits, proposal, config, generator, tally,
                                    eos, remaining, lookup_match)
        if sink is not None:
            sink.extend(_logprobs(logits, probs, new, config.sampling, generated, draft, config.logprobs))
        if config.speculative:
            # The cost model learns from what the verifier did (an EOS cut is not a rejection).
            policy.observe(k, len(draft), n_acc, t1 - t0, t2 - t1, time.perf_counter() - t2)
        context.extend(new)  # the cache may hold tokens past an EOS, harmless at the end
        generated.extend(new)
        yield new
        if new and new[-1] in eos or stop_check is not None and stop_check(generated):
            tally.stop_reason = "eos" if new and new[-1] in eos else "stop"
            break
    return tally.to_stats(method_name(config), policy.predicted_tokens_per_s,
                          drafter.prefill_s if drafter is not None else 0.0)


def _accept(target: ModelBackend, context: list[int], logits: torch.Tensor,
            proposal: Proposal | None, config: DecodeConfig, generator: torch.Generator,
            tally: DecodeTally, eos: set[int], remaining: int, lookup_match: int | None
            ) -> tuple[list[int], int, torch.Tensor | None]:
    """The tokens one pass adds, ``(new, accepted drafts, target_probs)``: a sampled token
    after a plain step, else the verified block (recorded in ``tally``, the target's cache
    rewound past the rejected drafts). Cut after an EOS and at ``remaining`` tokens."""
    generated = tally.generated
    if proposal is None or len(proposal) == 0:
        token = _sample_one(logits[-1], config.sampling, generator, generated)
        return _cut_at_eos([token], eos)[:remaining], 0, None
    result, target_probs = _verify_drafts(config, logits, proposal, generated, generator, tally.spent)
    n_acc = int(result.num_accepted[0])
    draft = proposal.tokens.tolist()
    new = _cut_at_eos(draft[:n_acc] + [int(result.next_token[0])], eos)[:remaining]
    tally.record_block(result, len(new), lookup_match)
    target.rewind(len(context) + n_acc)
    return new, n_acc, target_probs


def _check_inputs(prompt_ids: Sequence[int], config: DecodeConfig, proposer: Proposer | None) -> None:
    if len(prompt_ids) == 0:
        raise NSDError("the prompt is empty: give at least one token")
    if config.speculative and proposer is None:
        raise NSDError("speculative decoding needs a proposer (a draft model or n-gram lookup)")


def _sample_one(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator,
                history: Sequence[int] = ()) -> int:
    """One autoregressive step: the lean path, so the AR baseline pays no verifier cost."""
    if sampling.greedy:
        return int(adjust_logits(logits, sampling, history).argmax())
    probs = logits_to_probs(logits, sampling, history).unsqueeze(0)
    uniform = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)
    return int(sample_from(probs, uniform)[0])


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS."""
    for i, tok in enumerate(tokens):
        if tok in eos:
            return tokens[:i + 1]
    return tokens


def _add_at(totals: list, values: Sequence) -> None:
    """``totals[i] += values[i]``, growing ``totals`` as needed."""
    totals.extend([0] * (len(values) - len(totals)))
    for i, v in enumerate(values):
        totals[i] += v


def _trim_zeros(counts: list[int]) -> list[int]:
    last = max((i for i, c in enumerate(counts) if c), default=-1)
    return counts[:last + 1]


def run_to_end(gen: Generator[list[int], None, DecodeStats]) -> tuple[list[int], DecodeStats]:
    """Drain a :func:`decode` generator; return all tokens and the statistics."""
    tokens: list[int] = []
    while True:
        try:
            tokens.extend(next(gen))
        except StopIteration as stop:
            return tokens, stop.value


