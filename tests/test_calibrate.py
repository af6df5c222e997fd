"""Side-by-side step-cost comparison (``--weights auto``): deterministic, on a fake clock."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from nsd.draftlen import calibrate
from nsd.models.loader import pick_format
from mock import MockLM


class Clock:
    """perf_counter stand-in: backends advance it by what their forward 'costs'."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0


class TimedLM(MockLM):
    """A mock whose forwards cost ``per_token`` seconds each, times the machine's
    slowdown, which is 3x for the first ``cold`` forwards of the whole process."""

    def __init__(self, clock: Clock, per_token: float, cold: int = 8) -> None:
        super().__init__(vocab_size=32)
        self.clock, self.per_token, self.cold = clock, per_token, cold

    def forward(self, tokens, all_logits=True):
        self.clock.calls += 1
        slow = 3.0 if self.clock.calls <= self.cold else 1.0
        self.clock.now += slow * self.per_token * len(tokens)
        return super().forward(tokens, all_logits)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: c.now)
    return c


def test_round_robin_spreads_a_cold_start_over_every_candidate(clock: Clock) -> None:
    # Three identical backends; the machine is slow for its first 8 forwards (the
    # prefills, warm-ups and the first two timed calls). Measured one after another
    # the first backend would absorb it all; round-robin medians must not see it.
    backends = [TimedLM(clock, 0.010) for _ in range(3)]
    costs = calibrate.measure_side_by_side(backends, context=4)
    assert costs == pytest.approx((0.010, 0.010, 0.010))
    # The sequential measurement this replaced does show the bias (the test has power).
    clock.calls = 0
    first = calibrate.measure(backends[0], 1, context=4, repeats=3)[0]
    assert first > 0.015


def test_a_cheaper_candidate_measures_cheaper(clock: Clock) -> None:
    costs = calibrate.measure_side_by_side([TimedLM(clock, 0.010), TimedLM(clock, 0.009)], context=4)
    assert costs[1] < costs[0]


@pytest.fixture
def quiet_machine(tmp_path: Path, monkeypatch) -> Path:
    """No other load on the machine, and a cache folder of the test's own (returned)."""
    @contextlib.contextmanager
    def measure():
        yield SimpleNamespace(sample=SimpleNamespace(flagged=False, other_cpu=0.0))

    monkeypatch.setattr("nsd.draftlen.cpu_load.LoadMonitor", lambda: SimpleNamespace(measure=measure))
    monkeypatch.setattr("nsd.cache_dir.cache_dir", lambda: tmp_path)
    return tmp_path


def test_comparison_is_cached_and_provisionally_when_busy(clock: Clock, tmp_path: Path, monkeypatch,
                                                         capsys) -> None:
    busy = {"flag": False}

    @contextlib.contextmanager
    def measure():
        yield SimpleNamespace(sample=SimpleNamespace(flagged=busy["flag"], other_cpu=0.9))

    monkeypatch.setattr("nsd.draftlen.cpu_load.LoadMonitor", lambda: SimpleNamespace(measure=measure))
    monkeypatch.setattr("nsd.cache_dir.cache_dir", lambda: tmp_path)
    files = {}
    for name in ("original", "q4_0"):
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(b"x")
    a, b = TimedLM(clock, 0.010), TimedLM(clock, 0.006)
    pair = {"original": (a, files["original"]), "q4_0": (b, files["q4_0"])}
    busy["flag"] = True
    provisional = calibrate.compare_step_costs(pair, quiet=True)
    stored = json.loads(next(tmp_path.glob("calibration/compare-*.json")).read_text())
    assert stored["provisional"] is True
    # Busy again: measured again, that measurement discarded, the provisional costs serve
    # (a seeded -k auto run repeats its choices on a machine that stays busy).
    a.per_token, calls = 0.020, clock.calls
    capsys.readouterr()
    assert calibrate.compare_step_costs(pair) == provisional and clock.calls > calls
    err = capsys.readouterr().err
    assert "on this machine again (the stored costs were measured busy)" in err and "(once)" not in err
    assert "this measurement is discarded" in err
    # Idle: the new measurement replaces them for good.
    busy["flag"] = False
    first = calibrate.compare_step_costs(pair, quiet=True)
    assert first["original"] > provisional["original"]
    assert "replace those stored provisionally" in capsys.readouterr().err
    assert "provisional" not in json.loads(next(tmp_path.glob("calibration/compare-*.json")).read_text())
    a.per_token = 0.010
    calls = clock.calls
    again = calibrate.compare_step_costs({"original": (a, files["original"]), "q4_0": (b, files["q4_0"])}, quiet=True)
    assert again == first and clock.calls == calls  # from the cache: nothing ran
    assert len(list((tmp_path / "calibration").glob("compare-*.json"))) == 1
    # Measured again on request while busy: serves that call, keeps the idle entry.
    busy["flag"] = True
    refreshed = calibrate.compare_step_costs(pair, quiet=True, refresh=True)
    assert clock.calls > calls and refreshed != first
    busy["flag"] = False
    assert calibrate.compare_step_costs(pair, quiet=True) == first
    calls = clock.calls
    files["q4_0"].write_bytes(b"xy")  # a changed file is measured again
    calibrate.compare_step_costs({"original": (a, files["original"]), "q4_0": (b, files["q4_0"])}, quiet=True)
    assert clock.calls > calls


@pytest.mark.parametrize("costs, expected", [
    ({"original": 0.046, "q4_0": 0.046, "q8_0": 0.087}, "original"),  # a tie keeps the original
    ({"original": 0.046, "q4_0": 0.0445, "q8_0": 0.087}, "original"),  # 3% is within the margin
    ({"original": 0.092, "q4_0": 0.055, "q8_0": 0.073}, "q4_0"),
    ({"original": 0.092, "q4_0": 0.080, "q8_0": 0.073}, "q8_0"),
])
def test_pick_format_needs_a_derived_format_to_win_by_the_margin(costs, expected) -> None:
    assert pick_format(costs) == expected


# Measured on an AMD EPYC (Zen 4, 2 cores): c(1) and c(5) seconds of the 1.5B target per
# format (BENCHMARKS.md, "Verification kernel without AMX").
ZEN4_C1 = {"original": 0.0321, "q4_0": 0.0353, "q8_0": 0.0741}
ZEN4_C5 = {"original": 0.115, "q4_0": 0.049, "q8_0": 0.185}


def test_a_verifying_target_is_picked_by_its_verification_too() -> None:
    # One-token steps alone keep the original file (Q4_0 is 10% dearer there) ...
    assert pick_format(ZEN4_C1) == "original"
    # ... but as a target whose 5-token verification yields 2.3 tokens, Q4_0 makes a token
    # for 21 ms against the original's 32 ms.
    assert pick_format(ZEN4_C1, ZEN4_C5, tokens_per_pass=2.31) == "q4_0"
    # Where verification does not pay for any file, the one-token step decides as before.
    flat = {f: 10 * c for f, c in ZEN4_C1.items()}
    assert pick_format(ZEN4_C1, flat, tokens_per_pass=2.31) == "original"
    # The margin applies to the combined score: a derived file barely ahead is not taken.
    assert pick_format(ZEN4_C1, {"original": 0.0700, "q4_0": 0.0680, "q8_0": 0.2},
                       tokens_per_pass=2.31) == "original"


def test_multi_token_comparisons_measure_that_many_tokens_and_cache_apart(
        clock: Clock, quiet_machine: Path) -> None:
    tmp_path = quiet_machine
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    lm = TimedLM(clock, 0.010, cold=0)
    one = calibrate.compare_step_costs({"original": (lm, f)}, quiet=True)
    five = calibrate.compare_step_costs({"original": (lm, f)}, quiet=True, n_tokens=5)
    assert one["original"] == pytest.approx(0.010)
    assert five["original"] == pytest.approx(0.050)
    assert len(list((tmp_path / "calibration").glob("compare-*.json"))) == 2


class GraphLM(MockLM):
    """A mock whose forward costs ``per_token`` per token plus ``rebuild`` whenever its
    size differs from the previous forward's (llama.cpp reuses its graph only between
    forwards of the same shape)."""

    def __init__(self, clock: Clock, per_token: float, rebuild: float) -> None:
        super().__init__(vocab_size=32)
        self.clock, self.per_token, self.rebuild, self.last = clock, per_token, rebuild, None

    def forward(self, tokens, all_logits=True):
        self.clock.now += self.per_token * len(tokens) + (self.rebuild if len(tokens) != self.last else 0.0)
        self.last = len(tokens)
        return super().forward(tokens, all_logits)


def test_one_token_steps_are_timed_as_plain_decoding_runs_them(clock: Clock) -> None:
    # Plain decoding repeats one shape, so its steps reuse the graph; every verification
    # follows a forward of another size. Timed in that order, c(1) carries no rebuild and
    # every c(n >= 2) does.
    costs = calibrate.measure(GraphLM(clock, 0.010, rebuild=0.003), 4, context=4, repeats=3)
    assert costs == pytest.approx((0.010, 0.023, 0.033, 0.043))


class BatchedTimedLM(TimedLM):
    """A batched forward costs a fixed part plus ``per_token`` per token plus ``per_seq``
    per sequence (the clock advances once per forward_many, as a real batch does)."""

    def __init__(self, clock: Clock, per_token: float, per_seq: float) -> None:
        super().__init__(clock, per_token, cold=0)
        self.per_seq = per_seq
        self.set_sequences(8)

    def forward_many(self, items):
        self.clock.now += 0.01 + self.per_seq * len(items)  # what TimedLM.forward omits
        return super().forward_many(items)


def test_batched_forwards_are_measured_per_shape_and_cached(clock: Clock, quiet_machine: Path) -> None:
    tmp_path = quiet_machine
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    lm = BatchedTimedLM(clock, per_token=0.002, per_seq=0.003)
    grid = calibrate.calibrate_batched(lm, model, (1, 2, 4), (1, 3), quiet=True)
    for s, row in zip((1, 2, 4), grid):  # every shape timed as it runs
        for w, seconds in zip((1, 3), row):
            assert seconds == pytest.approx(0.01 + 0.003 * s + 0.002 * s * w)
    assert all(lm.seq_num_cached(q) == 0 for q in range(8))  # caches emptied afterwards
    calls = clock.calls
    assert calibrate.calibrate_batched(lm, model, (1, 2, 4), (1, 3), quiet=True) == grid
    assert clock.calls == calls  # the second time from the cache
    calibrate.calibrate_batched(lm, model, (1, 2), (1, 3), quiet=True)
    assert clock.calls > calls  # another grid is another measurement


class ShortContextLM(BatchedTimedLM):
    """Holds ``n_ctx`` tokens per sequence, and fails past them as llama.cpp does."""

    n_ctx = 24

    def forward(self, tokens, all_logits=True):
        if self.num_cached + len(tokens) > self.n_ctx:
            raise calibrate.NSDError(f"context full: {self.num_cached} + {len(tokens)} > {self.n_ctx}")
        return super().forward(tokens, all_logits)


def test_a_short_context_is_measured_after_as_many_tokens_as_fit(clock: Clock, quiet_machine: Path) -> None:
    # A small --n-ctx measured after 256 cached tokens failed on a sequence nobody asked
    # for, or not, depending on what the cache held. Now the context shrinks to fit.
    model = quiet_machine / "m.gguf"
    model.write_bytes(b"x")
    lm = ShortContextLM(clock, per_token=0.002, per_seq=0.0)
    steps = calibrate.calibrate(lm, model, 5, quiet=True)
    assert len(steps.costs) == 5 and steps.key["context"] == 24 - 5
    assert calibrate.calibrate_batched(lm, model, (1, 2), (1, 3), quiet=True)
    assert calibrate.compare_step_costs({"a": (lm, model)}, quiet=True)["a"] > 0
    assert calibrate.fitting_context([lm], 256, 23) == 1
    with pytest.raises(calibrate.NSDError, match="no room to measure"):
        calibrate.fitting_context([lm], 256, 24)
    assert calibrate.fitting_context([MockLM()], 256, 9) == 256  # no limit known: as asked
