"""A persistent kernel's per-stage timeline, from the timestamps it records in a buffer.

The kernel's stamp buffer is int64 `[workers][stages][2]`: thread 0 of each worker writes
`%globaltimer` (ns) when it starts a stage's first item and when it finishes its last; a stage a
worker ran no item of stays 0. `timeline_from_stamps` turns it into the bundle's `timeline` entry
(validation/BUNDLE.md), which the report draws (validation/report.py timeline_svg) and sums up per
stage (`stage_summary`).
"""

from __future__ import annotations

from statistics import median


def timeline_from_stamps(stamps, stages: list[str], *, batch: int, unit: str = "ns") -> dict:
    """`stamps`: a nested sequence (or tensor/array with .tolist()) of shape [workers][stages][2]."""
    rows = stamps.tolist() if hasattr(stamps, "tolist") else stamps
    spans = []
    for w, per_stage in enumerate(rows):
        if len(per_stage) != len(stages):
            raise ValueError(f"worker {w}: {len(per_stage)} stamp pairs for {len(stages)} stages")
        for si, pair in enumerate(per_stage):
            start, end = int(pair[0]), int(pair[1])
            if start == 0 and end == 0:
                continue  # the worker ran no item of this stage
            if end < start or start == 0:
                raise ValueError(f"worker {w} stage {stages[si]!r}: stamps {start}..{end} are not a span")
            spans.append([w, si, start, end])
    return {"batch": int(batch), "unit": unit, "stages": list(stages), "spans": spans}


def us_per_unit(timeline: dict) -> float:
    """Microseconds per unit of a timeline's stamps: `ns` (%globaltimer), `us`, or `cycles` at
    its `clock_mhz`. A ValueError names a unit it cannot convert."""
    unit = timeline.get("unit", "ns")
    if unit == "ns":
        return 1e-3
    if unit == "us":
        return 1.0
    if unit == "cycles":
        try:
            mhz = float(timeline.get("clock_mhz") or 0)
        except (TypeError, ValueError):
            mhz = 0.0
        if mhz > 0:
            return 1.0 / mhz
        raise ValueError("timeline in cycles without its clock_mhz")
    raise ValueError(f"timeline unit {unit!r}: ns, us, or cycles with clock_mhz")


def stage_summary(timeline: dict) -> list[dict]:
    """Per stage of a `timeline` (in its stage order; stages no worker ran are left out): the
    workers that ran it, its first start, and its workers' end times (min, median, max), in us
    from the launch's first timestamp; `straggle_us` is max - median end, what the slowest
    workers cost the others at a wait on the stage (with static shares, where the stage's
    imbalance shows); `busy_median_us` / `busy_max_us` the workers' span lengths.

    Where the timeline carries the weight bytes each stage streamed (`stage_bytes`), a stage
    with bytes also gets `span_us` (its workers' median start to its last end), `tbps` (its
    bytes over that span) and, with the run's `read_tbps`, `of_read` (that over the read
    ceiling). A stage whose first weights a ring fetched before it started (static weights are
    prefetched across a wait) can show above the ceiling."""
    stages = list(timeline.get("stages") or [])
    spans = timeline.get("spans") or []
    if not spans:
        return []
    scale = us_per_unit(timeline)
    read = float(timeline.get("read_tbps") or 0)
    t0 = min(s[2] for s in spans)
    out = []
    for si, name in enumerate(stages):
        mine = [s for s in spans if int(s[1]) == si]
        if not mine:
            continue
        ends = sorted((s[3] - t0) * scale for s in mine)
        busy = [(s[3] - s[2]) * scale for s in mine]
        med = median(ends)
        row = {"stage": name, "workers": len(mine), "first_start_us": (min(s[2] for s in mine) - t0) * scale,
               "end_min_us": ends[0], "end_median_us": med, "end_max_us": ends[-1],
               "straggle_us": ends[-1] - med, "busy_median_us": median(busy), "busy_max_us": max(busy)}
        nbytes = float((timeline.get("stage_bytes") or {}).get(name) or 0)
        span = ends[-1] - median((s[2] - t0) * scale for s in mine)
        if nbytes > 0 and span > 0:
            row.update({"bytes": nbytes, "span_us": span, "tbps": nbytes / span / 1e6})
            if read:
                row["of_read"] = row["tbps"] / read
        out.append(row)
    return out
