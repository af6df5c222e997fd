"""Draft lengths chosen for a server's whole batch at once.

In a batch (:mod:`nsd.backends.sequences`) the requests' forwards meet in *rounds*: every
round runs one forward per model over whatever the members handed in. A request that
drafts ``k`` tokens spends ``k`` rounds in the draft's forwards and one in the target's,
so alone among plain-stepping requests its block costs what its tokens add to forwards
that run anyway (:func:`nsd.draftlen.costmodel.marginal_costs`), and on a CPU that rarely pays. But
when *every* request drafts the same ``k`` at the same time, the ``k`` drafting rounds run
no target forward at all: the batch pays ``k`` draft forwards and one target forward over
all the blocks, instead of ``k + 1`` target forwards. Where a target forward costs nearly
the same for 4 tokens as for 20 (memory-bound weights, AMX), that is the speedup one
request gets from speculation, for the whole batch. No request can find it alone.

:func:`plan_batch` prices each such *cycle*: ``k`` drafts for the ``m`` members likeliest
to have them accepted, plain steps for the rest, against everyone stepping plainly, from
the models' measured costs (:class:`BatchCosts`) and each member's acceptance estimate.
:class:`JointPlanner` makes the choice at each cycle's start and keeps the members in step:
a drafting member that plans in the middle of a cycle (after a lookup block) drafts only
as far as the cycle's verification round, so the verifications keep meeting
in one forward. Where the plan is to step plainly, each member's own policy decides as it
would alone if it is alone in the batch; beside others it steps plainly or copies a
prompt-lookup block (which costs no draft round), since a block of its own cannot pay.
A request's first block in a batch is always a plain step (see
:meth:`nsd.draftlen.costmodel.CostModelK.plan`), so its first token never waits on draft rounds.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from nsd.draftlen.costmodel import Member, expected_tokens
from nsd.errors import NSDError


def _bracket(xs: Sequence[int], x: float) -> tuple[int, int, float]:
    """Indexes of the two grid points to interpolate ``x`` between (the last or first two
    beyond the grid, extrapolating) and the weight of the second."""
    if len(xs) == 1:
        return 0, 0, 0.0
    hi = next((i for i, v in enumerate(xs) if v >= x), len(xs) - 1)
    hi = max(hi, 1)
    lo = hi - 1
    return lo, hi, (x - xs[lo]) / (xs[hi] - xs[lo])


@dataclass(frozen=True)
class BatchCosts:
    """Seconds of one batched forward of ``s`` sequences carrying ``n`` tokens together,
    from a measured grid: ``seconds[i][j]`` for ``seqs[i]`` sequences of ``widths[j]``
    tokens each (:func:`nsd.draftlen.calibrate.measure_batched`). Between grid points it is
    interpolated (bilinearly in sequences and tokens per sequence), beyond them
    extrapolated along the last two."""

    seqs: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for name, xs in (("sequences", self.seqs), ("widths", self.widths)):
            if not xs or list(xs) != sorted(set(xs)) or xs[0] < 1:
                raise NSDError(f"batch costs need increasing {name} from 1 up, got {xs}")
        if len(self.seconds) != len(self.seqs) or any(len(r) != len(self.widths) for r in self.seconds):
            raise NSDError("batch costs: the grid does not match its sequences and widths")
        if any(not c > 0 for row in self.seconds for c in row):
            raise NSDError("batch costs must be positive")
        # A plan prices a hundred-odd forwards before every round of a full batch, over
        # a few hundred distinct shapes in a server's life: remembered, not recomputed.
        object.__setattr__(self, "_memo", {})

    def __call__(self, s: int, n: int) -> float:
        memo = self._memo  # type: ignore[attr-defined]
        value = memo.get((s, n))
        if value is None:
            value = memo[(s, n)] = self._interpolate(s, n)
        return value

    @classmethod
    def single(cls, table: Sequence[float]) -> BatchCosts:
        """One sequence's ``c(1..n)`` (a batch of one request)."""
        return cls((1,), tuple(range(1, len(table) + 1)), (tuple(table),))

    def _interpolate(self, s: int, n: int) -> float:
        if s <= 0 or n <= 0:
            return 0.0
        i0, i1, u = _bracket(self.seqs, s)
        j0, j1, v = _bracket(self.widths, n / s)
        g = self.seconds
        value = ((1 - u) * ((1 - v) * g[i0][j0] + v * g[i0][j1])
                 + u * ((1 - v) * g[i1][j0] + v * g[i1][j1]))
        return max(value, 0.1 * g[0][0])  # far extrapolation must not price a forward at 0


@dataclass(frozen=True)
class BatchChoice:
    k: int  # drafts per drafting member this cycle (0: every member steps plainly)
    drafters: tuple[int, ...]  # indexes of the members that draft
    tokens: float  # expected tokens of the cycle, all members together
    seconds: float  # its expected duration
    plain_rate: float  # expected tokens/s of the batch stepping plainly

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def plan_batch(members: Sequence[Member], plain_others: int, target: Callable[[int, int], float],
               draft: Callable[[int, int], float], k_max: int,
               pass_cost: Callable[[int], float] = lambda rows: 0.0,
               draft_token: float = 0.0) -> BatchChoice:
    """The cycle maximising the batch's expected tokens per second.

    A cycle with ``k ≥ 1``: the ``m`` drafting members (the ``m`` with the highest expected
    block yield among those that can take ``k`` drafts) run ``k`` draft rounds, each a draft
    forward over their sequences beside the plain steppers' target forward, if any; then
    one round verifies every block and the plain steppers' step in one target forward.
    The first draft round feeds each drafter two tokens (the last draft, never fed, and the
    target's token after it: the steady state of accepted blocks), the others one.
    ``plain_others`` members step plainly whatever is chosen (requests without ``-k auto``).
    ``target(s, n)``/``draft(s, n)``: seconds of one forward of ``s`` sequences carrying
    ``n`` tokens; ``pass_cost(rows)`` and ``draft_token``: nsd's own work per verified pass
    and per drafted token, summed over the members; each drafter's catch-up surcharge is
    added per expected token.
    """
    n_all = len(members) + plain_others
    if n_all == 0:
        return BatchChoice(0, (), 0.0, 1.0, 0.0)
    plain_s = target(n_all, n_all) + n_all * pass_cost(1)
    best = BatchChoice(0, (), float(n_all), plain_s, n_all / plain_s)
    for k in range(1, k_max + 1):
        able = [i for i, m in enumerate(members) if m.cap >= k]
        yields = sorted(((expected_tokens(members[i].alpha, k), i) for i in able), reverse=True)
        gained = catchup = 0.0
        for m, (tokens, index) in enumerate(yields, start=1):
            gained += tokens
            catchup += members[index].surcharge * tokens
            plain = n_all - m
            side = target(plain, plain) + plain * pass_cost(1) if plain else 0.0
            seconds = (draft(m, 2 * m) + (k - 1) * draft(m, m) + k * (m * draft_token + side)
                       + target(n_all, m * (k + 1) + plain) + m * pass_cost(k + 1)
                       + plain * pass_cost(1) + catchup)
            total = gained + plain * (k + 1)
            if total / seconds > best.rate:
                best = BatchChoice(k, tuple(i for _, i in yields[:m]), total, seconds, best.plain_rate)
    return best


class JointPlanner:
    """The slots' shared choice of draft lengths (see the module docstring).

    ``rounds()`` (see :meth:`bind`) is how many rounds the batch has run; ``members()``
    how many requests are in it (those that do not plan here step plainly in the plan).
    The members' policies call :meth:`assign` before each block and :meth:`leave` when
    their generation ends.
    """

    def __init__(self, target: Callable[[int, int], float], draft: Callable[[int, int], float],
                 k_max: int) -> None:
        self._rounds: Callable[[], int] = lambda: 0
        self._members: Callable[[], int] = lambda: 0
        self._price: dict = dict(target=target, draft=draft, k_max=k_max)
        self._lock = threading.Lock()
        # Members that left, removed at the next plan: leave() takes no lock, because it
        # may run from a generator's finaliser, on any thread, even one inside assign().
        self._left: collections.deque[Hashable] = collections.deque()
        self._state: dict[Hashable, Member] = {}
        self._seen: dict[Hashable, int] = {}  # the round each member last planned or joined
        self._verify_round = 0  # the round that verifies this cycle's blocks
        self._k = 0
        self._drafters: frozenset[Hashable] = frozenset()
        self.cycles = [0, 0]  # cycles decided: [stepping plainly, drafting]
        self.last: BatchChoice | None = None

    @property
    def costs(self) -> tuple[Callable[[int, int], float], Callable[[int, int], float]]:
        """The target's and the draft's forward costs the plan is priced with."""
        return self._price["target"], self._price["draft"]

    def bind(self, rounds: Callable[[], int], members: Callable[[], int]) -> None:
        self._rounds, self._members = rounds, members

    def set_host(self, pass_cost: Callable[[int], float], draft_token: float) -> None:
        """nsd's own work per pass and per drafted token (:mod:`nsd.draftlen.host_costs`). It
        depends on a request's sampling settings; the batch is priced with the latest
        request's, a small term beside the forwards."""
        with self._lock:
            self._price.update(pass_cost=pass_cost, draft_token=draft_token)

    def join(self, key: Hashable, member: Member) -> None:
        """A generation that will plan here starts (before its prompt's forward, so the
        first cycle after the prompts is planned with every member known)."""
        with self._lock:
            self._drain()
            self._state[key] = member
            self._seen[key] = self._rounds()

    def assign(self, key: Hashable, member: Member) -> int | None:
        """The drafts member ``key`` takes now: ``k ≥ 1`` drafts by the draft model, whose
        verification then lands in the cycle's verification round; 0, a plain step (or a
        block that costs no draft rounds); None where the member is alone in the batch and
        decides as a lone request does (no cycle is planned then).

        Every member plans between the same two rounds (a round runs only once every member
        has handed in a forward), so the first to plan after a cycle ends decides the next
        one for all. The others' estimates may not yet include their last block."""
        if self._members() <= 1:
            return None  # alone in the batch: nothing to plan together
        with self._lock:
            self._drain()
            now = self._rounds()  # this member's next forward runs in round now + 1
            self._state[key] = member
            self._seen[key] = now
            if now + 1 > self._verify_round:
                # A member plans at least every k_max + 1 rounds; one silent for longer
                # ended without leaving (a generation closed before it started).
                for gone in [k for k, seen in self._seen.items()
                             if now - seen > self._price["k_max"] + 2]:
                    self._remove(gone)
                keys, members = zip(*self._state.items())
                others = max(self._members() - len(keys), 0)
                choice = plan_batch(members, others, **self._price)
                self.last = choice
                self.cycles[choice.k > 0] += 1
                self._k = choice.k
                self._drafters = frozenset(keys[i] for i in choice.drafters)
                self._verify_round = now + 1 + choice.k
            # Plain steps for the batch: beside others a block of one's own cannot pay (see
            # the module docstring), and a probe's draft rounds would each wait for the
            # whole batch's forwards. A member steps plainly, or copies a lookup block,
            # which costs no draft round. So does one that joined after the cycle was
            # planned: its draft may not have read its prompt, a catch-up the plan did not
            # price; the next cycle includes it.
            if self._k == 0 or key not in self._drafters:
                return 0
            return self._verify_round - now - 1

    def leave(self, key: Hashable) -> None:
        self._left.append(key)

    def active(self) -> list[Hashable]:
        """The members in the plan now."""
        with self._lock:
            self._drain()
            return list(self._state)

    def _drain(self) -> None:
        while self._left:
            self._remove(self._left.popleft())

    def _remove(self, key: Hashable) -> None:
        self._state.pop(key, None)
        self._seen.pop(key, None)
