"""`fasttrack validate megakernel` (validation/mega_stage.py) without a GPU: the bundle from a
recorded run, the policy's view of a kernel with its own stage, the CLI's refusals, the model
check the plan carries."""

from __future__ import annotations

import json

import pytest

from kernels.manifest import load_manifest
from kernels.taskgraph import MEGA_STAGES
from validation import mega_stage as M
from validation.policy import OWN_STAGES, no_validation_stage, own_stage

BASE, HEAD = "b" * 40, "a" * 40


def _plan(batches=(1, 2)):
    return {"schema": M.MEGA_SCHEMA, "kernel": "megakernel", "base": {"ref": "main", "sha": BASE,
                                                                      "sources_sha256": {"kernels/x.py": "0" * 64}},
            "head": {"sha": HEAD, "dirty": False},
            "variants": [{"variant": {"batch": T}, **{s: {"dir": f"megakernel/{s}{T}", "tunables": {"watchdog": 1},
                                                        "build_key": f"{s}{T}", "cubin_sha256": f"{s}{T}".ljust(64, "0"),
                                                        "table": [[[0, 0, 0, 0]]]}
                                                     for s in ("head", "base")}} for T in batches],
            "chain": [{"batch": T, "cases": [{"kernel": "rmsnorm", "shape": {"batch": T}, "dir": "rmsnorm/x",
                                              "cubin_sha256": "c" * 64}]} for T in batches],
            "static_race_audit": {"passed": True, "variants": len(batches), "findings": []},
            "model_check": {"passed": True, "cases": [], "not_covered": "k3 widths"}}


def _row(T, head_us=300.0, base_us=300.0, chain_us=330.0, err=1e-3, chain_err=1e-3):
    judged = {"kernel": {"max_abs": 0.01, "rel_fro": err}, "rel_fro_limit": 4e-3, "passed": err <= 4e-3}
    return {"numerics": {
        "routings": [{"what": f"block {r}", "routing": r, **judged} for r in M.ROUTINGS],
        "chain": {"what": "error against the chain's (same input)", "passed": err <= 1.1 * chain_err},
        "stress": {"launches": M.STRESS_LAUNCHES, "differing": 0, "counters_clean": True, "passed": True},
        "passed": err <= 4e-3 and err <= 1.1 * chain_err},
        "speed": {"calls": 8, "bytes_per_step": 1.5e9, "graph": True, "unique_experts_per_step": [16] * 8,
                  "samples_us": {"head": [head_us * (1 + i * 1e-4) for i in range(8)],
                                 "base": [base_us * (1 + i * 1e-4) for i in range(8)],
                                 "chain": [chain_us * (1 + i * 1e-4) for i in range(8)]}},
        "timeline": {"batch": T, "unit": "ns", "stages": list(MEGA_STAGES), "spans": [[0, 0, 10, 20]]}}


def _result(rows):
    return {"environment": {"gpu": "test"}, "ceilings": {"read": {"tbps": 5.0}, "copy": {"tbps": 4.0}},
            "batches": {str(T): r for T, r in rows.items()}, "policy": {}}


def _bundle(plan, result, **kw):
    return M.mega_bundle(plan, result, {"name": "megakernel", "ok": True}, validator=("v" * 64, {}), **kw)


def test_a_clean_run_is_a_passing_bundle_with_the_chain_beside_each_case_and_the_timelines():
    b = _bundle(_plan(), _result({1: _row(1), 2: _row(2)}))
    assert b["verdict"] == "pass", b["reasons"]
    cases = b["benchmark"]["cases"]
    assert [c["verdict"] for c in cases] == ["SAME", "SAME"]
    assert all(c["chain"]["verdict"] == "FAST" and c["chain"]["speedup"] == pytest.approx(1.1) for c in cases)
    assert b["benchmark"]["baseline"] == {"kind": "revision", "sha": BASE, "ref": "main"}
    assert [t["batch"] for t in b["timeline"]] == [1, 2]
    assert b["race"]["model_check"]["passed"] and b["race"]["stress"]["passed"]
    assert {(x["side"], x["variant"]["batch"]) for x in b["binaries"]} == {(s, T) for s in ("head", "base") for T in (1, 2)}
    assert b["change"]["base_sources_sha256"] == {"kernels/x.py": "0" * 64}
    assert any("race.dynamic" in n for n in b["not_covered"])


@pytest.mark.parametrize("row,words", [
    (_row(1, err=1e-2), "correctness: failed"),
    (_row(1, err=2e-3, chain_err=1e-3), "correctness: failed"),
    (_row(1, head_us=400.0), "SLOW"),
    ({"error": "CUDA error: illegal instruction"}, "not measured"),
])
def test_a_failing_batch_fails_the_bundle_with_its_reason(row, words):
    b = _bundle(_plan((1,)), _result({1: row}))
    assert b["verdict"] == "fail" and any(words in r for r in b["reasons"]), b["reasons"]


def test_a_batch_the_run_never_reached_is_not_covered_and_a_plan_without_its_model_check_fails():
    plan = _plan()
    b = _bundle(plan, _result({1: _row(1)}))
    assert any("megakernel batch 2: not measured" in n for n in b["not_covered"])
    del plan["model_check"]
    b = _bundle(plan, _result({1: _row(1), 2: _row(2)}))
    assert b["verdict"] == "fail" and any("model check" in r for r in b["reasons"])


def test_the_megakernel_has_its_own_stage_and_another_task_table_kernel_has_none():
    spec = load_manifest().kernel("megakernel")
    assert spec.points_to is not None and no_validation_stage(spec) is None
    assert own_stage("megakernel") is M and OWN_STAGES == {"megakernel": "validation.mega_stage"}
    import dataclasses

    other = dataclasses.replace(spec, name="another_persistent")
    assert "task table" in no_validation_stage(other) and own_stage("another_persistent") is None


def test_the_cli_refuses_without_a_plan_and_with_an_unreadable_one(tmp_path, capsys):
    from validation.cli import main

    assert main(["validate", "megakernel"]) == 2
    assert "runs from a plan" in capsys.readouterr().err
    assert main(["validate", "megakernel", "--prepare"]) == 2
    assert "--base REV" in capsys.readouterr().err
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"schema": "other"}))
    rc = main(["validate", "megakernel", "--plan", str(bad), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and ("not a megakernel plan" in err or "no CUDA device" in err)
    assert not (tmp_path / "out").exists()


def test_prepare_builds_head_with_the_tunables_it_is_given(tmp_path, monkeypatch, capsys):
    """`validate megakernel --base REV --prepare --tunables N=V` builds head with them (a variant
    against the base's defaults), as for any kernel; the megakernel's own stage used to drop them
    and build the defaults on both sides."""
    import validation.validate as V
    from validation.cli import main

    seen = {}

    def stop(kernel, base, **kw):
        seen.update(kernel=kernel, tunables=kw.get("tunables"))
        raise V.ValidateError("stopped here")

    monkeypatch.setattr(V, "prepare_base_plan", stop)
    rc = main(["validate", "megakernel", "--base", "HEAD", "--prepare", "--tunables", "stream_cta_kib=28",
               "--build-root", str(tmp_path)])
    assert rc == 2 and "stopped here" in capsys.readouterr().err
    assert seen == {"kernel": "megakernel", "tunables": {"stream_cta_kib": 28}}


def test_the_model_check_the_plan_carries_passes_on_the_shipped_graph_code():
    r = M.model_check()
    assert r["passed"] and len(r["cases"]) == len(M.MODEL_CHECKS)
    assert all(c["complete"] for c in r["cases"] if c["mode"] == "exhaustive")


def test_a_megakernel_plan_presigns_like_a_kernel_plan():
    from validation.validate import presign_problems

    plan = _plan()
    b = _bundle(plan, _result({1: _row(1), 2: _row(2)}))
    assert presign_problems(b, plan, merge_base=BASE) == []
    plan["variants"][0]["head"]["cubin_sha256"] = "f" * 64
    assert any("not in the bundle" in p for p in presign_problems(b, plan))


def test_the_bundles_binaries_carry_the_plans_code_hashes():
    """A plan entry with a code sha256 gives its binary one (the evidence then binds a rebuild
    whose line tables alone moved); an older plan's entry without one gives none."""
    plan = _plan()
    plan["variants"][0]["head"]["cubin_code_sha256"] = "d" * 64
    got = {(x["side"], x["variant"]["batch"]): x.get("cubin_code_sha256") for x in M.binaries(plan)}
    assert got == {("head", 1): "d" * 64, ("base", 1): None, ("head", 2): None, ("base", 2): None}
