"""Benchmarks: base and head timed interleaved in one process, and verdicts that a statistic backs.

Statistics (pure, CPU-testable):
  * `summarize(samples)` median with spread (p10, p25, p75, p90, relative IQR);
  * `compare_samples(base, head)` gives SAME / FAST / SLOW / AMBIGUOUS, in the manner of nvbench's
    `compare`: a two-sided Mann-Whitney U test (scipy) decides whether the two samples differ, a
    minimum effect size whether the difference matters, and ambiguous stays ambiguous;
  * `bandwidth_check(...)` puts a case against the read-only streaming ceiling measured in the same
    run: a result beyond it by more than the measured noise is IMPOSSIBLE (a wrong byte count, a
    cached input, or a kernel that skipped work).

GPU harness (torch and benchmarks.common imported inside the functions, so this module imports on
any host): `measure_interleaved` times base and head A/B/B/A... in rounds, each round one sample per
side, either as CUDA-graph replays of many launches (small kernels: no launch gaps) or as
event-timed back-to-back launches behind a GPU backlog (`benchmarks.common.time_launches`); every
launch reads a rotated copy of its inputs so repeated runs stream from DRAM, not the L2.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

VERDICTS = ("SAME", "FAST", "SLOW", "AMBIGUOUS", "IMPOSSIBLE")

# Defaults of the verdict policy (recorded in every bundle next to the verdicts they produced).
MIN_EFFECT = 0.03  # a 3% change of the median is the smallest one we call FAST or SLOW
ALPHA = 0.01  # significance level of the Mann-Whitney test
MAX_NOISE = 0.10  # relative IQR above which medians that agree are still not called SAME
MIN_SAMPLES = 6


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of sorted data (numpy's default method)."""
    n = len(sorted_xs)
    if n == 1:
        return float(sorted_xs[0])
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return float(sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo))


def summarize(samples: Sequence[float]) -> dict:
    """median, p10, p25, p75, p90, min, relative IQR ((p75 - p25) / median), n."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no samples")
    med = statistics.median(xs)
    p25, p75 = _quantile(xs, 0.25), _quantile(xs, 0.75)
    return {"median": med, "p10": _quantile(xs, 0.10), "p25": p25, "p75": p75,
            "p90": _quantile(xs, 0.90), "min": xs[0], "n": len(xs),
            "rel_iqr": (p75 - p25) / med if med else math.inf}


@dataclass
class Comparison:
    """Base against head for one case (times: lower is better)."""

    verdict: str
    base: dict  # summarize() of the base samples
    head: dict
    change: float  # head median / base median - 1 (negative: head faster)
    speedup: float  # base median / head median
    p_value: float
    noise: float  # the larger relative IQR of the two
    reason: str
    min_effect: float = MIN_EFFECT
    alpha: float = ALPHA
    max_noise: float = MAX_NOISE

    def to_dict(self) -> dict:
        return asdict(self)


def compare_samples(base: Sequence[float], head: Sequence[float], *, min_effect: float = MIN_EFFECT,
                    alpha: float = ALPHA, max_noise: float = MAX_NOISE,
                    min_samples: int = MIN_SAMPLES) -> Comparison:
    """The verdict for head against base (per-launch times, same unit).

    FAST / SLOW: the Mann-Whitney test rejects equality at `alpha` AND the medians differ by at
    least `min_effect`. SAME: the medians differ by less than `min_effect` AND both samples are
    tighter than `max_noise` (relative IQR), so the agreement is not an accident of noise.
    AMBIGUOUS: anything else (too few samples, a large difference the test cannot confirm, or
    agreement too noisy to trust).
    """
    from scipy.stats import mannwhitneyu

    b, h = summarize(base), summarize(head)
    change = h["median"] / b["median"] - 1.0
    speedup = b["median"] / h["median"]
    noise = max(b["rel_iqr"], h["rel_iqr"])
    if b["n"] < min_samples or h["n"] < min_samples:
        return Comparison("AMBIGUOUS", b, h, change, speedup, math.nan, noise,
                          f"too few samples ({b['n']} base, {h['n']} head; need {min_samples})",
                          min_effect, alpha, max_noise)
    if set(base) == set(head) and len(set(base)) == 1:
        p = 1.0  # identical constant samples: mannwhitneyu is undefined, and there is no difference
    else:
        p = float(mannwhitneyu(list(base), list(head), alternative="two-sided").pvalue)
    if p < alpha and abs(change) >= min_effect:
        verdict = "FAST" if change < 0 else "SLOW"
        reason = f"median {change:+.1%} (p={p:.2g} < {alpha:g})"
    elif abs(change) < min_effect and noise <= max_noise:
        verdict = "SAME"
        reason = f"median {change:+.1%}, within the {min_effect:.0%} minimum effect (noise {noise:.1%})"
    elif abs(change) < min_effect:
        verdict = "AMBIGUOUS"
        reason = f"median {change:+.1%} but noise {noise:.1%} exceeds {max_noise:.0%}"
    else:
        verdict = "AMBIGUOUS"
        reason = f"median {change:+.1%} not significant (p={p:.2g} >= {alpha:g})"
    return Comparison(verdict, b, h, change, speedup, p, noise, reason, min_effect, alpha, max_noise)


def bandwidth_check(bytes_moved: int, median_us: float, kernel_noise: float, read_tbps: float,
                    ceiling_noise: float) -> dict:
    """A case against the read-only streaming ceiling of the same run.

    achieved = bytes_moved / median time; fraction = achieved / read ceiling. IMPOSSIBLE when the
    fraction exceeds 1 + the measured noise (the case's relative spread plus the ceiling's).
    """
    achieved = bytes_moved / (median_us * 1e-6) / 1e12 if median_us > 0 else math.inf
    fraction = achieved / read_tbps if read_tbps > 0 else math.nan
    margin = max(0.0, kernel_noise) + max(0.0, ceiling_noise)
    impossible = bool(fraction > 1.0 + margin)
    return {"bytes": int(bytes_moved), "achieved_tbps": achieved, "fraction_of_read": fraction,
            "noise_margin": margin, "impossible": impossible}


def case_verdict(comparison: Comparison | None, head_bw: dict) -> tuple[str, str]:
    """The case's final verdict: IMPOSSIBLE overrides the statistical one."""
    if head_bw.get("impossible"):
        return "IMPOSSIBLE", (f"head moves {head_bw['achieved_tbps']:.2f} TB/s, "
                              f"{head_bw['fraction_of_read']:.2f}x the read-only ceiling "
                              f"(noise margin {head_bw['noise_margin']:.1%})")
    if comparison is None:
        return "AMBIGUOUS", "no base to compare against"
    return comparison.verdict, comparison.reason


def benchmark_passed(cases: list[dict], *, allow_slow: bool = False) -> tuple[bool, list[str]]:
    """A benchmark section passes when every case was measured, none is IMPOSSIBLE and (unless
    allowed) none is SLOW."""
    reasons = []
    for c in cases:
        if c.get("error"):
            reasons.append(f"{c['case_id']}: not measured ({c['error']})")
        elif c["verdict"] == "IMPOSSIBLE":
            reasons.append(f"{c['case_id']}: IMPOSSIBLE ({c['reason']})")
        elif c["verdict"] == "SLOW" and not allow_slow:
            reasons.append(f"{c['case_id']}: SLOW ({c['reason']})")
    return not reasons, reasons


# ---------------------------------------------------------------------------------------------
# GPU harness
# ---------------------------------------------------------------------------------------------

GRAPH_BELOW_US = 50.0  # kernels faster than this are timed as CUDA-graph replays
MAX_ROTATION = 64  # input copies at most (tiny kernels cannot rotate past the L2 in sane memory)


def time_graph(launch: Callable[[int], None], *, inner: int, replays: int = 3) -> float:
    """Median per-launch time (us) of a CUDA graph holding `inner` launches (launch(i), i rotating).

    The launches are warmed (module load, allocator) before capture; each replay is timed with
    events after a device-wide sync.
    """
    import torch

    for i in range(2):
        launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):  # warm on the capture stream too (lazy per-stream state)
            launch(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for i in range(inner):
            launch(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / inner)
    del g
    return statistics.median(times)


def measure_interleaved(base: Callable[[int], None] | None, head: Callable[[int], None], *,
                        rounds: int = 12, inner: int = 40, use_graph: bool | None = None) -> dict:
    """Per-launch time samples (us) of base and head, measured alternately in one process.

    Round r measures base then head when r is even, head then base when odd (A/B/B/A...), so
    drift in clocks or temperature hits both sides alike. Each round gives one sample per side:
    the median per-launch time of `inner` launches (CUDA-graph replays when `use_graph`, else
    event-timed launches behind a GPU backlog). `use_graph=None` picks graphs for kernels below
    GRAPH_BELOW_US. Returns {"base": [...] or None, "head": [...], "graph": bool}.
    """
    import torch

    from benchmarks.common import time_launches

    if use_graph is None:
        probe = time_launches(head, reps=10, warmup=3).median_us
        use_graph = probe < GRAPH_BELOW_US

    def one(fn):
        if use_graph:
            return time_graph(fn, inner=inner)
        return time_launches(fn, reps=inner, warmup=3).median_us

    sides = {"base": [], "head": []}
    for r in range(rounds):
        order = [("base", base), ("head", head)] if r % 2 == 0 else [("head", head), ("base", base)]
        for name, fn in order:
            if fn is not None:
                sides[name].append(one(fn))
        torch.cuda.synchronize()
    return {"base": sides["base"] if base is not None else None, "head": sides["head"],
            "graph": bool(use_graph)}


def rotation_copies(bytes_per_launch: int) -> tuple[int, bool]:
    """(copies, past_l2): how many input copies to rotate through, and whether that many streams
    past the L2 (4x the L2 per pass) or had to be capped at MAX_ROTATION."""
    from benchmarks.common import l2_bytes, rotation_count

    need = rotation_count(bytes_per_launch, l2_bytes())
    return min(need, MAX_ROTATION), need <= MAX_ROTATION
