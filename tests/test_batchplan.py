"""Draft lengths chosen for a whole batch (nsd.batchplan): the pricing of a cycle, the
planner that keeps the members in step, and a batched engine drafting in step."""

from __future__ import annotations

import threading

import pytest

from mock import CharTokenizer, MockLM
from nsd.api import Engine, GenerationConfig
from nsd.batchplan import BatchCosts, JointPlanner, plan_batch
from nsd.calibrate import Calibration
from nsd.costmodel import Member, StepCosts, best_k, expected_tokens
from nsd.errors import NSDError
from nsd.host_costs import HostCosts


def test_batch_costs_interpolate_and_extend_along_the_last_slope() -> None:
    one = BatchCosts.single((1.0, 1.5, 1.7))
    assert one(1, 1) == 1.0 and one(1, 3) == 1.7
    assert one(1, 5) == pytest.approx(2.1)  # 0.2 per token past 3
    assert one(0, 0) == 0.0
    grid = BatchCosts((1, 4), (1, 3), ((1.0, 2.0), (2.0, 5.0)))
    assert grid(4, 12) == 5.0
    assert grid(4, 8) == pytest.approx(3.5)  # four sequences of two tokens: between widths
    assert grid(2, 2) == pytest.approx(1 + 1 / 3)  # two of one token: between sequences
    assert grid(8, 8) == pytest.approx(3.0 + 1 / 3)  # past the last row, along its slope
    for bad in (((0, 1), (1,), ((1.0,), (1.0,))), ((1, 1), (1,), ((1.0,), (1.0,))),
                ((1,), (1,), ((0.0,),)), ((1,), (1, 2), ((1.0,),))):
        with pytest.raises(NSDError):
            BatchCosts(*bad)


def test_one_member_plans_as_a_request_alone() -> None:
    """A batch of one is one request: the same k as the single-request cost model, at the
    same expected rate, for tables where drafting pays a little, a lot, or not at all."""
    alpha = (0.9, 0.85, 0.8, 0.75, 0.7, 0.6)
    for table, draft in (((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6), 0.2),
                         ((1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12), 0.05),
                         ((1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0), 0.3)):
        k, tokens, seconds = best_k(StepCosts(table, draft), alpha, 6)
        choice = plan_batch([Member(alpha, 6)], 0, BatchCosts.single(table),
                            lambda s, n, d=draft: d * s, 6)
        assert choice.k == k
        assert choice.rate == pytest.approx(tokens / seconds)


def _memory_bound(s: int, n: int) -> float:
    return 1.0 + 0.005 * n  # a forward costs about the same at any width


def test_memory_bound_batch_drafts_together_even_its_weakest_member() -> None:
    """Forwards costing about the same whatever their width: drafting in step pays, and a
    member whose drafts are never accepted drafts too, because stepping plainly beside the
    others would put a target forward into every drafting round."""
    members = [Member((0.95,) * 4, 4)] * 3 + [Member((0.0,) * 4, 4)]
    choice = plan_batch(members, 0, _memory_bound, lambda s, n: 0.05, 4)
    assert choice.k == 4 and sorted(choice.drafters) == [0, 1, 2, 3]
    assert choice.drafters[-1] == 3  # ranked last by its expected yield
    expected = 3 * expected_tokens((0.95,) * 4, 4) + 1.0
    assert choice.tokens == pytest.approx(expected)
    assert choice.seconds == pytest.approx(4 * 0.05 + _memory_bound(4, 20))
    assert choice.rate > 2 * choice.plain_rate


def test_compute_bound_batch_steps_plainly() -> None:
    """Forwards costing linearly in their tokens (a CPU past a few dozen): no cycle beats
    a plain step for everyone, however good the drafts."""
    choice = plan_batch([Member((0.99,) * 4, 4)] * 4, 0, lambda s, n: float(n),
                        lambda s, n: 0.3 * n, 4)
    assert choice.k == 0 and choice.drafters == ()
    assert choice.rate == pytest.approx(choice.plain_rate) == pytest.approx(1.0)


def test_draft_catch_up_and_sequence_count_are_priced() -> None:
    """The first draft round feeds each drafter two tokens; forwards are priced by their
    sequences and tokens together."""
    seen: list[tuple[str, int, int]] = []

    def target(s: int, n: int) -> float:
        seen.append(("t", s, n))
        return 1.0 + 0.01 * n

    def draft(s: int, n: int) -> float:
        seen.append(("d", s, n))
        return 0.05

    choice = plan_batch([Member((0.9,) * 2, 2)] * 3, 0, target, draft, 2)
    assert ("d", 3, 6) in seen and ("d", 3, 3) in seen  # k = 2: a catch-up round, then one
    assert ("t", 3, 9) in seen and ("t", 3, 3) in seen  # verifying 3 blocks; plain steps
    assert choice.k == 2
    # Drafts that must first read a long prompt, for a short answer, are not worth it: the
    # surcharge is paid per expected token of each drafter's block.
    behind = plan_batch([Member((0.9,) * 2, 2, surcharge=0.5)] * 3, 0, target, draft, 2)
    assert behind.k == 0
    some = plan_batch([Member((0.9,) * 2, 2, surcharge=0.01)] * 3, 0, target, draft, 2)
    tokens = 3 * expected_tokens((0.9,) * 2, some.k)
    assert some.k > 0 and some.seconds == pytest.approx(
        draft(3, 6) + (some.k - 1) * draft(3, 3) + target(3, 3 * (some.k + 1)) + 0.01 * tokens)


def test_members_near_their_end_and_requests_outside_the_plan_are_priced() -> None:
    target = lambda s, n: 1.0 + 0.002 * n  # noqa: E731
    members = [Member((0.9,) * 4, 4), Member((0.9,) * 4, 1)]
    choice = plan_batch(members, 0, target, lambda s, n: 0.01, 4)
    # Member 1 has room for one draft only: four drafts for member 0 would put member 1's
    # plain steps, target forwards, into every drafting round; one draft each is better.
    assert choice.k == 1 and sorted(choice.drafters) == [0, 1]
    four = 0.01 * 4 + 4 * target(1, 1) + target(2, 6)
    assert choice.rate > (expected_tokens((0.9,) * 4, 4) + 5) / four
    # A request outside the plan (AR) steps plainly in every round, so every drafting
    # round runs the target anyway: alone a request would draft, beside it none does.
    assert plan_batch(members[:1], 0, target, lambda s, n: 0.01, 4).k == 4
    with_ar = plan_batch(members[:1], 1, target, lambda s, n: 0.01, 4)
    assert with_ar.k == 0 and with_ar.rate == pytest.approx(2 / target(2, 2))


class _Rounds:
    def __init__(self) -> None:
        self.now = 0


def _planner(members: int, target) -> tuple[JointPlanner, _Rounds]:
    rounds = _Rounds()
    planner = JointPlanner(target, lambda s, n: 0.05, 4)
    planner.bind(rounds=lambda: rounds.now, members=lambda: members)
    return planner, rounds


def test_planner_keeps_members_in_step() -> None:
    planner, rounds = _planner(3, _memory_bound)
    good = (0.9,) * 4
    for key in "abc":
        planner.join(key, Member(good, 4))
    assert [planner.assign(key, Member(good, 4)) for key in "abc"] == [4, 4, 4]  # one cycle for all
    assert planner.cycles == [0, 1]
    rounds.now = 1  # "a" took a block that cost no draft round (a lookup) and plans again
    assert planner.assign("a", Member(good, 4)) == 3  # drafts only up to the cycle's verification
    rounds.now = 4
    assert planner.assign("a", Member(good, 4)) == 0  # planning for the verification round itself
    planner.leave("c")
    planner.join("d", Member(good, 4))
    rounds.now = 5  # the cycle is over: the next is planned for a, b and a newcomer d
    assert planner.assign("b", Member(good, 4)) == 4
    assert planner.assign("a", Member(good, 4)) == 4
    assert planner.cycles == [0, 2] and sorted(planner.last.drafters) == [0, 1, 2]
    rounds.now = 7
    assert planner.assign("d", Member(good, 4)) == 2  # first plans mid-cycle: drafts up to its end
    planner.join("e", Member(good, 4))
    rounds.now = 9
    assert planner.assign("e", Member(good, 4)) == 0  # joined after the plan: plain until the next
    rounds.now = 30  # d and e planned again since; a and b have not for 25 rounds
    planner.assign("d", Member(good, 4))
    planner.assign("e", Member(good, 4))
    assert set(planner.active()) == {"d", "e"}  # a and b left without saying so


def test_plain_batch_steps_plainly_and_a_lone_member_decides_alone() -> None:
    """A plain cycle: beside others a member steps plainly (its own probes would make its
    first token wait k rounds of the whole batch); alone it decides as a lone request."""
    members = [2]
    rounds = _Rounds()
    planner = JointPlanner(lambda s, n: float(n), lambda s, n: 0.05, 4)
    planner.bind(rounds=lambda: rounds.now, members=lambda: members[0])
    planner.join("a", Member((0.9,) * 4, 4))
    assert planner.assign("a", Member((0.9,) * 4, 4)) == 0
    assert planner.assign("b", Member((0.9,) * 4, 4)) == 0
    assert planner.cycles == [1, 0]
    planner.leave("b")
    members[0] = 1
    rounds.now = 1
    assert planner.assign("a", Member((0.9,) * 4, 4)) is None


def _flat_cost_engine() -> Engine:
    """Mock models whose measured forwards cost the same at any width (a memory-bound
    extreme): drafting in step pays for any acceptance."""
    engine = Engine.from_backends(MockLM(seed=1), CharTokenizer(), draft=MockLM(seed=2),
                                  proposer="draft")
    flat = tuple([1.0] * (engine.k_max + 1))
    engine.target_model.calibration = Calibration(flat, {}, cached=False)
    engine.draft_model.calibration = Calibration(tuple(0.01 for _ in flat), {}, cached=False)
    engine.target_model.batched_costs = lambda seqs, widths: tuple(
        tuple(1.0 for _ in widths) for _ in seqs)
    engine.draft_model.batched_costs = lambda seqs, widths: tuple(
        tuple(0.01 for _ in widths) for _ in seqs)
    # nsd's own work per pass, fixed rather than measured: measured on a loaded machine it
    # moved the plan's choice between a one-token block and a plain step near the end of
    # a request's budget, and with it where the requests' blocks part.
    engine._shared.host_costs = lambda config: HostCosts(plain=0.0005, fixed=0.001, per_row=0.0001,
                                                  draft_token=0.0001)
    return engine


@pytest.mark.parametrize("joint", [True, False])
def test_batched_auto_k_requests_draft_in_step(joint: bool) -> None:
    """Where a target forward costs the same at any width, three requests drafting the
    same blocks at once verify in one forward. Each request choosing alone cannot see that:
    beside the others' plain steps a block costs what its tokens add, and every block
    yields fewer tokens than plain steps in as many rounds, so alone none ever drafts."""
    engine = _flat_cost_engine()
    slots, batcher = engine.batched(3)
    if not joint:  # the control: each request choosing alone, by marginal costs
        for slot in slots:
            slot._shared.joint = None
    configs = [GenerationConfig(method=m, k="auto", max_new_tokens=40, temperature=t, seed=s)
               for m, t, s in (("nsd", 0.8, 1), ("sd", 1.0, 2), ("nsd", 0.0, 3))]
    results: list = [None] * 3
    ready = threading.Barrier(3)

    def run(i: int) -> None:
        with batcher.member():
            ready.wait()
            results[i] = slots[i].generate([1 + i, 2, 3], configs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(len(r.token_ids) == 40 for r in results)
    if not joint:
        assert all(r.stats.drafted_tokens == 0 for r in results)
        return
    assert all(r.stats.drafted_tokens > 0 for r in results)
    # The same block lengths, pass for pass, until the token budgets end the first request
    # (the mock's drafts are poor, so the blocks shorten as the estimates learn that).
    plans = [r.stats.k_per_pass for r in results]
    # A request's first token comes from a plain step: its time to first token never
    # waits on draft rounds.
    assert all(p[0] == 0 for p in plans)
    shortest = min(len(p) for p in plans)
    same = next((i for i in range(shortest) if len({p[i] for p in plans}) > 1), shortest)
    assert same >= shortest - 2 and len(set(plans[0][:same])) > 1, plans
    # So every verification of those passes carried all three requests.
    assert engine.target.batch_sizes[:same + 1] == [3] * (same + 1)
    assert slots[0]._shared.joint.cycles[1] >= same - 1
    assert slots[0]._shared.joint.active() == []  # every request left the plan when it ended


def test_metrics_count_the_plans_cycles() -> None:
    from prometheus_client import generate_latest

    from nsd.serve.metrics import ServeMetrics

    engine = _flat_cost_engine()
    slots, batcher = engine.batched(2)
    ready = threading.Barrier(2)

    def run(i: int) -> None:
        with batcher.member():
            ready.wait()
            slots[i].generate([1, 2 + i], GenerationConfig(method="sd", k="auto", max_new_tokens=12,
                                                           temperature=0.0, seed=i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    text = generate_latest(ServeMetrics(lambda: 0, batcher=lambda: batcher).registry).decode()
    drafted = [line for line in text.splitlines() if line.startswith('nsd_batch_plan_cycles_total{plan="draft"}')]
    assert drafted and float(drafted[0].split()[-1]) == batcher.plan.cycles[1] > 0


def test_a_request_alone_in_the_batch_decides_alone() -> None:
    """One request in a batched engine: no cycle is planned; it drafts as a lone request
    would (after its first token, a plain step)."""
    engine = _flat_cost_engine()
    slots, batcher = engine.batched(2)
    with batcher.member():
        result = slots[0].generate([1, 2, 3], GenerationConfig(method="sd", k="auto",
                                                               max_new_tokens=20, seed=1))
    assert batcher.plan.cycles == [0, 0]
    assert result.stats.k_per_pass[0] == 0 and result.stats.drafted_tokens > 0
    assert batcher.plan.active() == []


def test_a_closed_or_failed_generation_leaves_the_plan() -> None:
    engine = _flat_cost_engine()
    slots, batcher = engine.batched(2)
    config = GenerationConfig(method="sd", k="auto", max_new_tokens=30, seed=1)
    with batcher.member():
        stream = slots[0].stream([1, 2, 3], config)
        next(stream)
        assert len(batcher.plan.active()) == 1
        stream.close()  # a client that went away
        assert batcher.plan.active() == []


        def fails(tokens, all_logits=True):
            raise NSDError("the context is full")

        slots[0].target.forward = fails  # a generation that fails in its prefill
        with pytest.raises(NSDError, match="full"):
            slots[0].generate([1, 2, 3], config)
        assert batcher.plan.active() == []
