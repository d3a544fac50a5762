"""The fast-track RFC: the author's front-matter and the rendered document.

The parts of an RFC only an author can write come from a short TOML front-matter file
(`rfc.toml`, committed beside the change, or given by path). Fields, all optional strings:

    title, summary, motivation, design, prediction, risks, rollback, alternatives, questions

and an optional `[claim]` table that the gate enforces:

    [claim]
    speedup = true          # the change claims to be faster
    batches = [1, 2, 4]     # on these batch sizes (default: every measured case)

A missing field is rendered as "(not provided)"; nothing is invented. `render_rfc` fills
`rfc_templates/rfc.md.j2` from the front-matter, the change scope, the policy decision and the
evidence bundle (when one was found).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

FRONT_MATTER_NAME = "rfc.toml"
FIELDS = ("title", "summary", "motivation", "design", "prediction", "risks", "rollback",
          "alternatives", "questions")
NOT_PROVIDED = "(not provided)"
TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "rfc_templates"


class FrontMatterError(ValueError):
    """The front-matter file is malformed."""


@dataclass(frozen=True)
class SpeedupClaim:
    speedup: bool = False
    batches: tuple[int, ...] | None = None  # None: every measured case

    def to_dict(self) -> dict:
        return {"speedup": self.speedup, "batches": list(self.batches) if self.batches else None}


@dataclass(frozen=True)
class FrontMatter:
    fields: dict = field(default_factory=dict)  # name -> text, only the fields provided
    claim: SpeedupClaim = SpeedupClaim()
    source: str | None = None  # repo-relative path or the path given; None when there is none

    def get(self, name: str) -> str:
        return self.fields.get(name) or NOT_PROVIDED

    def missing(self) -> list[str]:
        return [f for f in FIELDS if not self.fields.get(f)]


def parse_front_matter(text: str, source: str) -> FrontMatter:
    """Parse front-matter TOML; FrontMatterError naming `source` and the problem otherwise."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise FrontMatterError(f"{source}: not valid TOML: {e}") from None
    unknown = set(raw) - set(FIELDS) - {"claim"}
    if unknown:
        raise FrontMatterError(f"{source}: unknown field(s) {', '.join(sorted(unknown))}; "
                               f"fields are {', '.join(FIELDS)} and [claim]")
    fields = {}
    for name in FIELDS:
        if name in raw:
            if not isinstance(raw[name], str):
                raise FrontMatterError(f"{source}: {name} must be a string")
            if raw[name].strip():
                fields[name] = raw[name].strip()
    claim = SpeedupClaim()
    if "claim" in raw:
        c = raw["claim"]
        if not isinstance(c, dict) or set(c) - {"speedup", "batches"}:
            raise FrontMatterError(f"{source}: [claim] takes only speedup (bool) and batches (list)")
        sp = c.get("speedup", False)
        if not isinstance(sp, bool):
            raise FrontMatterError(f"{source}: claim.speedup must be true or false")
        b = c.get("batches")
        if b is not None and (not isinstance(b, list) or not b or
                              not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b)):
            raise FrontMatterError(f"{source}: claim.batches must be a non-empty list of positive integers")
        claim = SpeedupClaim(sp, tuple(b) if b else None)
    return FrontMatter(fields, claim, source)


def find_front_matter(repo, scope, path: str | Path | None = None) -> FrontMatter:
    """The change's front-matter: the file at `path` if given, else the one `rfc.toml` the change
    adds or modifies (read at head, or from the working tree). An empty FrontMatter when there is
    none; FrontMatterError when the change carries several or the file is malformed."""
    from .scope import read_at

    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise FrontMatterError(f"cannot read front-matter {path}: {e.strerror}") from None
        return parse_front_matter(text, str(path))
    found = [f.path for f in scope.files
             if Path(f.path).name == FRONT_MATTER_NAME and f.status != "deleted"]
    if not found:
        return FrontMatter()
    if len(found) > 1:
        raise FrontMatterError(f"the change carries several {FRONT_MATTER_NAME} files "
                               f"({', '.join(found)}); name one with --front-matter")
    data = read_at(repo, scope.head, found[0])
    if data is None:
        return FrontMatter()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FrontMatterError(f"{found[0]}: not UTF-8 text") from None
    return parse_front_matter(text, found[0])


def template_env():
    """The jinja2 environment over rfc_templates/ (HTML autoescaped, Markdown not)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        autoescape=jinja2.select_autoescape(["html", "html.j2"]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["short"] = lambda s: (s or "")[:12]
    env.filters["md_cell"] = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    return env


def _median_us(x):
    """A side's time: a bundle's summary dict ({median, ...}) or a bare number of µs."""
    x = x.get("median") if isinstance(x, dict) else x
    return x if isinstance(x, (int, float)) else None


def _fmt_or(x, fmt: str, fallback):
    return format(x, fmt) if isinstance(x, (int, float)) else fallback


def benchmark_rows(bundle: dict | None) -> list[dict]:
    """The benchmark cases of a bundle as rows with the columns a reviewer compares: base and head
    median µs, the change and the noise in percent (bundles store fractions and summary dicts)."""
    if not bundle or not isinstance(bundle.get("benchmark"), dict):
        return []
    rows = []
    for case in bundle["benchmark"].get("cases") or []:
        if not isinstance(case, dict):
            continue
        variant = case.get("variant") or case.get("shape") or {}
        base = _median_us(case.get("base_us", case.get("base")))
        head = _median_us(case.get("head_us", case.get("head")))
        diff = case.get("diff_pct", case.get("diff"))
        if diff is None and isinstance(case.get("change"), (int, float)):
            diff = 100 * case["change"]
        noise = case.get("noise_pct")
        if noise is None and isinstance(case.get("noise"), (int, float)):
            noise = 100 * case["noise"]
        rows.append({
            "case": case.get("name") or ", ".join(f"{k}={v}" for k, v in sorted(variant.items()))
                    or str(case.get("batch", "")),
            "batch": case_batch(case),
            "base": _fmt_or(base, ".2f", "–"),
            "head": _fmt_or(head, ".2f", "–"),
            "diff": _fmt_or(diff, "+.1f", "–") + ("%" if isinstance(diff, (int, float)) else ""),
            "noise": _fmt_or(noise, ".1f", "–") + ("%" if isinstance(noise, (int, float)) else ""),
            "verdict": case.get("verdict", "?"),
        })
    return rows


def case_batch(case: dict) -> int | None:
    """The batch size of a benchmark case, wherever the bundle put it."""
    for holder in (case, case.get("variant") or {}, case.get("shape") or {}):
        if isinstance(holder, dict) and isinstance(holder.get("batch"), int):
            return holder["batch"]
    return None


def render_rfc(front: FrontMatter, scope, decision, bundle: dict | None, evidence_note: str,
               bundle_path: str | None = None) -> str:
    """The RFC as Markdown: author fields verbatim (or "(not provided)"), the rest from the data."""
    not_covered = list(bundle.get("not_covered") or []) if bundle else []
    if bundle is None:
        not_covered.insert(0, "no GPU evidence: no evidence bundle was found for this change")
    return template_env().get_template("rfc.md.j2").render(
        fm=front,
        not_provided=NOT_PROVIDED,
        scope=scope.to_dict(),
        decision=decision.to_dict(),
        bundle=bundle,
        bundle_path=bundle_path,
        evidence_note=evidence_note,
        rows=benchmark_rows(bundle),
        not_covered=not_covered,
    )
