"""`fasttrack rfc`: the RFC rendered from the change, its evidence and the author's front-matter."""

from __future__ import annotations

import pytest

from gate_fixtures import (commit, commit_bundle, edit_lines, fake_builder, make_bundle, make_repo,
                           new_keypair, sign, write)
from validation import cli
from validation.rfc import FIELDS, FrontMatterError, parse_front_matter

SECTIONS = ("## Summary", "## Motivation", "## Design", "## Scope and invariants touched",
            "## Predicted versus measured effect", "## Risks and mitigations", "## Rollback triggers",
            "## Rejected alternatives", "## What validation did not cover", "## Unresolved questions")

FULL = """\
title = "alpha: two rows per warp"
summary = "Process two rows per warp."
motivation = "Batch 1 is latency bound."
design = "Each warp owns two rows; loads are 16-byte vectors."
prediction = "5% faster at batch 1, same elsewhere."
risks = "Register pressure at batch 64."
rollback = "Any SLOW case in the nightly matrix."
alternatives = "Split-K: needs cross-CTA sync."
questions = "Does it hold on H100?"
[claim]
speedup = true
batches = [1]
"""


@pytest.fixture()
def repo(tmp_path):
    priv, pem = new_keypair()
    root = tmp_path / "repo"
    base = make_repo(root, public_key_pem=pem)
    return root, base, priv


def rfc(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main(["rfc", *args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_full_front_matter_and_evidence(repo, capsys):
    root, base, priv = repo
    edit_lines(root, "kernels/ops/alpha.py", 2)
    commit_bundle(root, sign(make_bundle("alpha", fake_builder(root)("alpha"), base=base, verdicts={1: "FAST"}), priv))
    write(root, "kernels/ops/rfc.toml", FULL)
    head = commit(root, "alpha")
    rc, out, _ = rfc(capsys, "--base", base, "--head", head, "--repo", str(root))
    assert rc == 0
    assert out.startswith("# RFC: alpha: two rows per warp")
    positions = [out.index(s) for s in SECTIONS]
    assert positions == sorted(positions)  # every section, in order
    for text in ("Process two rows per warp.", "5% faster at batch 1", "Does it hold on H100?",
                 "Claimed: a speedup at batch 1.", "| **FAST** |", "signature verified",
                 "`kernels/ops/alpha.py`: modified, +2 −2"):
        assert text in out
    assert "(not provided)" not in out


def test_missing_fields_are_not_invented(repo, capsys, tmp_path):
    root, base, _ = repo
    edit_lines(root, "kernels/ops/alpha.py", 1)
    head = commit(root, "alpha")
    fm = tmp_path / "fm.toml"
    fm.write_text('title = "only a title"\n')
    out_file = tmp_path / "RFC.md"
    rc, out, _ = rfc(capsys, "--base", base, "--head", head, "--repo", str(root),
                     "--front-matter", str(fm), "--out", str(out_file))
    text = out_file.read_text()
    assert rc == 0 and "wrote" in out
    assert text.count("(not provided)") == len(FIELDS) - 1
    assert "no GPU evidence: no evidence bundle was found for this change" in text
    assert "Measured: nothing (no evidence bundle for this change)." in text


def test_ineligible_change_lists_the_broken_rules(repo, capsys):
    root, base, _ = repo
    write(root, "kernels/reference.py", "def alpha(x):\n    return -x\n")
    head = commit(root, "ref")
    rc, out, _ = rfc(capsys, "--base", base, "--head", head, "--repo", str(root))
    assert rc == 0 and "**full review**" in out
    assert "- `protected-path` `kernels/reference.py`: the pure-torch reference" in out


@pytest.mark.parametrize("text, message", [
    ('title = "x"\nauthor = "me"\n', "unknown field(s) author"),
    ("title = [1]\n", "title must be a string"),
    ("title = \n", "not valid TOML"),
    ('[claim]\nspeedup = "yes"\n', "claim.speedup must be true or false"),
    ("[claim]\nbatches = [0]\n", "claim.batches must be a non-empty list of positive integers"),
])
def test_malformed_front_matter(text, message):
    with pytest.raises(FrontMatterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_front_matter(text, "rfc.toml")


def test_bad_input_exits_2(repo, capsys, tmp_path):
    root, base, _ = repo
    rc, _, err = rfc(capsys, "--base", "nope", "--repo", str(root))
    assert rc == 2 and "'nope' does not name a commit" in err
    rc, _, err = rfc(capsys, "--base", base, "--repo", str(root), "--front-matter", str(tmp_path / "none.toml"))
    assert rc == 2 and "cannot read front-matter" in err
    write(root, "a/rfc.toml", 'title = "a"\n')
    write(root, "b/rfc.toml", 'title = "b"\n')
    rc, _, err = rfc(capsys, "--base", base, "--repo", str(root))  # working tree
    assert rc == 2 and "several rfc.toml files (a/rfc.toml, b/rfc.toml)" in err
