"""A persistent kernel's per-stage timeline, from the timestamps it records in a buffer.

The kernel's stamp buffer is int64 `[workers][stages][2]`: thread 0 of each worker writes
`%globaltimer` (ns) when it starts a stage's first item and when it finishes its last; a stage a
worker ran no item of stays 0. `timeline_from_stamps` turns it into the bundle's `timeline` entry
(validation/BUNDLE.md), which the report draws (validation/report.py timeline_svg).
"""

from __future__ import annotations


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
