"""The agent's parts on their own: the edit scope, budgets, trajectory redaction, the RFC writer,
the tools' observations, and the build seam against the real repository."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from agent_helpers import API_KEY, make_repo

from agent.backends import NO_GPU, UNAVAILABLE, RepoBackends, format_build_table
from agent.budget import BudgetError, BudgetLimits, BudgetTracker, price_for
from agent.rfc import Proposal, render_rfc_toml
from agent.trajectory import REDACTED, Redactor, Trajectory, TrajectoryError, read_trajectory
from agent.workspace import KernelScope, ScopeViolation

REPO_ROOT = Path(__file__).resolve().parent.parent


# -- scope ------------------------------------------------------------------------------------

@pytest.fixture
def scope(tmp_path):
    root = make_repo(tmp_path / "repo")
    return KernelScope(root, ["kernels/ops/toy.py"])


@pytest.mark.parametrize("path, why", [
    ("kernels/reference.py", "outside this change's scope"),
    ("kernels/manifest.toml", "outside this change's scope"),
    ("../repo/kernels/ops/toy.py", "'..'"),
    ("kernels/ops/../ops/toy.py", "'..'"),
    ("/etc/passwd", "absolute"),
    (".git/config", ".git"),
    ("", "no path"),
    ("kernels/ops/toy.py\0x", "NUL"),
])
def test_edits_outside_the_declared_sources_are_refused(scope, path, why):
    with pytest.raises(ScopeViolation, match=why.replace("(", r"\(").replace(".", r"\.").replace("'", "'")):
        scope.editable_path(path)


def test_declared_source_is_editable_and_normalised(scope):
    p, name = scope.editable_path("./kernels/ops/toy.py")
    assert name == "kernels/ops/toy.py" and p == scope.root / "kernels/ops/toy.py"


def test_symlinks_are_refused_for_reading_and_editing(scope, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("s")
    os.symlink(outside, scope.root / "kernels" / "leak.txt")
    with pytest.raises(ScopeViolation, match="symlink"):
        scope.readable("kernels/leak.txt")
    # A symlinked directory on the way to a declared source.
    (scope.root / "kernels" / "ops" / "toy.py").unlink()
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "toy.py").write_text("x = 1\n")
    os.rename(scope.root / "kernels" / "ops", scope.root / "kernels" / "ops_old")
    os.symlink(real, scope.root / "kernels" / "ops")
    with pytest.raises(ScopeViolation, match="symlink"):
        scope.editable_path("kernels/ops/toy.py")


def test_reading_is_broad_but_not_outside(scope):
    assert scope.readable("kernels/reference.py").name == "reference.py"
    with pytest.raises(ScopeViolation, match="directory"):
        scope.readable("kernels")
    with pytest.raises(ScopeViolation, match="does not exist"):
        scope.readable("nope.py")


# -- budgets ----------------------------------------------------------------------------------

def test_budget_parsing():
    b = BudgetLimits.parse(["turns=5,cost=1.5", "wall=2m", "input_tokens=none"])
    assert (b.turns, b.cost_usd, b.wall_s, b.input_tokens) == (5, 1.5, 120.0, None)
    assert BudgetLimits.parse(["wall=1h"]).wall_s == 3600
    for bad in ("turns", "speed=3", "turns=-1", "cost=abc"):
        with pytest.raises(BudgetError):
            BudgetLimits.parse([bad])


def test_budget_charging_and_cost():
    now = [0.0]
    t = BudgetTracker(BudgetLimits(turns=3, cost_usd=None, wall_s=100), model="claude-opus-5-5",
                      clock=lambda: now[0])
    cost = t.charge({"input_tokens": 1_000_000, "output_tokens": 0, "cache_read_input_tokens": 1_000_000,
                     "cache_creation_input_tokens": 1_000_000})
    (inp, _out), known = price_for("claude-opus-5-5")
    assert known and cost == pytest.approx(inp * (1 + 0.1 + 1.25))
    assert t.exhausted() is None
    now[0] = 101.0
    assert "wall-clock 101 s of 100 s" in t.exhausted()
    now[0] = 0.0
    t.charge({"input_tokens": 1, "output_tokens": 1})
    t.charge({"input_tokens": 1, "output_tokens": 1})
    assert t.exhausted() == "budget reached: turns 3 of 3 turns"
    # Unknown models are charged at the highest listed rate, and snapshots use their alias's price.
    assert price_for("claude-opus-5-5-20260601") == price_for("claude-opus-5-5")
    assert price_for("some-new-model")[1] is False


# -- trajectories -----------------------------------------------------------------------------

def test_redaction_of_keys_env_secrets_and_secret_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-1234567890")
    r = Redactor([API_KEY])
    path = tmp_path / "t.jsonl"
    with Trajectory(path, r) as t:
        t.event("x", text=f"key {API_KEY} and tok-1234567890 and sk-ant-other-key-abcdefghij",
                headers={"x-api-key": "anything", "Authorization": "Bearer z"}, n=3)
    written = path.read_text()
    for s in (API_KEY, "tok-1234567890", "sk-ant-other", "Bearer z", "anything"):
        assert s not in written
    ev = read_trajectory(path)[0]
    assert ev["kind"] == "x" and ev["n"] == 3 and ev["headers"]["x-api-key"] == REDACTED


def test_read_trajectory_errors(tmp_path):
    p = tmp_path / "t.jsonl"
    with pytest.raises(TrajectoryError, match="cannot read"):
        read_trajectory(p)
    p.write_text("not json\n")
    with pytest.raises(TrajectoryError, match=":1: not a JSON line"):
        read_trajectory(p)
    p.write_text("")
    with pytest.raises(TrajectoryError, match="empty"):
        read_trajectory(p)


# -- RFC --------------------------------------------------------------------------------------

def test_rfc_front_matter_round_trips_awkward_text():
    p = Proposal.from_tool_input({
        "title": 'quote " back\\slash \t tab', "summary": "line1\nline2 ✓", "motivation": "m",
        "design": "d", "prediction": "p", "risks": "r", "rollback": "b", "predicted_time_change_pct": 5,
    })
    doc = tomllib.loads(render_rfc_toml(p))
    assert doc["title"] == 'quote " back\\slash \t tab' and doc["summary"] == "line1\nline2 ✓"
    assert doc["claim"] == {"speedup": False}  # +5% time is no speedup claim
    assert "alternatives" not in doc  # not provided: left out, never invented
    with pytest.raises(ValueError, match="missing required field"):
        Proposal.from_tool_input({"title": "t"})
    with pytest.raises(ValueError, match="predicted_batches"):
        Proposal.from_tool_input({**{f: "x" for f in ("title", "summary", "motivation", "design", "prediction",
                                                      "risks", "rollback")}, "predicted_batches": ["a"]})


# -- backends seam ----------------------------------------------------------------------------

def test_repo_backends_without_gpu_say_so(tmp_path):
    b = RepoBackends()
    b._gpu = False
    v = b.validate(REPO_ROOT, "gemv", tmp_path)
    assert v.status == NO_GPU and "NOT run" in v.summary
    assert b.benchmark(REPO_ROOT, "gemv", tmp_path).status == NO_GPU


def test_repo_backends_time_against_the_base_revision(tmp_path, monkeypatch):
    # What the child `fasttrack validate` is asked: --base <the session's base> for both checks;
    # the benchmark falls back to the torch path only when no base is known.
    import subprocess

    seen: list[list[str]] = []

    def fake_run(args, *, root, write):
        seen.append(args)
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "bundle.json").write_text('{"verdict": "pass"}')
        return subprocess.CompletedProcess(args, 0, "", "")

    b = RepoBackends()
    b._gpu = True
    monkeypatch.setattr(b, "_run_sandboxed", fake_run)
    assert b.validate(REPO_ROOT, "rmsnorm", tmp_path / "v", base="abc123").ok
    assert b.benchmark(REPO_ROOT, "rmsnorm", tmp_path / "b", base="abc123").ok
    assert b.benchmark(REPO_ROOT, "rmsnorm", tmp_path / "t").ok
    v, bench, torch_bench = seen
    assert v[v.index("--base") + 1] == "abc123" and "--require-gpu" in v
    assert bench[bench.index("--base") + 1] == "abc123" and "--quick" in bench
    assert torch_bench[torch_bench.index("--base") + 1] == "torch"


def test_build_table_names_resources():
    table = format_build_table([{"variant": {"batch": 1}, "cubin_sha256": "ab" * 32,
                                 "resources": {"registers": 40, "spill_store_bytes": 0, "spill_load_bytes": 0,
                                               "static_smem_bytes": 128, "dynamic_smem_bytes": 0}}])
    assert "batch=1 | 40 | 0/0 | 128+0 | abababababab" in table


def test_progress_display_shows_turn_stage_and_best():
    import io

    from agent.progress import Progress

    plain = io.StringIO()
    with Progress("toy / tuner", stream=plain, live=False) as p:
        p.update(turn=2, stage="build (quick)")
        p.update(turn=2, stage="build (quick)")  # unchanged stage: no new line
        p.update(stage="static audit")
    assert plain.getvalue().splitlines() == ["[toy / tuner] turn 2: build (quick)", "[toy / tuner] turn 2: static audit"]
    live = io.StringIO()
    with Progress("toy / claude", stream=live, live=True) as p:
        p.update(turn=7, stage="validate", best="attempt 2 accepted", cost_usd=0.25)
    out = live.getvalue()
    assert "validate" in out and "attempt 2 accepted" in out and "$0.250" in out


@pytest.mark.slow
def test_build_and_audit_seam_against_the_real_repository():
    """The seam drives the repository's real kernels/build.py (compile children sandboxed) and the
    gate's static audit in a child process (one variant of one real kernel, then every variant
    for the audit; cache hits after the first run)."""
    from kernels.manifest import load_manifest

    manifest = load_manifest()
    name = "rmsnorm" if "rmsnorm" in manifest.kernels else sorted(manifest.kernels)[0]
    spec = manifest.kernel(name)
    b = RepoBackends(timeout_s=600)
    r = b.build(REPO_ROOT, name, [spec.shapes[0]])
    assert r.status == "ok", r.summary
    (built,) = r.data["built"]
    assert len(built["cubin_sha256"]) == 64 and built["resources"]["registers"] > 0
    assert f"| {built['resources']['registers']} |" in r.summary
    a = b.audit(REPO_ROOT, name)
    assert a.status == "ok" and f"clean on {len(spec.shapes)} variants" in a.summary
