"""Benchmark statistics and verdicts against synthetic samples whose answer is known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from validation.bench import (bandwidth_check, benchmark_passed, case_verdict, compare_samples,
                              summarize)


def samples(median, rel_sd, n, seed):
    rng = np.random.default_rng(seed)
    return list(median * (1 + rel_sd * rng.standard_normal(n)))


def test_summarize_known_values():
    s = summarize([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert s["median"] == 5 and s["min"] == 1 and s["n"] == 9
    assert s["p25"] == 3 and s["p75"] == 7
    assert s["rel_iqr"] == pytest.approx(4 / 5)
    with pytest.raises(ValueError):
        summarize([])


def test_identical_distributions_are_same():
    c = compare_samples(samples(10.0, 0.01, 20, 1), samples(10.0, 0.01, 20, 2))
    assert c.verdict == "SAME", c.reason
    assert abs(c.change) < 0.03


def test_clearly_faster_head_is_fast():
    c = compare_samples(samples(10.0, 0.01, 20, 1), samples(8.0, 0.01, 20, 2))
    assert c.verdict == "FAST", c.reason
    assert c.speedup == pytest.approx(1.25, rel=0.02)
    assert c.p_value < 1e-6


def test_clearly_slower_head_is_slow():
    c = compare_samples(samples(10.0, 0.01, 20, 1), samples(11.0, 0.01, 20, 2))
    assert c.verdict == "SLOW", c.reason


def test_significant_but_tiny_difference_is_same():
    # 1% apart with 0.1% noise: the test sees it, the minimum effect says it does not matter.
    c = compare_samples(samples(10.0, 0.001, 30, 1), samples(10.1, 0.001, 30, 2))
    assert c.p_value < 0.01
    assert c.verdict == "SAME", c.reason


def test_large_but_unconfirmed_difference_is_ambiguous():
    # Medians 10% apart, but noise of 40%: the test cannot confirm it.
    c = compare_samples(samples(10.0, 0.4, 8, 3), samples(9.0, 0.4, 8, 4))
    assert c.verdict == "AMBIGUOUS", c.reason


def test_agreement_under_heavy_noise_is_ambiguous_not_same():
    base = [10.0, 13.0, 8.0, 11.5, 9.0, 12.0, 7.5, 10.5]
    head = [10.1, 12.5, 8.2, 11.0, 9.3, 12.2, 7.9, 10.2]
    c = compare_samples(base, head)
    assert abs(c.change) < 0.03 and c.noise > 0.10
    assert c.verdict == "AMBIGUOUS", c.reason


def test_too_few_samples_is_ambiguous():
    assert compare_samples([10, 10, 10], [5, 5, 5]).verdict == "AMBIGUOUS"


def test_constant_identical_samples_are_same():
    c = compare_samples([5.0] * 10, [5.0] * 10)
    assert c.verdict == "SAME" and c.p_value == 1.0


def test_bandwidth_beyond_the_read_ceiling_is_impossible():
    # 100 MB in 10 us is 10 TB/s: more than twice a 4.6 TB/s read ceiling.
    bw = bandwidth_check(100_000_000, 10.0, 0.01, 4.6, 0.01)
    assert bw["achieved_tbps"] == pytest.approx(10.0)
    assert bw["impossible"]
    verdict, reason = case_verdict(compare_samples([20.0] * 10, [10.0] * 10), bw)
    assert verdict == "IMPOSSIBLE" and "read-only ceiling" in reason


def test_bandwidth_within_the_noise_of_the_ceiling_is_possible():
    # 1% above the ceiling, with 2% + 1% measured noise: not evidence of a hack.
    bw = bandwidth_check(4_646_000, 1.0, 0.02, 4.6, 0.01)
    assert bw["fraction_of_read"] == pytest.approx(1.01, rel=1e-3)
    assert not bw["impossible"]
    bw = bandwidth_check(100_000_000, 30.0, 0.01, 4.6, 0.01)
    assert bw["fraction_of_read"] == pytest.approx(3.333 / 4.6, rel=1e-3)
    assert not bw["impossible"]


def test_benchmark_fails_on_impossible_and_slow_cases():
    cases = [{"case_id": "a", "verdict": "FAST", "reason": ""},
             {"case_id": "b", "verdict": "SLOW", "reason": "+5%"}]
    ok, reasons = benchmark_passed(cases)
    assert not ok and "b: SLOW" in reasons[0]
    assert benchmark_passed(cases, allow_slow=True)[0]
    ok, reasons = benchmark_passed([{"case_id": "c", "verdict": "IMPOSSIBLE", "reason": "x"}], allow_slow=True)
    assert not ok


def test_zero_time_is_impossible_not_a_crash():
    bw = bandwidth_check(1000, 0.0, 0.0, 4.6, 0.0)
    assert math.isinf(bw["achieved_tbps"]) and bw["impossible"]
