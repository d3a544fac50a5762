"""The RFC front-matter a proposal carries (`rfc.toml`), which `fasttrack rfc` renders and the gate
reads (validation/rfc.py defines the format: the text fields below and a `[claim]` table).

Fields: title, summary, motivation, design, prediction, risks, rollback, alternatives, questions
(strings) and `[claim]` (speedup = bool, batches = [ints]) saying where the change claims to be
faster, which the gate holds against the measured verdicts. Missing author fields are left out (the
renderer shows them as not provided), never invented.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field, fields

TEXT_FIELDS = ("title", "summary", "motivation", "design", "prediction", "risks", "rollback",
               "alternatives", "questions")
REQUIRED_FIELDS = ("title", "summary", "motivation", "design", "prediction", "risks", "rollback")


@dataclass
class Proposal:
    """What a proposer submits: the RFC text and a measurable prediction."""

    title: str
    summary: str
    motivation: str = ""
    design: str = ""
    prediction: str = ""
    risks: str = ""
    rollback: str = ""
    alternatives: str = ""
    questions: str = ""
    # Expected change of median kernel time in percent (negative = faster), and where.
    predicted_time_change_pct: float | None = None
    predicted_cases: str = ""
    predicted_batches: list[int] | None = None  # batch sizes the speedup claim covers (None: all)

    @classmethod
    def from_tool_input(cls, data: dict) -> "Proposal":
        """Build from the submit tool's input; raises ValueError naming missing or bad fields."""
        if not isinstance(data, dict):
            raise ValueError("submit_proposal input must be an object")
        missing = [f for f in REQUIRED_FIELDS if not str(data.get(f) or "").strip()]
        if missing:
            raise ValueError(f"missing required field(s): {', '.join(missing)}")
        kw = {f: str(data.get(f) or "").strip() for f in TEXT_FIELDS}
        pct = data.get("predicted_time_change_pct")
        if pct is not None:
            try:
                pct = float(pct)
            except (TypeError, ValueError):
                raise ValueError("predicted_time_change_pct must be a number (negative = faster)") from None
        batches = data.get("predicted_batches")
        if batches is not None:
            if not isinstance(batches, list) or not all(
                    isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in batches):
                raise ValueError("predicted_batches must be a list of positive integers (batch sizes)")
            batches = sorted(set(batches)) or None
        return cls(**kw, predicted_time_change_pct=pct,
                   predicted_cases=str(data.get("predicted_cases") or "").strip(),
                   predicted_batches=batches)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def claims_speedup(self) -> bool:
        return self.predicted_time_change_pct is not None and self.predicted_time_change_pct < 0


def _toml_str(s: str) -> str:
    # A JSON string literal is a valid TOML basic string (same escapes: \" \\ \n \t \uXXXX ...).
    return json.dumps(s, ensure_ascii=False)


def render_rfc_toml(p: Proposal) -> str:
    """TOML text of the front-matter; round-trips through tomllib (checked)."""
    lines = ["# RFC front-matter written by propose-optimization; rendered by `fasttrack rfc`.", ""]
    for f in TEXT_FIELDS:
        v = getattr(p, f)
        if f == "prediction" and p.predicted_time_change_pct is not None:
            v = (f"{v}\n\nPredicted change of median kernel time: {p.predicted_time_change_pct:+.1f}%"
                 + (f" ({p.predicted_cases})" if p.predicted_cases else "") + ".")
        if v:
            lines.append(f"{f} = {_toml_str(v)}")
    lines += ["", "[claim]", f"speedup = {'true' if p.claims_speedup() else 'false'}"]
    if p.claims_speedup() and p.predicted_batches:
        lines.append(f"batches = [{', '.join(str(int(b)) for b in p.predicted_batches)}]")
    text = "\n".join(lines) + "\n"
    tomllib.loads(text)  # a bug here must not produce an unreadable RFC
    return text
