"""Budgets of a proposal run: turns, tokens (input, output, cache read, cache write), estimated cost
and wall-clock.

The loop asks `BudgetTracker.exhausted()` between steps (before each model call, before each tool
call), never inside one, so hitting a limit ends the run at a clean boundary: no file is left half
written and the trajectory's last line is whole.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

# USD per million tokens (input, output). Cache writes (5-minute TTL) cost 1.25x input and cache
# reads 0.1x input. Source: the public Claude models overview and pricing pages (2026). Models not
# listed are charged at the most expensive listed rate, so a cost budget errs on the safe side.
PRICES_USD_PER_MTOK: dict[str, tuple[float, float]] = {
    "claude-fable-5-2": (8.0, 40.0),
    "claude-fable-5-1": (10.0, 50.0),
    "claude-opus-5-5": (4.0, 20.0),
    "claude-opus-5": (5.0, 25.0),
    "claude-sonnet-5-5": (2.0, 10.0),
    "claude-sonnet-5": (2.0, 10.0),
    "claude-haiku-5-5": (0.10, 0.50),
    "claude-haiku-4-5": (1.0, 5.0),
}
CACHE_WRITE_FACTOR = 1.25
CACHE_READ_FACTOR = 0.10


def price_for(model: str) -> tuple[tuple[float, float], bool]:
    """(input, output) USD per million tokens for `model`, and whether the model was known.

    Dated snapshots (`claude-opus-5-5-20260601`) use their alias's price.
    """
    if model in PRICES_USD_PER_MTOK:
        return PRICES_USD_PER_MTOK[model], True
    for alias in sorted(PRICES_USD_PER_MTOK, key=len, reverse=True):
        if model.startswith(alias + "-"):
            return PRICES_USD_PER_MTOK[alias], True
    worst = max(PRICES_USD_PER_MTOK.values(), key=lambda p: p[1])
    return worst, False


class BudgetError(ValueError):
    """A budget specification that cannot be parsed."""


@dataclass(frozen=True)
class BudgetLimits:
    """Upper bounds of one run; None means unbounded."""

    turns: int | None = 40
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    cost_usd: float | None = 10.0
    wall_s: float | None = 3600.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, specs: list[str] | None, base: "BudgetLimits | None" = None) -> "BudgetLimits":
        """Limits from `KEY=VALUE` items (comma-separated or repeated) over `base`.

        Keys: turns, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost (USD),
        wall (seconds, or with a unit: 90s, 30m, 2h). `none` removes a limit.
        """
        aliases = {"cost": "cost_usd", "cost_usd": "cost_usd", "wall": "wall_s", "wall_s": "wall_s",
                   "time": "wall_s"}
        names = {f.name for f in fields(cls)}
        values = (base or cls()).to_dict()
        for spec in specs or []:
            for item in spec.split(","):
                item = item.strip()
                if not item:
                    continue
                key, sep, raw = item.partition("=")
                key = aliases.get(key.strip(), key.strip())
                if not sep or key not in names:
                    raise BudgetError(
                        f"bad budget item {item!r}: expected KEY=VALUE with KEY one of turns, "
                        "input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost, wall"
                    )
                values[key] = _parse_value(key, raw.strip(), item)
        return cls(**values)


def _parse_value(key: str, raw: str, item: str):
    if raw.lower() in ("none", "inf", "unlimited"):
        return None
    try:
        if key == "wall_s":
            units = {"s": 1, "m": 60, "h": 3600}
            mult = units.get(raw[-1:].lower())
            v = float(raw[:-1]) * mult if mult else float(raw)
        elif key == "cost_usd":
            v = float(raw)
        else:
            v = int(raw)
    except ValueError:
        raise BudgetError(f"bad budget item {item!r}: {raw!r} is not a number") from None
    if v < 0:
        raise BudgetError(f"bad budget item {item!r}: must not be negative")
    return v


@dataclass
class UsageTotals:
    """What a run has spent so far."""

    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BudgetTracker:
    """Charges model usage against `limits` and says when one is reached."""

    limits: BudgetLimits
    model: str = ""
    clock: Callable[[], float] = time.monotonic
    spent: UsageTotals = field(default_factory=UsageTotals)
    started: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.started = self.clock()
        (self._in_price, self._out_price), self.price_known = price_for(self.model)

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def charge(self, usage) -> float:
        """Add one model response's usage (an SDK `Usage` or a dict); returns that turn's cost."""
        get = (usage.get if isinstance(usage, dict) else lambda k, d=None: getattr(usage, k, d))
        inp = int(get("input_tokens", 0) or 0)
        out = int(get("output_tokens", 0) or 0)
        cr = int(get("cache_read_input_tokens", 0) or 0)
        cw = int(get("cache_creation_input_tokens", 0) or 0)
        cost = (
            inp * self._in_price
            + out * self._out_price
            + cr * self._in_price * CACHE_READ_FACTOR
            + cw * self._in_price * CACHE_WRITE_FACTOR
        ) / 1e6
        s = self.spent
        s.turns += 1
        s.input_tokens += inp
        s.output_tokens += out
        s.cache_read_tokens += cr
        s.cache_write_tokens += cw
        s.cost_usd += cost
        return cost

    def exhausted(self) -> str | None:
        """The first limit reached, as a sentence; None while every limit holds."""
        lim, s = self.limits, self.spent
        checks = [
            ("turns", s.turns, lim.turns, "turns"),
            ("input tokens", s.input_tokens, lim.input_tokens, "tokens"),
            ("output tokens", s.output_tokens, lim.output_tokens, "tokens"),
            ("cache-read tokens", s.cache_read_tokens, lim.cache_read_tokens, "tokens"),
            ("cache-write tokens", s.cache_write_tokens, lim.cache_write_tokens, "tokens"),
        ]
        for what, used, cap, unit in checks:
            if cap is not None and used >= cap:
                return f"budget reached: {what} {used} of {cap} {unit}"
        if lim.cost_usd is not None and s.cost_usd >= lim.cost_usd:
            note = "" if self.price_known else f" (price of {self.model!r} unknown: charged at the highest listed rate)"
            return f"budget reached: estimated cost ${s.cost_usd:.4f} of ${lim.cost_usd:.2f}{note}"
        el = self.elapsed_s()
        if lim.wall_s is not None and el >= lim.wall_s:
            return f"budget reached: wall-clock {el:.0f} s of {lim.wall_s:.0f} s"
        return None

    def snapshot(self) -> dict:
        d = self.spent.to_dict()
        d["elapsed_s"] = round(self.elapsed_s(), 3)
        d["cost_usd"] = round(d["cost_usd"], 6)
        d["price_known"] = self.price_known
        return d
