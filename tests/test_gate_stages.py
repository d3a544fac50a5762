"""Stages as scope units: a change of a staged kernel (manifest `stages`) within one stage is
eligible and needs the kernel's bound, passing evidence; two stages, the kernel's shared code, or
the stage/points-to declarations go to full review, each with its reason."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import pytest

from validation.policy import OWN_STAGES

from gate_fixtures import (MANIFEST, commit, commit_bundle, edit_lines, make_bundle, make_repo, new_keypair, sign,
                           validator_of, write)
from validation.gate import EXIT_FAIL, EXIT_NOT_ELIGIBLE, EXIT_PASS, AuditOutcome, BuiltVariant, run_gate

MEGA = """
[kernels.mega]
description = "a persistent kernel of two stages"
op = "kernels.ops.mega:MegaOp"
reference = "kernels.reference:mega"
sources = ["kernels/ops/mega.py", "kernels/ops/mega_attn.py", "kernels/ops/mega_moe.py", "kernels/ops/mega_shared.py"]
params = [
  { name = "tasks", role = "static" },
  { name = "x", role = "activation" },
  { name = "y", role = "activation", direction = "out" },
  { name = "counters", role = "sync", direction = "inout" },
]
[kernels.mega.tunables]
unroll = { choices = [1, 2], default = 1 }
depth = { choices = [1, 2], default = 1 }
[kernels.mega.shapes]
batch = [1, 8]

[kernels.mega.points_to.tasks]
stride = 32
slots = { "0" = "activation", "8" = "static", "16" = "sync", "24" = "scalar" }

[[kernels.mega.stages]]
name = "attn"
sources = ["kernels/ops/mega_attn.py", "kernels/ops/mega_shared.py"]
reads = ["x"]
writes = ["h"]
tunables = ["unroll"]
protocol = "counters"

[[kernels.mega.stages]]
name = "moe"
sources = ["kernels/ops/mega_moe.py", "kernels/ops/mega_shared.py"]
reads = ["h"]
writes = ["y"]
protocol = "counters"
"""

SOURCE = "".join(f"LINE_{i} = {i}\n" for i in range(20))


class _Art:
    """A fake build: the code hash of mega covers the parsed form of every file of its build
    closure, that of another kernel its first source's (its code does not use the rest)."""

    def __init__(self, rq):
        from kernels.build import source_closure

        files = source_closure(rq.spec, Path(rq.repo_root)) if rq.spec.name == "mega" else rq.spec.sources[:1]
        srcs = [(Path(rq.repo_root) / s).read_bytes() for s in files]
        tag = json.dumps([rq.shape, rq.tunables], sort_keys=True).encode()
        self.kernel, self.shape, self.tunables = rq.spec.name, dict(rq.shape), dict(rq.tunables)
        self.cubin_code_sha256 = hashlib.sha256(b"".join(ast.dump(ast.parse(s)).encode() for s in srcs) + tag).hexdigest()
        self.cubin_sha256 = hashlib.sha256(b"".join(srcs) + tag).hexdigest()
        self.key, self.dir, self.cache_hit = self.cubin_sha256, None, False


def _gate(root, base, head, **kw):
    return run_gate(base, head, repo=root, code_build=lambda reqs: [_Art(r) for r in reqs],
                    auditor=lambda k, b: AuditOutcome("pass", "clean"), **kw)


@pytest.fixture()
def mega_repo(tmp_path, monkeypatch):
    # `mega` stands for a staged kernel with a validation stage of its own, as the megakernel has
    # (validation.policy.OWN_STAGES; without one, no_validation_stage sends its changes to full review)
    monkeypatch.setitem(OWN_STAGES, "mega", "validation.mega_stage")
    priv, pem = new_keypair()
    root = tmp_path / "repo"
    make_repo(root, public_key_pem=pem)
    write(root, "kernels/manifest.toml", MANIFEST + MEGA)
    write(root, "kernels/ops/mega.py", "from kernels.ops import mega_attn, mega_moe, mega_shared\n" + SOURCE)
    for m in ("mega_attn", "mega_moe", "mega_shared"):
        write(root, f"kernels/ops/{m}.py", SOURCE)
    return root, commit(root, "a staged kernel"), priv


def rules(v) -> dict[str, str]:
    return {x["rule"]: x["why"] for x in v.policy["violations"]}


def test_a_one_stage_change_is_eligible_and_needs_the_kernels_bound_evidence(mega_repo):
    root, base, priv = mega_repo
    edit_lines(root, "kernels/ops/mega_attn.py", 2)
    write(root, "tests/test_mega_attn.py", "def test_attn():\n    assert True\n")  # a companion rides along
    head = commit(root, "mega: attn stage")
    v = _gate(root, base, head)
    assert v.policy["status"] == "eligible" and v.kernels == ["mega"] and v.policy["stage"] == "attn", v.reasons
    assert any("one-stage change: stage attn of kernel mega" in n for n in v.policy["notes"])
    assert (v.status, v.exit_code) == ("fail", EXIT_FAIL)
    assert v.cause.startswith("kernel mega: no committed evidence") and "fasttrack validate mega" in v.next_command

    from gate_fixtures import built_of

    built = built_of(v)
    assert {b.kernel for b in built} == {"mega"} and len(built) == 2
    commit_bundle(root, sign(make_bundle("mega", built, base=base, validator=validator_of(root)), priv), "mega")
    v = _gate(root, base, commit(root, "evidence"))
    assert (v.status, v.exit_code) == ("pass", EXIT_PASS), v.reasons
    assert v.evidence["bound"] == {"mega": "evidence_reports/mega/bundle.json"}
    assert v.reasons[0].startswith("stage attn of kernel mega (a one-stage change): 2 variants rebuilt")

    # Evidence for another binary of the kernel does not bind.
    other = [BuiltVariant(b.kernel, b.variant, b.tunables, "0" * 64) for b in built]
    commit_bundle(root, sign(make_bundle("mega", other, base=base, validator=validator_of(root)), priv), "mega")
    v = _gate(root, base, commit(root, "evidence of another binary"))
    assert v.exit_code == EXIT_FAIL and "the evidence is for another binary" in "\n".join(v.reasons)


def _set_default(root, name, value):
    path = root / "kernels" / "manifest.toml"
    text = path.read_text()
    old = f"{name} = {{ choices = [1, 2], default = 1 }}"
    assert old in text
    path.write_text(text.replace(old, f"{name} = {{ choices = [1, 2], default = {value} }}"))


def test_a_default_change_of_a_stages_own_tunable_is_that_stages_change(mega_repo):
    """The tuner's `--stage attn` change: only `unroll`'s default, a tunable stage attn owns."""
    root, base, _ = mega_repo
    _set_default(root, "unroll", 2)
    v = _gate(root, base, commit(root, "mega: tune stage attn"), scope_only=True)
    assert v.exit_code == EXIT_PASS and "stage attn of kernel mega (a one-stage change)" in v.reasons[0], v.reasons


def test_a_default_change_of_a_kernel_wide_tunable_goes_to_full_review(mega_repo):
    root, base, _ = mega_repo
    _set_default(root, "depth", 2)
    v = _gate(root, base, commit(root, "mega: tune depth"), scope_only=True)
    assert v.exit_code == EXIT_NOT_ELIGIBLE
    why = rules(v).get("stage-unassigned", "")
    assert "tunable 'depth' belongs to none of its stages" in why, v.policy["violations"]


def test_scope_only_names_the_stage(mega_repo):
    root, base, _ = mega_repo
    edit_lines(root, "kernels/ops/mega_moe.py", 1)
    v = _gate(root, base, commit(root, "mega: moe stage"), scope_only=True)
    assert v.exit_code == EXIT_PASS and "stage moe of kernel mega (a one-stage change)" in v.reasons[0]


@pytest.mark.parametrize("files, rule, words", [
    (["kernels/ops/mega_attn.py", "kernels/ops/mega_moe.py"], "multiple-stages",
     ["kernel 'mega': the change touches 2 stages", "attn: kernels/ops/mega_attn.py", "moe: kernels/ops/mega_moe.py"]),
    (["kernels/ops/mega_shared.py"], "multiple-stages",  # shared by both stages: touches both
     ["touches 2 stages", "attn: kernels/ops/mega_shared.py", "moe: kernels/ops/mega_shared.py"]),
    (["kernels/ops/mega.py"], "stage-unassigned",
     ["kernel 'mega' is staged (attn, moe) and kernels/ops/mega.py lies in none of its stages"]),
])
def test_changes_beyond_one_stage_go_to_full_review_with_the_reason(mega_repo, files, rule, words):
    root, base, _ = mega_repo
    for f in files:
        with open(root / f, "a") as fh:
            fh.write("EXTRA = 1\n")  # a code change
    v = _gate(root, base, commit(root, "mega: more than one stage"))
    assert (v.status, v.exit_code) == ("not_eligible", EXIT_NOT_ELIGIBLE), v.reasons
    assert rule in rules(v) and v.policy["stage"] is None
    assert all(w in rules(v)[rule] for w in words), rules(v)[rule]


def test_another_kernels_source_that_the_staged_kernel_imports_lies_in_no_stage(mega_repo):
    # helper.py is beta's declared source (beta's code does not change); mega imports it, so the
    # change is mega's alone, and it lies in none of mega's stages.
    root, base, _ = mega_repo
    write(root, "kernels/ops/mega.py", "from kernels.ops import helper\n" + (root / "kernels/ops/mega.py").read_text())
    write(root, "kernels/ops/helper.py", SOURCE)
    write(root, "kernels/manifest.toml", (root / "kernels/manifest.toml").read_text().replace(
        'sources = ["kernels/ops/beta.py"]', 'sources = ["kernels/ops/beta.py", "kernels/ops/helper.py"]'))
    base = commit(root, "mega imports beta's helper")
    with open(root / "kernels/ops/helper.py", "a") as fh:
        fh.write("EXTRA = 1\n")
    v = _gate(root, base, commit(root, "helper"))
    assert v.kernels == ["mega"], v.reasons
    assert v.exit_code == EXIT_NOT_ELIGIBLE and "kernels/ops/helper.py lies in none of its stages" in rules(v)["stage-unassigned"]


def test_a_comment_in_two_stages_is_no_code_change(mega_repo):
    # The stage rules apply to the kernels the code says were touched: none here.
    root, base, _ = mega_repo
    for f in ("kernels/ops/mega_attn.py", "kernels/ops/mega_moe.py"):
        with open(root / f, "a") as fh:
            fh.write("# a comment\n")
    v = _gate(root, base, commit(root, "comments"))
    assert (v.status, v.exit_code) == ("no_code_change", EXIT_PASS), v.reasons


@pytest.mark.parametrize("edit, rule, words", [
    (('writes = ["h"]', 'writes = ["h", "z"]'), "manifest-stages",
     ["kernel 'mega': stage declarations changed (stage attn: writes)", "contract between its stages"]),
    (('protocol = "counters"\n\n[[', 'protocol = "flags"\n\n[['), "manifest-stages", ["stage attn: protocol"]),
    (('"16" = "sync"', '"16" = "activation"'), "manifest-points-to", ["kernel 'mega': points_to changed"]),
    (('tunables = ["unroll"]', 'tunables = []'), "manifest-stages", ["stage attn: tunables"]),
])
def test_stage_and_points_to_declarations_are_the_kernels_contract(mega_repo, edit, rule, words):
    root, base, _ = mega_repo
    text = (root / "kernels/manifest.toml").read_text()
    assert edit[0] in text
    write(root, "kernels/manifest.toml", text.replace(*edit, 1))
    edit_lines(root, "kernels/ops/mega_attn.py", 1)
    v = _gate(root, base, commit(root, "mega: declarations"))
    assert (v.status, v.exit_code) == ("not_eligible", EXIT_NOT_ELIGIBLE), v.reasons
    assert rule in rules(v) and all(w in rules(v)[rule] for w in words), rules(v)
    assert "manifest-tolerances" not in rules(v)  # named for what it is, not as an unknown field
