"""The race audit on its own corpus: hand-written PTX per class of bug the audit must catch
(pointers loaded from task tables, publishing other threads' writes, reads after another
thread's acquire, one side of a handshake in another launch, misdeclared buffers, a step's data
read after another step's wait, a synchronizing loop whose wait and publish sit outside it) and of false alarm it must not raise (L2 prefetch, __syncwarp
before a lane's release, a lane's acquire broadcast by shfl, a wait rotated to the bottom of a
loop iteration), each bug with a correct twin. The SASS beside each PTX is what ptxas (the
build's) emits for it; tests/fixtures/race/regen_sass.py regenerates it.

Each fixture's second line declares the parameters' roles, directions, task tables and the
error rules expected in the PTX and in the SASS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from validation.race.audit import audit_ptx

HERE = Path(__file__).resolve().parent / "fixtures" / "race"
FIXTURES = sorted(HERE.glob("*.ptx"))


def _meta(ptx: Path) -> dict:
    line = ptx.read_text().splitlines()[1]
    assert line.startswith("// audit: "), ptx.name
    return json.loads(line[len("// audit: "):])


@pytest.mark.parametrize("ptx", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture_judged_right(ptx):
    meta = _meta(ptx)
    sass = ptx.with_suffix(".sass").read_text()
    rep = audit_ptx(ptx.read_text(), meta["roles"], sass_text=sass, param_names=meta["names"],
                    directions=meta["directions"], points_to=meta.get("points_to"),
                    syncs=meta.get("syncs"))
    errs = rep.errors
    in_ptx = sorted({f.rule for f in errs if f.ptx})
    in_sass = sorted({f.rule for f in errs if f.sass})
    why = [str(f) for f in rep.findings]
    assert in_ptx == sorted(meta["expect_ptx"]), why
    assert in_sass == sorted(meta["expect_sass"]), why
    assert not [f for f in rep.findings if f.rule == "unknown-provenance"], why


def test_corpus_covers_every_class_with_bugs_and_twins():
    by_class: dict[str, list[bool]] = {}
    for p in FIXTURES:
        m = _meta(p)
        by_class.setdefault(m["class"], []).append(bool(m["expect_ptx"] or m["expect_sass"]))
    assert set(by_class) >= {"loaded-pointer", "publish-others", "acquire-others", "other-launch",
                             "misdeclared", "prefetch", "step-order", "sync-loop"}
    for cls, bugs in by_class.items():
        assert any(bugs) and not all(bugs), cls  # some caught, some clean
    assert all(p.with_suffix(".sass").is_file() for p in FIXTURES)


def test_step_order_fixtures_caught_by_the_step_rule_in_both_dialects():
    """The per-step bugs are the step rule's (not an unordered load with no wait at all), in the
    PTX and in the SASS ptxas strength-reduced; their twins (an own wait, a rotated wait with the
    prologue's wait, the same ring slot) are clean."""
    steps = [p for p in FIXTURES if _meta(p)["class"] == "step-order"]
    assert len(steps) >= 8
    for p in steps:
        meta = _meta(p)
        rep = audit_ptx(p.read_text(), meta["roles"], sass_text=p.with_suffix(".sass").read_text(),
                        param_names=meta["names"], directions=meta["directions"])
        rules = {(f.rule, bool(f.ptx), bool(f.sass)) for f in rep.errors}
        if meta["expect_ptx"]:
            assert any(r == "load-before-step-wait" and x for r, x, _ in rules), p.name
            assert any(r == "load-before-step-wait" and s for r, _, s in rules), p.name
        else:
            assert not rules, (p.name, rules)
