"""scripts/explore_common.py: the exploration scripts' shared CPU step (build, audit, carry)."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import explore_common  # noqa: E402


@pytest.mark.slow
def test_build_and_carry_writes_what_a_gpu_call_loads(tmp_path):
    """Two real variants: each carried as kernel.cubin + meta.json (enough for
    CubinKernel.from_dir) with its audit verdict, and a plan naming the commit and the command;
    a second run replaces the carry folder instead of mixing the two."""
    pytest.importorskip("cutlass")
    from kernels.launch import CubinKernel

    carry = tmp_path / "carry"
    variants = [("rms_a", "rmsnorm", {"batch": 1, "width": 3584}, {}),
                ("rms_b", "rmsnorm", {"batch": 2, "width": 3584}, {})]
    assert explore_common.build_and_carry(variants, build_root=tmp_path / "build", carry=carry,
                                          command="python x.py plan", extra={"batches": [1, 2]}) == 0
    plan = explore_common.read_plan(carry)
    assert plan["command"] == "python x.py plan" and plan["batches"] == [1, 2] and len(plan["commit"]) == 40
    ents = explore_common.entries(carry)
    assert set(ents) == {"rms_a", "rms_b"}
    for ident, e in ents.items():
        assert sorted(p.name for p in (carry / ident).iterdir()) == ["kernel.cubin", "meta.json"]
        assert e["static_audit"] == {"clean": True, "rules": []} and e["kernel"] == "rmsnorm"
        assert CubinKernel.from_dir(carry / ident).sha256 == e["cubin_sha256"]
        assert e["grid"] == e["launch"]["grid"]
    explore_common.build_and_carry(variants[:1], build_root=tmp_path / "build", carry=carry, command="again")
    assert set(explore_common.entries(carry)) == {"rms_a"}
    assert json.loads((carry / "plan.json").read_text())["command"] == "again"


def test_run_sanitizers_records_every_tool_and_judges_by_summary_and_markers(tmp_path, monkeypatch):
    """With a stand-in sanitizer that runs the child and prints a clean summary: each tool's
    verdict lands in res["sanitizers"], clean only when every expected marker ran ok; the log
    gets every tool's output. Without any sanitizer every tool is recorded as not clean."""
    from validation.race import dynamic
    from validation.race.dynamic import marker

    child = tmp_path / "child.py"
    child.write_text("import sys\nif sys.argv[1:] == ['child']:\n    print(%r)\n    print(%r)\n"
                     % (marker("k_a", True), marker("k_b", True)))
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Version 2099.1'; exit 0; fi\n"
                    "for last; do :; done\n"
                    "for a; do case \"$a\" in *.py) script=$a;; esac; done\n"
                    "python3 \"$script\" child\n"
                    "echo '========= ERROR SUMMARY: 0 errors'\n"
                    "echo '========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(dynamic, "find_sanitizer", lambda: str(fake))
    res = {}
    explore_common.run_sanitizers(res, str(child), ["k_a", "k_b"], tmp_path)
    assert set(res["sanitizers"]) == set(dynamic.TOOLS) and res["sanitizer"]["version"] == ["Version 2099.1"]
    assert all(r["clean"] for r in res["sanitizers"].values()), res["sanitizers"]
    missing = {}
    explore_common.run_sanitizers(missing, str(child), ["k_a", "k_c"], tmp_path)
    assert not any(r["clean"] for r in missing["sanitizers"].values())
    import re

    headers = re.findall(r"^===== (\w+):", (tmp_path / "sanitizers.log").read_text(), re.M)
    assert headers == list(dynamic.TOOLS) * 2
    monkeypatch.setattr(dynamic, "find_sanitizer", lambda: None)
    none = {}
    explore_common.run_sanitizers(none, str(child), ["k_a"], tmp_path)
    assert none["sanitizer"] == {"path": None, "version": None}
    assert not any(r["clean"] for r in none["sanitizers"].values())


def test_a_failed_build_leaves_the_previous_carry_whole(tmp_path, monkeypatch):
    """build_and_carry builds before it touches the carry folder: when a build raises, the
    carry from before (plan.json and the variant folders) is still there, unchanged."""
    from kernels import build as kbuild

    carry = tmp_path / "carry"
    (carry / "old").mkdir(parents=True)
    (carry / "plan.json").write_text('{"entries": [{"id": "old"}]}')

    def broken(*a, **k):
        raise kbuild.BuildError("compile error at kernels/ops/x.py:1")

    monkeypatch.setattr(kbuild, "build_variant", broken)
    with pytest.raises(kbuild.BuildError):
        explore_common.build_and_carry([("v", "rmsnorm", {"batch": 1, "width": 3584}, {})],
                                       build_root=tmp_path / "b", carry=carry, command="x")
    assert (carry / "old").is_dir() and explore_common.entries(carry) == {"old": {"id": "old"}}


def test_measure_keeps_what_was_measured_when_the_sweep_raises(tmp_path, monkeypatch):
    """The gpu skeleton: plan facts and the ceiling recorded, the sweep's partial results and
    its traceback kept in the JSON, sanitize still run, exit 1; a clean sweep exits 0."""
    import benchmarks.common as bc

    carry = tmp_path / "carry"
    carry.mkdir()
    (carry / "plan.json").write_text(json.dumps({"commit": "c" * 40, "dirty": False, "entries": [{"id": "v"}]}))
    monkeypatch.setattr(bc, "gpu_environment", lambda: {"gpu": "test"})
    monkeypatch.setattr(bc, "read_bandwidth", lambda reps=10: {"tbps": 4.5})
    ran = []

    def sweep(res, path, read_tbps):
        res["k3"] = {"v": read_tbps}
        raise RuntimeError("launch failed")

    rc = explore_common.measure("scripts/x.py", carry, tmp_path / "out", "x", sweep,
                                lambda res, out: ran.append(out))
    doc = json.loads((tmp_path / "out" / "x.json").read_text())
    assert rc == 1 and doc["k3"] == {"v": 4.5} and "launch failed" in doc["error"] and ran
    assert doc["commit"] == "c" * 40 and doc["variants"] == [{"id": "v"}]
    assert explore_common.measure("scripts/x.py", carry, tmp_path / "out2", "x", lambda *a: None) == 0


def test_routing_inputs_at_the_shapes_batch():
    """One routing per call at the shape's batch (1 when it names none): ids of top_k distinct
    experts per token, bf16 z, weights positive and renormalised per token; same generator
    seed, same draw."""
    import torch

    shape = {"batch": 3, "n_experts": 64, "latent": 32, "top_k": 8}
    ids, z, wts = explore_common.routing_inputs(shape, "hot", torch.Generator().manual_seed(1), "cpu")
    assert ids.shape == (3, 8) and z.shape == (3, 32) and z.dtype == torch.bfloat16
    assert all(len(set(r.tolist())) == 8 for r in ids) and int(ids.max()) < 64
    assert torch.allclose(wts.sum(-1), torch.ones(3)) and bool((wts > 0).all())
    again = explore_common.routing_inputs(shape, "hot", torch.Generator().manual_seed(1), "cpu")
    assert all(torch.equal(a, b) for a, b in zip((ids, z, wts), again))
    one = explore_common.routing_inputs({k: v for k, v in shape.items() if k != "batch"}, "uniform",
                                        torch.Generator().manual_seed(2), "cpu")
    assert one[0].shape == (1, 8)


def test_no_commit_is_one_line_and_builds_nothing(tmp_path, monkeypatch, capsys):
    """Where git cannot name the commit (not a checkout, git missing), build_and_carry says so in
    one line and returns 2 before building anything; the previous carry stays whole."""
    from kernels import build as kbuild

    carry = tmp_path / "carry"
    (carry / "old").mkdir(parents=True)
    built = []
    monkeypatch.setattr(kbuild, "build_variant", lambda *a, **k: built.append(a))

    def no_git(*args):
        raise RuntimeError("git rev-parse HEAD failed: fatal: not a git repository")

    monkeypatch.setattr(explore_common, "_git", no_git)
    rc = explore_common.build_and_carry([("v", "rmsnorm", {"batch": 1, "width": 3584}, {})],
                                        build_root=tmp_path / "b", carry=carry, command="x")
    assert rc == 2 and built == [] and (carry / "old").is_dir()
    assert capsys.readouterr().err == ("explore: cannot record the commit: git rev-parse HEAD failed: "
                                       "fatal: not a git repository\n")
