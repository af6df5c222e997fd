"""Choosing the draft length from measured step costs: the policy behind ``-k auto``.

Speculation pays only when what a block is expected to yield outweighs what it costs.
With per-position conditional acceptance ``α_i`` (the chance draft ``i`` is accepted given
that draft ``i − 1`` was), a block of ``k`` drafts yields

    E_k = 1 + Σ_{i=1..k} Π_{j≤i} α_j        tokens (the accepted run plus one more)

and costs ``k·c_d + c_t(k + 1) + o``: ``c_t(n)`` is one target forward over ``n`` new
tokens, ``c_d`` one draft token and ``o`` nsd's own work per speculative pass. A plain
step (``k = 0``) yields one token for ``c_t(1)``. Before every block :class:`CostModelK`
picks the ``k`` with the highest ``E_k / cost_k``, so a speculative run falls back to
plain decoding wherever no ``k`` pays.

The costs come from a calibration (:mod:`nsd.draftlen.calibrate`, measured once per machine, file
and thread count, and stored). Acceptance is tracked online per position, within one
generation. The policy never reads the clock: its choices are a function of the stored
calibration, the seed (its Thompson draws) and the acceptance seen so far in this
generation. So a seeded generation is reproducible on the same machine however busy the
machine is. (An earlier version rescaled the costs from live pass timings; under load
that changed the chosen ``k`` and with it every random draw after, so ``--seed`` did not
reproduce a sampled generation.)

Every policy here is a :class:`KPolicy`: ``plan(...)`` (or ``next_k``) before a block and
``observe(...)`` after it; the decoding loop knows nothing else about them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Hashable, Protocol, Sequence

from nsd.errors import NSDError


@dataclass(frozen=True)
class Member:
    """What a batch's plan needs of one member: its acceptance estimate per draft position,
    the most drafts it can take now (``k_max``, and its remaining tokens), and what its
    draft's catching up costs per expected token (a new request's draft has not read the
    prompt; spread over the tokens still to generate, as :class:`CostModelK` does)."""

    alpha: tuple[float, ...]
    cap: int
    surcharge: float = 0.0


class BatchPlan(Protocol):
    """The draft lengths chosen for a server's whole batch, as :class:`CostModelK` uses
    them (:class:`nsd.draftlen.batchplan.JointPlanner`, which builds on this module)."""

    def join(self, key: Hashable, member: Member) -> None: ...

    def assign(self, key: Hashable, member: Member) -> int | None: ...

    def leave(self, key: Hashable) -> None: ...


class KPolicy(Protocol):
    """How many tokens to draft before each target pass: the whole interface the decoding
    loop uses. A policy subclasses it and overrides what it does; :meth:`plan` defaults to
    :meth:`next_k` with the choice of proposer left to the proposer."""

    def begin(self, prompt_tokens: int) -> None:
        """A generation starts after a prompt of this many tokens."""

    def next_k(self, remaining: int) -> int:
        """Draft length for the next block (0 = a plain autoregressive step)."""
        ...

    def plan(self, remaining: int, free: int, match: int) -> tuple[int, bool | None]:
        """The next block: ``(k, from_lookup)``, ``free`` tokens being available from
        prompt lookup after a matched n-gram of ``match`` tokens. ``from_lookup`` None: this
        policy does not price lookup, the proposer's own rule decides
        (:meth:`nsd.proposers.base.Proposer.fixed_k_lookup`)."""
        return self.next_k(remaining), None

    def observe(self, k: int, drafted: int, accepted: int, propose_s: float, target_s: float,
                overhead_s: float) -> None:
        """What the block asked for (``k``), drafted, accepted and cost."""

    @property
    def predicted_tokens_per_s(self) -> float | None:
        """What the policy expected of its blocks, in tokens per second (None: no model)."""
        return None


@dataclass
class FixedK(KPolicy):
    """The same ``k`` every block."""

    k: int

    def next_k(self, remaining: int) -> int:
        return self.k


@dataclass
class AdaptiveK(KPolicy):
    """Grow k after a fully accepted block, shrink it after a rejection (HF's heuristic)."""

    k: int
    k_max: int
    k_min: int = 1

    def next_k(self, remaining: int) -> int:
        return self.k

    def observe(self, k: int, drafted: int, accepted: int, propose_s: float, target_s: float,
                overhead_s: float) -> None:
        if drafted and accepted == drafted:
            self.k = min(self.k + 2, self.k_max)
        elif drafted:
            self.k = max(self.k - 1, self.k_min)


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds per forward: ``target[n − 1]`` for ``n`` new target tokens, and
    ``draft`` per drafted token (about 0 for n-gram lookup)."""

    target: tuple[float, ...]
    draft: float = 0.0

    def __post_init__(self) -> None:
        if not self.target or any(not (c > 0 and math.isfinite(c)) for c in self.target):
            raise NSDError(f"step costs must be positive and finite, got {self.target}")
        if not (self.draft >= 0 and math.isfinite(self.draft)):
            raise NSDError(f"draft cost must be >= 0, got {self.draft}")

    def target_cost(self, n: int) -> float:
        """Cost of a forward over ``n >= 1`` tokens; linear beyond the measured range."""
        table = self.target
        if n <= len(table):
            return table[n - 1]
        slope = max(table[-1] - table[-2], 0.0) if len(table) > 1 else table[-1]
        return table[-1] + slope * (n - len(table))


def marginal_costs(table: Sequence[float], others: int) -> tuple[float, ...]:
    """What ``n = 1..len(table)`` more tokens add to a forward already carrying ``others``
    tokens of other sequences: ``c(others + n) − c(others)``, ``table[n − 1]`` being ``c(n)``.

    A server batching several requests' forwards pays one forward for all of them, so a
    request's block costs what its tokens add, not a forward of its own: on a CPU, where a
    forward of a few dozen tokens already costs about linearly in them, a drafted token
    costs nearly what a plain step's does, and speculation rarely pays in a full batch.
    Past the measured range ``c`` grows linearly, by the mean slope of the table's upper
    half; increments are kept positive (timing noise can make the table dip)."""
    if others <= 0:
        return tuple(table)
    n_max = len(table)
    half = n_max // 2
    slope = (table[-1] - table[half - 1]) / (n_max - half) if n_max > 1 else table[0]
    slope = max(slope, 0.02 * table[0])

    def c(n: int) -> float:
        return table[n - 1] if n <= n_max else table[-1] + slope * (n - n_max)

    base = c(others)
    out, last = [], 0.0
    for n in range(1, n_max + 1):
        last = max(c(others + n) - base, last + 0.02 * table[0])
        out.append(last)
    return tuple(out)


def expected_tokens(alpha: Sequence[float], k: int) -> float:
    """``E_k = 1 + Σ_{i≤k} Π_{j≤i} α_j``: tokens one block of ``k`` drafts yields on average."""
    total, run = 1.0, 1.0
    for a in alpha[:k]:
        run *= a
        total += run
    return total


def best_k(costs: StepCosts, alpha: Sequence[float], k_max: int, overhead_s: float = 0.0,
           k_min: int = 0, surcharge_per_token: float = 0.0) -> tuple[int, float, float]:
    """The ``k`` in ``[k_min, k_max]`` maximising expected tokens per second.

    ``surcharge_per_token`` is added per expected token of a drafted block (the draft's
    catch-up, amortised). Returns ``(k, expected tokens, expected seconds)``.
    """
    best = (0, 1.0, costs.target_cost(1))
    best_rate = -1.0
    for k in range(k_min, k_max + 1):
        if k == 0:
            tokens, seconds = 1.0, costs.target_cost(1)
        else:
            tokens = expected_tokens(alpha, k)
            seconds = (k * costs.draft + costs.target_cost(k + 1) + overhead_s
                       + surcharge_per_token * tokens)
        rate = tokens / seconds
        if rate > best_rate:
            best, best_rate = (k, tokens, seconds), rate
    return best


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance ``α_i``, estimated online with forgetting.

    Counts decay by ``decay`` per block, so the estimate follows a changing text (prose
    after code). Position ``i`` borrows ``weight`` pseudo-counts from position ``i − 1``'s
    estimate (position 1 from ``prior``): deep positions, rarely reached, start from what
    the shallower ones show instead of from nothing.
    """

    k_max: int
    prior: float = 0.6
    weight: float = 2.0
    decay: float = 0.97
    accepts: list[float] = field(default_factory=list)
    attempts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepts = self.accepts or [0.0] * self.k_max
        self.attempts = self.attempts or [0.0] * self.k_max

    def rates(self) -> list[float]:
        out, previous = [], self.prior
        for acc, att in zip(self.accepts, self.attempts):
            previous = (acc + self.weight * previous) / (att + self.weight)
            out.append(previous)
        return out

    def sample(self, rng: random.Random) -> list[float]:
        """One draw of ``α_1..α_k`` from the Beta posteriors (Thompson sampling): a
        decision made on a draw rather than the mean keeps trying what might pay, in
        proportion to how unsure the estimate still is."""
        out, previous = [], self.prior
        for acc, att in zip(self.accepts, self.attempts):
            a = acc + self.weight * previous
            b = (att - acc) + self.weight * (1.0 - previous)
            out.append(rng.betavariate(max(a, 1e-3), max(b, 1e-3)))
            previous = a / (a + b)
        return out

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.accepts = [a * self.decay for a in self.accepts]
        self.attempts = [a * self.decay for a in self.attempts]
        reached = min(accepted + 1, drafted, self.k_max)  # positions whose test was run
        for i in range(reached):
            self.attempts[i] += 1.0
        for i in range(min(accepted, self.k_max)):
            self.accepts[i] += 1.0

    def copy(self) -> AcceptanceTracker:
        return AcceptanceTracker(self.k_max, self.prior, self.weight, self.decay,
                                 list(self.accepts), list(self.attempts))


@dataclass
class CostModelK(KPolicy):
    """``-k auto``: the ``k`` (0 included) that maximises expected tokens per second.

    ``costs`` come from the stored calibration and stay fixed for the generation; the
    reported time split (propose, target, overhead) is measured, but never fed back into
    the choice, so the choices do not depend on how busy the machine is. Each choice is
    made on a draw from the acceptance posterior (Thompson sampling, a generator seeded
    from the generation's seed), so an unlucky start does not lock speculation out. After
    ``probe_every`` plain steps in a row one block is drafted anyway, so a text that
    becomes predictable again is noticed; each probe with a rejected draft doubles the wait
    (up to ``probe_max``), so probing costs little where speculation never pays, while a
    probe whose drafts were all accepted is followed by another after ``probe_after_hit``
    plain steps, so a prior that undersells the drafts is corrected within a few blocks.
    """

    costs: StepCosts
    tracker: AcceptanceTracker
    k_max: int
    probe_every: int = 16
    probe_max: int = 1024
    # A prior of 0.6 needs about four fully accepted probes before a CPU whose c_t(2) is
    # ~2 c_t(1) (AMX) drafts on its own; with waits that double regardless, those came
    # after 16 + 32 + 64 plain steps, past the end of most answers (NSD θ 0.9, accepting
    # ~0.95 per draft, took plain steps in 89 % of its passes on HumanEval).
    probe_after_hit: int = 4
    # How much faster than a plain step a block of always-accepted drafts must be before
    # any block is drafted on a guess (see plan()).
    probe_margin: float = 0.1
    overhead_s: float = 0.0  # nsd's own work per speculative pass, if known
    chosen: list[int] = field(default_factory=list)
    predicted_tokens: float = 0.0
    predicted_s: float = 0.0
    seed: int = 0
    # With a second, free proposer (prompt lookup beside the draft model): its own
    # acceptance estimate. Its blocks cost no draft steps; see :meth:`plan`. A copy after a
    # long matched n-gram is far likelier to be right than one after a single matched
    # token, so each match length learns its own estimate (copies of the template below).
    lookup_tracker: AcceptanceTracker | None = None
    lookup_trackers: dict[int, AcceptanceTracker] = field(default_factory=dict)
    # The starting estimate of lookups after an m-token match (None: the template's prior);
    # see :mod:`nsd.draftlen.priors`.
    lookup_prior: Callable[[int], float] | None = None
    # A draft that sat out plain steps must first read what it missed: ``catchup`` times
    # its step cost per missed token (a batched forward costs far less per token than a
    # single step: a 95-token prefill of the 1.5B took ~0.3 steps per token on 2 cores).
    catchup: float = 0.3
    _behind: int = 0
    _plain_run: int = 0
    _probe_wait: int = 0
    _last_lookup: int = 0  # the match length of the last block if lookup drafted it
    _probing: bool = False
    # In a server's batch: the costs of a block given the other requests' tokens in the
    # forwards it joins (see :func:`marginal_costs`), asked before every choice.
    reprice: Callable[[], StepCosts] | None = None
    # In a server's batch: the draft lengths the batch chose together, where it chose to
    # draft (a :class:`nsd.draftlen.batchplan.JointPlanner`; None: each request decides alone).
    joint: BatchPlan | None = None

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise NSDError(f"k_max must be >= 1, got {self.k_max}")
        self._probe_wait = self.probe_every
        self._draft_step = self.costs.draft  # before any repricing for a batch
        # The first block is a probe: a generation starts from the prior, and on a CPU where
        # only confident acceptance pays, the prior alone would choose plain steps until
        # the first scheduled probe (16 plain steps of a short answer).
        self._plain_run = self._probe_wait
        self._rng = random.Random(self.seed)

    def begin(self, prompt_tokens: int) -> None:
        self._behind = prompt_tokens  # the draft has seen nothing of this context yet

    def next_k(self, remaining: int) -> int:
        return self.plan(remaining, 0)[0]

    def plan(self, remaining: int, free: int, match: int = 1) -> tuple[int, bool]:
        """The next block: ``(k, from_lookup)``. ``free`` tokens can be proposed at no
        draft cost by prompt lookup, after a matched n-gram of ``match`` tokens; a lookup
        block of ``j ≤ free`` tokens costs only ``c_t(j + 1)`` and is priced with the
        acceptance estimate of lookups after matches of that length. The cheaper proposer
        wins the block on expected tokens per second."""
        k_cap = max(0, min(self.k_max, remaining - 1))
        if self.reprice is not None:
            self.costs = self.reprice()
        if self.joint is not None:
            # In a server's batch the first token comes from a plain step: a drafted first
            # block (a lone request's probe) waits k rounds, each as long as the prompt
            # prefills of the requests arriving beside it, for its first token.
            first = not self.chosen
            assigned = self.joint.assign(id(self), self._member(0 if first else k_cap,
                                                                self._behind, remaining))
            if first:
                assigned = 0
            if assigned is not None:
                return self._joint_block(min(assigned, k_cap), min(free, k_cap), match)
        # Catching the draft up is paid once and then serves every later block, so it is
        # spread over the tokens still to generate.
        surcharge = self._behind * self.catchup * self.costs.draft / max(remaining, 1)

        def pick(alpha: Sequence[float], k_min: int = 0) -> tuple[int, float, float]:
            return best_k(self.costs, alpha, k_cap, self.overhead_s, k_min=k_min,
                          surcharge_per_token=surcharge)

        # Where even drafts that are always accepted cannot beat a plain step by
        # probe_margin at today's costs, decode plainly and make no probe: a probe's best
        # case must also cover what this model does not price. The catch-up is spread over
        # the tokens up to max_new_tokens, but answers often stop long before (HumanEval:
        # a median 36 of 128), and the first probe pays the draft's whole prompt. With
        # ggml's own kernels on Zen 4 the best case was 3 % ahead; probing there anyway
        # ran SD at 0.81x AR, the draft's prompt prefills making the difference.
        k_best, best_tokens, best_seconds = pick([1.0] * k_cap)
        hopeless = k_best == 0 or (best_tokens / best_seconds
                                   < (1.0 + self.probe_margin) / self.costs.target_cost(1))
        alpha = self.tracker.sample(self._rng)
        # A draw may choose a block only where the posterior mean would too (it then tunes
        # k, or falls back to a plain step). Letting a draw speculate where the mean would
        # not explored without limit: on a wide posterior that plain steps never narrow,
        # ~10% of passes drafted blocks that lost (SD at T = 0.8 ran at 0.94× AR while
        # plain in 90% of its passes). Exploring is the scheduled probes' job, with backoff.
        choice = pick(self.tracker.rates())
        if choice[0] > 0:
            choice = pick(alpha)
        lookup = self._lookup_choice(min(free, k_cap), match)
        if lookup is not None and lookup[1] / lookup[2] > choice[1] / choice[2]:
            return self._take_lookup(lookup, match)
        self._last_lookup = 0
        self._probing = False
        if choice[0] > 0:
            self._probe_wait = self.probe_every  # speculation pays again: probe eagerly later
        elif not hopeless and self._plain_run >= self._probe_wait and k_cap > 0:
            choice = pick(alpha, k_min=1)
            self._probing = True
            self._probe_wait = min(2 * self._probe_wait, self.probe_max)
        self._plain_run = self._plain_run + 1 if choice[0] == 0 else 0
        k = choice[0]
        self.chosen.append(k)
        # The prediction reported uses the posterior mean, not the draw the choice used.
        self.predicted_tokens += expected_tokens(self.tracker.rates(), k)
        self.predicted_s += choice[2]
        return k, False

    def _take_lookup(self, lookup: tuple[int, float, float], match: int) -> tuple[int, bool]:
        k, _, seconds = lookup
        self._last_lookup = match
        self._plain_run = 0
        self.chosen.append(k)
        self.predicted_tokens += expected_tokens(self._lookup(match).rates(), k)
        self.predicted_s += seconds
        return k, True

    def _joint_block(self, k: int, free: int, match: int) -> tuple[int, bool]:
        """The block the batch's plan gave this request (see :mod:`nsd.draftlen.batchplan`): ``k``
        drafts, or with ``k = 0`` a plain step, or a lookup block where one beats it (it
        costs no draft rounds, and its target forward runs beside the others' anyway)."""
        if k == 0:
            lookup = self._lookup_choice(free, match)
            if lookup is not None:
                return self._take_lookup(lookup, match)
        self._last_lookup = 0
        self._probing = False
        self._plain_run = 0 if k else self._plain_run + 1
        self.chosen.append(k)
        self.predicted_tokens += expected_tokens(self.tracker.rates(), k)
        self.predicted_s += k * self.costs.draft + self.costs.target_cost(k + 1)
        return k, False

    def join(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Enter the batch's plan, before the prompt's forward (:mod:`nsd.draftlen.batchplan`)."""
        if self.joint is not None:  # (its first block will be a plain step: no drafts)
            self.joint.join(id(self), self._member(0, prompt_tokens, max_new_tokens))

    def _member(self, cap: int, behind: int, remaining: int) -> Member:
        # The catch-up is priced at the draft's own step cost: in a batch ``costs`` hold
        # what a step adds to the shared forward, but a prompt's catch-up is mostly its own.
        surcharge = behind * self.catchup * self._draft_step / max(remaining, 1)
        return Member(tuple(self.tracker.rates()), cap, surcharge)

    def end(self) -> None:
        """The generation is over: it leaves the batch's plan."""
        if self.joint is not None:
            self.joint.leave(id(self))

    def _lookup(self, match: int) -> AcceptanceTracker:
        tracker = self.lookup_trackers.get(match)
        if tracker is None:
            assert self.lookup_tracker is not None
            tracker = self.lookup_trackers[match] = self.lookup_tracker.copy()
            if self.lookup_prior is not None:
                tracker.prior = self.lookup_prior(match)
        return tracker

    def _lookup_choice(self, free: int, match: int) -> tuple[int, float, float] | None:
        """The best lookup block of at most ``free`` tokens as (j, tokens, seconds), or
        None where no lookup block beats a plain step on the posterior mean (as for the
        draft model: a draw only tunes the length, it never explores on its own)."""
        if self.lookup_tracker is None or free < 1:
            return None
        tracker = self._lookup(match)

        def pick(alpha: Sequence[float]) -> tuple[int, float, float]:
            best = (0, 1.0, self.costs.target_cost(1))
            for j in range(1, free + 1):
                tokens = expected_tokens(alpha, j)
                seconds = self.costs.target_cost(j + 1) + self.overhead_s
                if tokens / seconds > best[1] / best[2]:
                    best = (j, tokens, seconds)
            return best

        if pick(tracker.rates())[0] == 0:
            return None
        best = pick(tracker.sample(self._rng))
        return best if best[0] > 0 else None

    def observe(self, k: int, drafted: int, accepted: int, propose_s: float, target_s: float,
                overhead_s: float) -> None:
        # The timings are deliberately ignored (see the module docstring): only what was
        # drafted and accepted moves the policy.
        # After a drafted block the draft lags by the token the target added; after a
        # plain step by one more.
        if self._last_lookup:
            # The draft model saw none of this block: it falls further behind.
            self._behind += accepted + 1
            if drafted > 0:
                self._lookup(self._last_lookup).update(drafted, accepted)
            return
        self._behind = 1 if drafted > 0 else self._behind + 1
        if drafted > 0:
            self.tracker.update(drafted, accepted)
            if self._probing and accepted >= drafted:  # evidence for speculation: look again soon
                self._probe_wait = min(self._probe_wait, self.probe_after_hit)

    @property
    def predicted_tokens_per_s(self) -> float:
        """What the model expected of the blocks it chose (compare with the measured rate)."""
        return self.predicted_tokens / self.predicted_s if self.predicted_s > 0 else 0.0
