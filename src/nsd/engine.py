"""The engine: a target model, optionally a draft model, their tokenizer, and generation.

It loads the models (:mod:`nsd.models`), builds the proposer and the draft-length policy a
generation asks for, runs :func:`nsd.decode.decode` and turns tokens into streamed text.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Mapping, Sequence

import torch

from nsd.backends.base import ModelBackend, SupportsBatch, context_limit, device_of, eos_token_ids
from nsd.backends.sequences import StepBatcher, sequence_views
from nsd.draftlen.batchplan import BatchCosts, JointPlanner
from nsd.draftlen.calibrate import BATCH_CONTEXT
from nsd.draftlen.costmodel import AcceptanceTracker, CostModelK, StepCosts, expected_tokens, marginal_costs
from nsd.decode import DecodeConfig, DecodeStats, decode, method_name
from nsd.errors import NSDError
from nsd.options import NEEDS_DRAFT, PROPOSERS, RELAXED_METHODS, default_proposer
from nsd.decode import TokenLogprob
from nsd.draftlen.host_costs import HostCosts, host_costs
from nsd.generation import GenerationConfig, GenerationResult, TextChunk, TokenInfo
from nsd.models.loader import (BackendOptions, LoadedModel, backend_kind, check_transformers_flags,
                               load_backend, load_tokenizer)
from nsd.models.registry import REGISTRY, resolve_model
from nsd.prefix_cache import PrefixCache
from nsd.draftlen.priors import AcceptancePriors, lookup_measured, stored_priors
from nsd.proposers.base import Proposer
from nsd.proposers.draft_model import DraftModelProposer
from nsd.proposers.hybrid import HybridProposer
from nsd.proposers.ngram import NgramConfig, NgramProposer
from nsd.stops import StopScanner, visible_text

CHAT_ROLES = ("system", "user", "assistant")


# The draft length at which --weights auto prices a target's verification forward (k = 4,
# the fixed k nsd's benchmarks use; -k auto's blocks on CPUs are mostly 2-8).
_PICK_K = 4


_HOST_LOCK = threading.Lock()  # engines and their slots share the memo of _host_costs


@dataclass
class _Shared:
    """What the slots of :meth:`Engine.batched` share with the engine they came from."""

    host_memo: dict = field(default_factory=dict)  # nsd's own work per pass, measured once
    # A fixed value of that work instead of a measured one (tests pin it).
    host_costs: Callable[[DecodeConfig], HostCosts] | None = None
    # The largest k_max whose step costs were measured before the models were shared
    # between slots; None: not a slot (measured on demand).
    frozen_k_max: int | None = None
    joint: JointPlanner | None = None  # a slot's: the batch's shared draft lengths


def load_engine(target: str, draft: str | None = None, proposer: str | None = None,
                options: BackendOptions = BackendOptions(), ngram: NgramConfig = NgramConfig(),
                k_max: int = GenerationConfig.k_max) -> Engine:
    """Load a target (and a draft) by registry name or path and make an :class:`Engine`.

    ``options`` says how they run (``options.draft_vocab``: the draft's vocabulary). The
    proposer defaults to prompt lookup without a draft, else the draft model (beside prompt
    lookup where its acceptance is measured: see :func:`nsd.options.default_proposer`).
    """
    proposer = proposer or default_proposer(bool(draft), lookup_measured(target, draft))
    if proposer not in PROPOSERS:
        raise NSDError(f"unknown proposer {proposer!r}; choose {', '.join(PROPOSERS)}")
    if proposer in NEEDS_DRAFT and not draft:
        raise NSDError(f"the {proposer} proposer needs a draft model (--draft NAME or path)")
    if proposer in NEEDS_DRAFT:
        resolve_model(draft)  # a damaged draft is reported before the target's slow load
    elif options.draft_vocab != "auto":
        why = f"the {proposer} proposer drafts without it" if draft else "no draft model is given"
        raise NSDError(f"--draft-vocab sets the draft model's vocabulary, and {why}: it "
                       "would change nothing")
    # --compile and --dtype act on transformers only: refused before any load where no
    # model of the pair runs there, and passed only to the one that does (a transformers
    # target beside a llama.cpp draft takes them; the draft ignores them).
    kinds = {m: backend_kind(m, options) for m in ([target, draft] if proposer in NEEDS_DRAFT else [target])}
    check_transformers_flags(list(kinds.values()), options)
    plain = dataclasses.replace(options, compile="none", dtype="auto")

    def options_for(model: str) -> BackendOptions:
        return options if kinds[model] == "hf" else plain

    # The target's costs are measured up to k_max + 1 tokens at once (verification).
    # With --weights auto its file is chosen for verifying too: a block of
    # _PICK_K drafts at the acceptance prior -k auto starts from.
    verify = (_PICK_K + 1, expected_tokens([AcceptanceTracker.prior] * _PICK_K, _PICK_K))
    target_model = load_backend(target, options_for(target), calibrate_n=k_max + 1, verify=verify)
    tokenizer = load_tokenizer(target_model.tokenizer_dir)
    draft_model = None
    if proposer in NEEDS_DRAFT:
        draft_model = load_backend(draft, options_for(draft), options.draft_vocab,
                                   weights=options.draft_weights or options.weights)
        _check_same_tokenizer(tokenizer, load_tokenizer(draft_model.tokenizer_dir), target, draft)
    # Registry names key the stored acceptance priors (a file given by path has none).
    names = (target if target in REGISTRY else None, draft if draft in REGISTRY else None)
    return Engine(target_model, tokenizer, draft_model, proposer=proposer, ngram=ngram,
                  k_max=k_max, model_names=names)


class Engine:
    """A target model, optionally a draft model, and their shared tokenizer.

    With a :class:`~nsd.prefix_cache.PrefixCache` in ``prefix_cache`` (``nsd serve`` gives
    it one), each generation reuses the longest prefix of its prompt that the models'
    caches still hold from the last one, or that a saved snapshot of an earlier sequence
    holds, and counts the reuse. Without one (the default) every generation prefills its
    whole prompt, so that generations compared with each other pay the same.
    """

    def __init__(self, target: LoadedModel, tokenizer: Any, draft: LoadedModel | None = None,
                 proposer: str | None = None, ngram: NgramConfig = NgramConfig(),
                 k_max: int = GenerationConfig.k_max, eos_token_ids: Sequence[int] | None = None,
                 model_names: tuple[str | None, str | None] = (None, None),
                 prefix_cache: PrefixCache | None = None, shared: _Shared | None = None) -> None:
        """An engine over models already loaded (:func:`load_engine` loads them by name;
        :meth:`from_backends` wraps bare backends). ``model_names``: the registry names that
        key stored acceptance priors. ``shared``: what the slots of :meth:`batched` share
        with the engine they were made from (its measured costs, the batch's plan)."""
        if isinstance(target, (str, Path)):  # the constructor before load_engine existed
            raise NSDError("Engine takes loaded models; load one by name or path with "
                           "nsd.api.load_engine(target, draft=...)")
        proposer = proposer or default_proposer(draft is not None)
        if proposer not in PROPOSERS:
            raise NSDError(f"unknown proposer {proposer!r}; choose {', '.join(PROPOSERS)}")
        if proposer in NEEDS_DRAFT and draft is None:
            raise NSDError(f"the {proposer} proposer needs a draft model (--draft NAME or path)")
        self.target_model, self.draft_model = target, draft
        self.target = target.backend
        self.draft: ModelBackend | None = draft.backend if draft is not None else None
        if draft is not None and draft.vocab_map is None and self.draft.vocab_size != self.target.vocab_size:
            raise NSDError(f"the draft model has {self.draft.vocab_size} logits per token but the "
                           f"target has {self.target.vocab_size}: they must share a vocabulary")
        self.tokenizer = tokenizer
        self.proposer_kind = proposer
        self.ngram = ngram
        self.k_max = k_max
        self.model_names = model_names
        # With a prefix cache (nsd serve gives it one) each generation reuses the longest
        # prefix of its prompt the caches still hold; without one every generation
        # prefills its whole prompt, so that generations compared with each other pay alike.
        self.prefix_cache = prefix_cache
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else self._eos_ids()
        self._shared = shared if shared is not None else _Shared()

    @classmethod
    def from_backends(cls, target: ModelBackend, tokenizer, draft: ModelBackend | None = None,
                      proposer: str | None = None, ngram: NgramConfig = NgramConfig(),
                      eos_token_ids: Sequence[int] | None = None) -> Engine:
        """An engine over backends already loaded (any :class:`ModelBackend`, e.g. a test's
        mock LM) and a tokenizer with ``encode``/``decode``. Their step costs, if ``-k
        auto`` needs them, are measured in place and not cached."""
        return cls(LoadedModel(target, None, None), tokenizer,
                   LoadedModel(draft, None, None) if draft is not None else None,
                   proposer=proposer, ngram=ngram, eos_token_ids=eos_token_ids)

    @classmethod
    def from_models(cls, target_model: Any, tokenizer: Any, draft_model: Any = None,
                    proposer: str | None = None, ngram: NgramConfig = NgramConfig(),
                    max_len: int = 4096, compile: bool | str = False) -> Engine:
        """An engine around models already in memory, like transformers' ``assistant_model``.

        ``target_model`` and ``draft_model`` are transformers causal LMs (run where they
        are, in their dtype, with nsd's static KV cache; not modified) or ready
        :class:`ModelBackend` objects; ``tokenizer`` is the one tokenizer they share.
        """
        proposer = proposer or default_proposer(draft_model is not None)
        if proposer in NEEDS_DRAFT and draft_model is None:
            raise NSDError(f"the {proposer} proposer needs a draft model (draft_model=...)")

        def wrap(model: Any) -> ModelBackend:
            if isinstance(model, ModelBackend):
                return model
            from nsd.backends.hf import HFBackend

            return HFBackend.from_model(model, max_len=max_len, compile=compile)

        draft = wrap(draft_model) if proposer in NEEDS_DRAFT else None
        return cls.from_backends(wrap(target_model), tokenizer, draft, proposer=proposer, ngram=ngram)

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(eos_token_ids(self.target))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    @property
    def context_length(self) -> int | None:
        """Tokens the loaded models can hold (prompt + generation), or None when unbounded."""
        return context_limit([self.target, self.draft])

    def encode(self, prompt: str | Sequence[Mapping[str, str]], chat: bool = False,
               system: str | None = None) -> list[int]:
        """Token ids of ``prompt``; with ``chat``, wrapped in the model's chat template.

        ``prompt`` may also be a conversation: a list of ``{"role", "content"}`` messages
        with roles ``system``, ``user`` and ``assistant``, always wrapped in the template; a
        message's ``name``, if given, is passed to the template too (which may ignore it).
        A prompt is empty when it encodes to no token: a conversation of empty messages
        still has its template's tokens, and is not.
        """
        if not isinstance(prompt, str):
            return _nonempty(self._encode_messages(list(prompt)))
        if system is not None and not chat:  # it would be dropped without a word
            raise NSDError("a system message goes into the chat template: give chat=True (--chat)")
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": prompt}]
            return _nonempty(self._encode_messages(messages))
        return _nonempty(self.tokenizer.encode(prompt))

    def _encode_messages(self, messages: list[Mapping[str, str]]) -> list[int]:
        for i, message in enumerate(messages):
            if message.get("role") not in CHAT_ROLES:
                raise NSDError(f"message {i} has role {message.get('role')!r}; roles are "
                               f"{', '.join(CHAT_ROLES)}")
            if not isinstance(message.get("content"), str):
                raise NSDError(f"message {i} has no text content")
            if message.get("name") is not None and not isinstance(message["name"], str):
                raise NSDError(f"message {i} has a name that is not a string")
        if not self.tokenizer.chat_template:
            raise NSDError("this model's tokenizer has no chat template: use a plain prompt (no --chat)")
        clean = [{k: m[k] for k in ("role", "content", "name") if m.get(k) is not None}
                 for m in messages]
        text = self.tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def use_proposer(self, kind: str) -> None:
        """Draft with ``kind`` from the next generation on: ``draft`` (the draft model this
        engine loaded), ``ngram`` (prompt lookup) or ``hybrid`` (both). The models stay
        loaded either way."""
        if kind not in PROPOSERS:
            raise NSDError(f"unknown proposer {kind!r}; choose {', '.join(PROPOSERS)}")
        if kind in NEEDS_DRAFT and self.draft is None:
            raise NSDError(f"the {kind} proposer needs a draft model (--draft NAME or path)")
        self.proposer_kind = kind

    def make_proposer(self, config: DecodeConfig) -> Proposer | None:
        if not config.speculative:
            return None
        if self.proposer_kind == "ngram":
            return NgramProposer(self.ngram)
        draft = DraftModelProposer(self.draft, config.sampling, self.target.vocab_size,
                                   self.draft_model.vocab_map, reuse_cache=self.prefix_cache is not None,
                                   argmax=config.rule.argmax_drafts,
                                   prompt_window=config.draft_context)
        if self.proposer_kind == "hybrid":
            return HybridProposer(draft, NgramProposer(self.ngram))
        return draft

    def check_auto_k(self, k_max: int) -> None:
        """Raise :class:`NSDError` where ``-k auto`` up to ``k_max`` cannot run on this
        engine: a slot of :meth:`batched` has only the step costs measured before the
        models were shared. A server calls this before queueing a request."""
        frozen = self._shared.frozen_k_max
        if frozen is not None and k_max > frozen:
            # Measuring now would run the shared models outside the batch.
            if not frozen:
                raise NSDError("-k auto is unavailable here: the step costs could not be "
                               "measured before the models were shared; give a fixed k")
            # k_max named first: the server names the field a message mentions first.
            raise NSDError(f"k_max {k_max} is more than -k auto can use here: this server "
                           f"measured its step costs up to k_max {frozen}; ask for "
                           "at most that")

    def k_policy(self, config: DecodeConfig) -> CostModelK | None:
        """The cost-model policy for ``-k auto`` (None for fixed or adaptive k, and AR).

        Costs: the target's stored ``c(1..k_max+1)`` and the draft's ``c(1)`` (0 for n-gram
        lookups), each with nsd's own work per pass added (:meth:`_host_costs`). Acceptance
        is learnt online within the generation, starting from the same prior every time,
        and the policy's draws are seeded from ``config.seed``: a
        seeded generation is therefore reproducible, whatever ran before it on this engine
        and however busy the machine is.
        """
        if not (config.speculative and config.auto_k):
            return None
        self.check_auto_k(config.k_max)
        target_costs = self.target_model.step_costs(config.k_max + 1)
        draft_cost = 0.0
        drafts = self.proposer_kind in NEEDS_DRAFT
        if drafts:
            draft_cost = self.draft_model.step_costs(1)[0]
        host = self._host_costs(config)
        costs = host.apply(target_costs, draft_cost, draft_model=drafts)
        priors = self.acceptance_priors(config)
        lookup = AcceptanceTracker(config.k_max, priors.for_lookup(1)) \
            if self.proposer_kind == "hybrid" else None
        policy = CostModelK(costs, AcceptanceTracker(config.k_max, priors.draft),
                            config.k_max, seed=config.seed, lookup_tracker=lookup,
                            lookup_prior=priors.for_lookup if lookup is not None else None)
        # A slot of batched(): price the shared forwards, and join the batch's plan. Not a
        # greedy request whose rule can relax: its text depends on what was drafted, so it
        # drafts as it would alone and gives the same text whatever runs beside it.
        if isinstance(self.target, SupportsBatch) and not drafts_shape_text(config):
            draft_table = self.draft_model.step_costs(config.k_max + 1) if drafts else ()
            priced: dict[tuple[int, int], StepCosts] = {}

            def reprice() -> StepCosts:
                key = (self.target.batch_others(), self.draft.batch_others() if drafts else 0)
                if key not in priced:
                    draft = marginal_costs(draft_table, key[1])[0] if drafts else 0.0
                    priced[key] = host.apply(marginal_costs(target_costs, key[0]), draft,
                                             draft_model=drafts)
                return priced[key]

            policy.reprice = reprice
            joint = self._shared.joint
            if joint is not None and drafts:
                joint.set_host(host.pass_cost, host.draft_token)
                policy.joint = joint
        return policy

    def acceptance_priors(self, config: DecodeConfig) -> AcceptancePriors:
        """Where ``-k auto``'s acceptance estimates start for this generation: the values
        stored for this model pair and setting (:mod:`nsd.draftlen.priors`), else the default."""
        target, draft = self.model_names
        if self.proposer_kind not in NEEDS_DRAFT:
            draft = None  # prompt lookup alone: stored under (target, None)
        elif draft is None:
            return AcceptancePriors()  # a draft model without a registry name
        if target is None or not config.speculative:
            return AcceptancePriors()
        return stored_priors(target, draft, method_name(config), config.sampling.greedy)

    def _host_costs(self, config: DecodeConfig) -> HostCosts:
        """nsd's own work per pass for this sampling and rule (see :mod:`nsd.draftlen.host_costs`):
        stored beside the step costs for models loaded from files; measured once per engine
        otherwise, so repeated seeded calls choose alike. A target on an accelerator runs
        that work there, where these CPU timings do not apply: it is left unpriced."""
        if self._shared.host_costs is not None:  # fixed by the caller rather than measured
            return self._shared.host_costs(config)
        if device_of(self.target).type != "cpu":
            return HostCosts(0.0, 0.0, 0.0, 0.0)
        draft_vocab = None  # the reduced draft's vocabulary, where it has one
        if self.draft_model is not None and self.draft_model.vocab_map is not None:
            draft_vocab = self.draft.vocab_size
        args = (self.target.vocab_size, config.sampling, config.rule, config.k_max + 1, draft_vocab)
        memo = self._shared.host_memo
        with _HOST_LOCK:
            if args not in memo:  # frozen configs: hashable, and equal exactly when they match
                memo[args] = host_costs(*args, persist=self.target_model.file is not None)
        return memo[args]

    def batched(self, n: int, prefill_chunk: int = 0) -> tuple[list[Engine], StepBatcher]:
        """``n`` engines sharing this one's models, tokenizer, prefix cache and measured
        costs, each decoding its own sequence of the models' caches on the thread that
        calls it, their forwards run together by the returned :class:`StepBatcher` (see
        :mod:`nsd.backends.sequences`). This engine must not generate afterwards: its
        caches become the slots'. ``-k auto`` is then limited to this engine's ``k_max``,
        whose costs are measured here, before the models are shared. A forward of more than
        ``prefill_chunk`` tokens beside other requests (0: none) runs in chunks, one per
        batched step (:class:`~nsd.backends.sequences.SequenceView`)."""
        if n < 1:
            raise NSDError(f"the number of parallel sequences must be >= 1, got {n}")
        frozen = self.k_max
        try:
            self.target_model.step_costs(self.k_max + 1)
            if self.draft_model is not None and self.draft is not None:
                # The draft's batched steps are priced by what each sequence adds (k_policy).
                self.draft_model.step_costs(self.k_max + 1)
        except NSDError:  # e.g. a context too short to time: no -k auto in the slots
            frozen = 0
        batcher = StepBatcher()
        backends = [self.target] + ([self.draft] if self.draft is not None else [])
        all_views = sequence_views(backends, n, batcher)
        for view in (v for views in all_views for v in views):
            view.prefill_chunk = prefill_chunk
        planner = None
        if frozen and n > 1 and self.draft is not None:
            planner = self._joint_planner(n)  # measured on the sequences just made
            if planner is not None:
                planner.bind(rounds=lambda: batcher.rounds, members=lambda: batcher.members)
                batcher.plan = planner
        slots = []
        for views in all_views:
            draft = views[1] if self.draft is not None else None
            shared = dataclasses.replace(self._shared, frozen_k_max=frozen, joint=planner)
            slots.append(Engine(
                dataclasses.replace(self.target_model, backend=views[0]), self.tokenizer,
                dataclasses.replace(self.draft_model, backend=draft) if draft is not None else None,
                proposer=self.proposer_kind, ngram=self.ngram, k_max=self.k_max,
                eos_token_ids=self.eos_token_ids, model_names=self.model_names,
                prefix_cache=self.prefix_cache, shared=shared))
        return slots, batcher

    def _joint_planner(self, n: int) -> JointPlanner | None:
        """The slots' shared draft-length plan (:mod:`nsd.draftlen.batchplan`), priced by forwards
        of up to ``n`` sequences measured as the batch runs them (once per machine and
        file). None where the models' contexts are too short to measure them."""
        assert self.draft_model is not None and self.draft is not None
        widths = sorted({w for w in (1, 2, 3, 5, 9) if w <= self.k_max + 1} | {self.k_max + 1})
        seqs = sorted({s for s in (1, 2, 4, 8, 16) if s <= n} | {n})
        room = self.context_length
        if room is not None and room < BATCH_CONTEXT + widths[-1] + seqs[-1]:
            return None
        try:
            target = self.target_model.batched_costs(seqs, widths)
            draft = self.draft_model.batched_costs(seqs, (1, 2))
        except NSDError:  # the server runs without the plan rather than not at all
            return None
        return JointPlanner(BatchCosts(tuple(seqs), tuple(widths), target),
                            BatchCosts(tuple(seqs), (1, 2), draft), self.k_max)

    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig
               ) -> Generator[str, None, GenerationResult]:
        """Yield text as it is produced; return the full :class:`GenerationResult`.

        With ``config.logprobs`` set, each piece is a :class:`TextChunk` whose ``logprobs``
        holds the :class:`TokenInfo` of the tokens whose text it completes (a last, possibly
        empty, chunk carries those of the tokens still held back)."""
        joined: list[CostModelK] = []  # a batch's plan to leave, however this ends
        prepared: list[int] = []  # prompt tokens the prefix cache found, once it looked
        try:
            return (yield from self._stream(prompt_ids, config, joined, prepared))
        except GeneratorExit:  # closed early (a cancelled request): its reuse counts too
            if prepared and self.prefix_cache is not None:
                self.prefix_cache.record(len(prompt_ids), prepared[0])
            raise
        finally:
            for policy in joined:
                policy.end()

    def _stream(self, prompt_ids: Sequence[int], config: GenerationConfig,
                joined: list[CostModelK], prepared: list[int]) -> Generator[str, None, GenerationResult]:
        decode_config = config.decode_config()
        # Refuse up front what cannot fit, rather than fail once the cache is full with the
        # tokens generated so far lost (the server checks the same before queueing).
        room = self.context_length
        if room is not None and len(prompt_ids) + decode_config.max_new_tokens > room:
            raise NSDError(f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens "
                           f"{decode_config.max_new_tokens} that exceeds the context of {room} "
                           "tokens (shorten the prompt, lower max_new_tokens or raise n_ctx)")
        stops = tuple(s for s in config.stop if s)
        tail = max((len(s) for s in stops), default=0) + 16  # characters held back on display
        stop_check = StopScanner(self.tokenizer, stops) if stops else None
        cache = self.prefix_cache
        if cache is not None:
            # The draft's snapshot is of what the draft itself holds (behind the target's
            # after lookup blocks): its proposer reuses it only as far as it matches.
            prepared.append(cache.prepare(self.target, self.draft if self.proposer_kind in NEEDS_DRAFT
                                          else None, prompt_ids))
        sink: list[TokenLogprob] | None = [] if config.logprobs is not None else None
        pieces = _TokenText(self.tokenizer) if sink is not None else None
        infos: list[TokenInfo] = []
        sent = 0  # infos handed out in chunks
        policy = self.k_policy(decode_config)
        proposer = self.make_proposer(decode_config)
        gen = decode(self.target, list(prompt_ids), decode_config, proposer,
                     self.eos_token_ids, stop_check, policy, sink, reuse_cache=cache is not None)
        if policy is not None and policy.joint is not None:
            policy.join(decode_config.draft_catchup(len(prompt_ids)), decode_config.max_new_tokens)
            joined.append(policy)
        tokens: list[int] = []
        shown = ""
        while True:
            try:
                tokens.extend(next(gen))
            except StopIteration as done:
                stats: DecodeStats = done.value
                if cache is not None:
                    cache.record(stats.prompt_tokens, stats.cached_prompt_tokens,
                                 proposer.reused_tokens if proposer is not None else None)
                    prepared.clear()  # counted: a close at the last text must not count it again
                break
            text = visible_text(self.tokenizer, tokens, stops)
            # Hold back a trailing partial UTF-8 character and a possible stop-string prefix.
            safe = text.rstrip("\ufffd")
            if stops:
                safe = safe[:max(len(shown), len(safe) - tail)]
            if pieces is not None:
                infos.extend(pieces.add(sink[len(infos):]))
            if len(safe) > len(shown) and safe.startswith(shown):
                piece = safe[len(shown):]
                shown = safe
                if pieces is not None:
                    done_upto = sent
                    while done_upto < len(infos) and \
                            infos[done_upto].offset + len(infos[done_upto].text) <= len(shown):
                        done_upto += 1
                    piece = _chunk(piece, infos[sent:done_upto])
                    sent = done_upto
                yield piece
        text = visible_text(self.tokenizer, tokens, stops)
        kept = None
        if pieces is not None:  # the tokens of the text: none past a stop string
            kept = [info for info in infos if info.offset < len(text)]
        if len(text) > len(shown) and text.startswith(shown):
            yield text[len(shown):] if kept is None else _chunk(text[len(shown):], kept[sent:])
        elif kept is not None and len(kept) > sent:
            yield _chunk("", kept[sent:])
        return GenerationResult(text=text, token_ids=tokens, stats=stats, logprobs=kept)

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig = GenerationConfig(),
                 chat: bool = False) -> GenerationResult:
        ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        gen = self.stream(ids, config)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return done.value


def drafts_shape_text(config: DecodeConfig) -> bool:
    """Whether a generation's text depends on which tokens were drafted, not only on its
    seed: greedy decoding under a rule that can relax (NSD, typical, the engines' rules). A greedy
    exact run emits the target's argmax whatever was drafted."""
    return config.sampling.greedy and method_name(config) in RELAXED_METHODS


def _nonempty(ids: list[int]) -> list[int]:
    # Decided on the tokens, not the text: whitespace is tokens, and a chat template's
    # markup is too, around empty messages.
    if not ids:
        raise NSDError("the prompt is empty")
    return ids


def _chunk(text: str, infos: list[TokenInfo]) -> TextChunk:
    chunk = TextChunk(text)
    chunk.logprobs = infos
    return chunk


class _TokenText:
    """Each generated token's piece of the text and its offset, found incrementally: the
    text of the tokens since the last point where it ended on a whole character (one token
    earlier for context, since a tokenizer may render a slice's first token differently)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.anchor = 0  # tokens before it render to exactly `anchor_len` characters
        self.anchor_len = 0
        self.end = 0  # text length after the last token

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, logprobs: Sequence[TokenLogprob]) -> list[TokenInfo]:
        out = []
        for lp in logprobs:
            self.tokens.append(lp.token)
            lo = max(0, self.anchor - 1)
            before = len(self._decode(self.tokens[lo:self.anchor]))
            text = self._decode(self.tokens[lo:])
            whole = text.rstrip("\ufffd")
            # text[before:] is the output from character anchor_len on.
            start, end = self.end, max(self.end, self.anchor_len + len(whole) - before)
            piece = text[before + start - self.anchor_len:before + end - self.anchor_len]
            self.end = end
            if len(whole) == len(text):  # ends on a whole character: move the anchor
                self.anchor, self.anchor_len = len(self.tokens), self.end
            top = tuple((t, self._decode([t]), v) for t, v in lp.top)
            out.append(TokenInfo(lp.token, piece, start, lp.logprob, top))
        return out


def _check_same_tokenizer(target_tok, draft_tok, target: str, draft: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise NSDError(f"draft {draft} and target {target} use different tokenizers; speculative "
                       "decoding needs a draft that shares the target's vocabulary")
