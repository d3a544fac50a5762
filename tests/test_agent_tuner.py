"""The tuner: successive halving on measured time, the decision rule, changing defaults in the op
module and the manifest, and the offline flow through measurement files."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from agent_helpers import MANIFEST, FakeBackends, git, make_repo

from agent import cli
from agent.proposers.tuner import (MEASUREMENTS_SCHEMA, Timing, config_key, decide, schedule, shape_key,
                                   sources_sha256, spread_pick, successive_halving)
from agent.tunables import TunableEditError, manifest_change_reason, rewrite_manifest_defaults
from kernels.manifest import parse_manifest

REPO_ROOT = Path(__file__).resolve().parent.parent
SPEC = parse_manifest(MANIFEST).kernel("toy")
DEFAULT = {"threads": 128, "unroll": 2}


def synthetic_time(cfg: dict, shape: dict) -> float:
    """A landscape with its optimum at threads=256, unroll=4 (15% faster than the defaults)."""
    base = 10.0 * shape["batch"] ** 0.3 * shape["n"] / 256
    penalty = 1 + 0.1 * abs(math.log2(cfg["threads"] / 256)) + 0.05 * abs(math.log2(cfg["unroll"] / 4))
    return base * penalty


def measurements_doc(fn=synthetic_time, *, sources=None, skip=(), noise=0.002, error_for=None) -> dict:
    grid = [dict(threads=t, unroll=u) for t in (64, 128, 256) for u in (1, 2, 4)]
    results = []
    for c in grid:
        for s in SPEC.shapes:
            if (c["threads"], c["unroll"]) in skip:
                continue
            t = fn(c, s)
            r = {"tunables": c, "variant": s, "cubin_sha256": "0" * 64, "median_us": t,
                 "p10_us": t * (1 - noise), "p90_us": t * (1 + noise)}
            if error_for and error_for(c, s):
                r = {"tunables": c, "variant": s, "error": "output y not fully written"}
            results.append(r)
    return {"schema": MEASUREMENTS_SCHEMA, "kernel": "toy", "sources_sha256": sources or {},
            "environment": {"gpu": "NVIDIA H200"}, "created": "2026-11-29T00:00:00+00:00", "results": results}


def table_measure(fn):
    calls = []

    def measure(configs, shapes):
        calls.append((len(configs), len(shapes)))
        return {(config_key(c), shape_key(s)): Timing(fn(c, s), 0.002) for c in configs for s in shapes}

    return measure, calls


def test_schedule_and_spread():
    assert schedule(9, 6, 2) == [1, 2, 3, 6]  # 4 rounds for 9 candidates; the last uses every shape
    assert schedule(160, 35, 4) == [1, 3, 9, 35]
    assert schedule(1, 10, 2) == [10]
    assert spread_pick(list(range(10)), 3) == [0, 4, 9]
    assert spread_pick([1, 2], 5) == [1, 2]


def test_successive_halving_finds_the_optimum_and_spends_less_than_a_full_sweep():
    grid = [dict(threads=t, unroll=u) for t in (64, 128, 256) for u in (1, 2, 4)]
    measure, calls = table_measure(synthetic_time)
    res = successive_halving(grid, list(SPEC.shapes), DEFAULT, measure, eta=2)
    assert res["ranking"][0]["tunables"] == {"threads": 256, "unroll": 4}
    evaluated = sum(c * s for c, s in calls)
    assert evaluated < len(grid) * len(SPEC.shapes)
    # Every eliminated candidate has a reason naming its round.
    assert all(r.startswith("round ") for r in res["eliminated"].values())
    assert len(res["eliminated"]) == len(grid) - len(res["ranking"])


def test_decision_requires_gain_and_no_regression():
    grid = [dict(threads=t, unroll=u) for t in (64, 128, 256) for u in (1, 2, 4)]
    shapes = list(SPEC.shapes)
    measure, _ = table_measure(synthetic_time)
    d = decide(successive_halving(grid, shapes, DEFAULT, measure), shapes, DEFAULT, min_gain_pct=2)
    assert d["chosen"] == {"threads": 256, "unroll": 4} and d["gain_pct"] > 10
    assert all(r["verdict"] in ("FAST", "SAME") for r in d["per_shape"])

    # The same winner, but 20% slower on one shape: it may not be proposed.
    def regress(c, s):
        t = synthetic_time(c, s)
        return t * 1.5 if c == {"threads": 256, "unroll": 4} and s == shapes[0] else t

    measure, _ = table_measure(regress)
    d = decide(successive_halving(grid, shapes, DEFAULT, measure), shapes, DEFAULT, min_gain_pct=2)
    assert d["chosen"] != {"threads": 256, "unroll": 4}

    # A flat landscape: the defaults are already best.
    measure, _ = table_measure(lambda c, s: 10.0 if c == DEFAULT else 10.05)
    d = decide(successive_halving(grid, shapes, DEFAULT, measure), shapes, DEFAULT, min_gain_pct=2)
    assert d["chosen"] is None and d["reason"].startswith("defaults already best")


def test_rewrite_manifest_defaults():
    with pytest.raises(TunableEditError):
        rewrite_manifest_defaults(MANIFEST, "toy", {"nope": 1})
    new = rewrite_manifest_defaults(MANIFEST, "toy", {"threads": 256, "unroll": 4})
    spec = parse_manifest(new).kernel("toy")
    assert spec.tunable_defaults() == {"threads": 256, "unroll": 4}
    assert manifest_change_reason(MANIFEST, new, "toy") is None
    # Anything beyond this kernel's defaults is a change of scope.
    role_change = MANIFEST.replace('name = "w", role = "static"', 'name = "w", role = "activation"')
    assert "params" in manifest_change_reason(MANIFEST, role_change, "toy")
    assert "choices" in manifest_change_reason(MANIFEST, MANIFEST.replace("[64, 128, 256]", "[64, 128, 512]"), "toy")
    assert "other" in manifest_change_reason(MANIFEST, MANIFEST.replace('batch = [1]\n', 'batch = [2]\n'), "toy")


def test_real_manifest_defaults_can_be_rewritten_in_place():
    """Every real kernel's tunables: each non-default choice a tuner may pick (explorer-only ones
    are never defaults) rewrites to a defaults-only change, and no source of a kernel declares
    default values of its own (a module-level dict literal keyed by tunable names): the manifest
    is the one place."""
    text = (REPO_ROOT / "kernels" / "manifest.toml").read_text()
    manifest = parse_manifest(text)
    for spec in manifest.kernels.values():
        for t in spec.tunables:
            other = next((c for c in t.tuned_choices if c != t.default), None)
            if other is None:
                continue
            new = rewrite_manifest_defaults(text, spec.name, {t.name: other})
            assert manifest_change_reason(text, new, spec.name) is None, (spec.name, t.name)
            assert parse_manifest(new).kernel(spec.name).tunable_defaults()[t.name] == other
        names = {t.name for t in spec.tunables}
        for src in spec.sources:
            tree = ast.parse((REPO_ROOT / src).read_text())
            for node in tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
                    keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                    assert not (names and keys >= names), (spec.name, src, node.lineno)


def run_tuner(repo, *extra, backends=None):
    return cli.main(["--kernel", "toy", "--proposer", "tuner", "--repo", str(repo), "--no-progress", *extra],
                    backends=backends or FakeBackends())


def only_run(repo) -> Path:
    (run_dir,) = list((repo / ".fasttrack" / "runs").iterdir())
    return run_dir


def test_tuner_commits_the_measured_best_defaults(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    m = tmp_path / "m.json"
    m.write_text(json.dumps(measurements_doc(sources=sources_sha256(repo, SPEC.sources))))
    assert run_tuner(repo, "--measurements", str(m)) == 0
    s = json.loads((only_run(repo) / "summary.json").read_text())
    branch, run_id = s["branch"], s["run_id"]
    files = sorted(git(repo, "show", "--name-only", "--format=", branch).splitlines())
    assert files == sorted(["kernels/manifest.toml", f"evidence_reports/{run_id}/rfc.toml",
                            f"evidence_reports/{run_id}/agent.json", f"evidence_reports/{run_id}/tuning.json"])
    assert parse_manifest(git(repo, "show", f"{branch}:kernels/manifest.toml")).kernel("toy").tunable_defaults() \
        == {"threads": 256, "unroll": 4}
    rfc = tomllib.loads(git(repo, "show", f"{branch}:evidence_reports/{run_id}/rfc.toml"))
    assert rfc["claim"]["speedup"] is True and "NVIDIA H200" in rfc["summary"]
    assert "'threads': 256, 'unroll': 4" not in rfc["alternatives"]  # the chosen setting is no alternative
    tuning = json.loads(git(repo, "show", f"{branch}:evidence_reports/{run_id}/tuning.json"))
    assert tuning["decision"]["chosen"] == {"threads": 256, "unroll": 4} and tuning["rounds"]


def test_tuner_reports_defaults_already_best(tmp_path):
    repo = make_repo(tmp_path / "repo")
    m = tmp_path / "m.json"
    m.write_text(json.dumps(measurements_doc(lambda c, s: 10.0 if c == DEFAULT else 11.0,
                                             sources=sources_sha256(repo, SPEC.sources))))
    assert run_tuner(repo, "--measurements", str(m)) == 1
    run_dir = only_run(repo)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "no_change" and "defaults already best" in s["reason"]
    assert s["commit"] is None and s["branch"] is None
    assert git(repo, "branch", "--list").strip() == "* main"  # a failed run leaves no branch
    tuning = json.loads((run_dir / "tuning.json").read_text())
    assert tuning["decision"]["chosen"] is None and tuning["rounds"]


def test_failed_candidates_are_eliminated_with_their_reason(tmp_path):
    repo = make_repo(tmp_path / "repo")
    m = tmp_path / "m.json"
    m.write_text(json.dumps(measurements_doc(sources=sources_sha256(repo, SPEC.sources),
                                             error_for=lambda c, s: c == {"threads": 256, "unroll": 4})))
    assert run_tuner(repo, "--measurements", str(m)) == 0
    tuning = json.loads((only_run(repo) / "tuning.json").read_text())
    reasons = tuning["eliminated"][config_key({"threads": 256, "unroll": 4})]
    assert "not fully written" in reasons
    assert tuning["decision"]["chosen"] != {"threads": 256, "unroll": 4}


def test_partial_measurements_ask_for_the_next_round(tmp_path):
    repo = make_repo(tmp_path / "repo")
    full = measurements_doc(sources=sources_sha256(repo, SPEC.sources))
    first_round = schedule(9, len(SPEC.shapes), 2)[0]
    screen = {shape_key(s) for s in spread_pick(list(SPEC.shapes), first_round)}
    partial = {**full, "results": [r for r in full["results"] if shape_key(r["variant"]) in screen]}
    m1 = tmp_path / "round0.json"
    m1.write_text(json.dumps(partial))
    assert run_tuner(repo, "--measurements", str(m1)) == 1
    run_dir = only_run(repo)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "needs_measurements" and "tune_measure.py prepare" in s["reason"]
    (req_path,) = list(run_dir.glob("tune_request_round*.json"))
    req = json.loads(req_path.read_text())
    # Round 1 asks for the survivors of round 0 on shapes not measured yet.
    assert 1 <= len(req["configs"]) < 9 and req["round"] == 1
    assert req["shapes"] and not any(shape_key(x) in screen for x in req["shapes"])
    # The rest measured (here: from the same landscape); both files together finish the search.
    rest = {**full, "results": [r for r in full["results"] if shape_key(r["variant"]) not in screen]}
    m2 = tmp_path / "round1.json"
    m2.write_text(json.dumps(rest))
    assert run_tuner(repo, "--measurements", str(m1), "--measurements", str(m2)) == 0


def test_measurements_of_other_sources_or_kernel_are_refused(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    m = tmp_path / "m.json"
    m.write_text(json.dumps(measurements_doc(sources={"kernels/ops/toy.py": "0" * 64})))
    assert run_tuner(repo, "--measurements", str(m)) == 2
    s = json.loads((only_run(repo) / "summary.json").read_text())
    assert s["outcome"] == "error" and "different kernel sources" in s["reason"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert run_tuner(repo, "--measurements", str(bad)) == 2
    assert "not valid JSON" in capsys.readouterr().err  # a failed run's reason is an error
    assert run_tuner(repo, "--measurements", str(tmp_path / "missing.json")) == 2
    assert "does not exist" in capsys.readouterr().err


def test_tuner_without_gpu_or_measurements_says_so(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    assert run_tuner(repo) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--measurements" in err
    assert not (repo / ".fasttrack").exists()


def test_tune_measure_script_imports_without_dsl_anthropic_or_git():
    code = ("import sys, runpy; sys.argv=['x','--help'];\n"
            "try:\n runpy.run_path('scripts/tune_measure.py', run_name='__main__')\n"
            "except SystemExit: pass\n"
            "bad = [m for m in ('cutlass', 'anthropic', 'git', 'agent') if m in sys.modules]\n"
            "print('BAD', bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert "BAD []" in out.stdout, out.stdout + out.stderr


def test_tune_measure_rejects_a_bad_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema": "something else"}))
    out = subprocess.run([sys.executable, "scripts/tune_measure.py", "measure", "--plan", str(plan), "--out",
                          str(tmp_path / "o.json")], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "not a tune plan" in out.stderr


def test_tune_measure_output_checks_on_cpu_tensors():
    """The measure step's checks: poison left in an output, or outputs far from the defaults'."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("tune_measure", REPO_ROOT / "scripts" / "tune_measure.py")
    tm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tm)
    ref = {"y": torch.ones(4, 8, dtype=torch.bfloat16)}
    assert tm._compare({"y": ref["y"].clone()}, ref) is None
    assert tm._compare({"y": ref["y"] * 1.01}, ref) is None  # within the agreement tolerance
    poisoned = ref["y"].clone()
    poisoned[3, 7] = float("nan")
    assert "not fully written" in tm._compare({"y": poisoned}, None)
    assert "differs from the defaults'" in tm._compare({"y": ref["y"] * 2}, ref)
    doc = {"default": DEFAULT, "results": [
        {"tunables": DEFAULT, "variant": {"batch": 1}, "median_us": 10.0},
        {"tunables": {"threads": 256, "unroll": 4}, "variant": {"batch": 1}, "median_us": 8.0},
        {"tunables": {"threads": 64, "unroll": 1}, "variant": {"batch": 1}, "error": "BuildError: x"}]}
    table = tm.format_table(doc)
    assert "0.800" in table and "ERROR" in table and "BuildError" in table


def _load_tune_measure():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tune_measure", REPO_ROOT / "scripts" / "tune_measure.py")
    tm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tm)
    return tm


def test_tune_measure_times_graph_replays_interleaved_over_rounds():
    """Every setting of a shape is timed once per round, in an order rotated and reversed between
    rounds, by the graph timer it is given; a setting whose timing raises is marked, the rest go on."""
    from benchmarks.common import Timing

    tm = _load_tune_measure()
    order: list[tuple[str, int]] = []

    def timer(launch, launches):
        name = launch(0)
        if name == "bad":
            raise RuntimeError("operation not permitted when stream is capturing")
        order.append((name, launches))
        return Timing((1.0, 2.0))

    launchers = {i: ((lambda _i, n=n: n), 20) for i, n in enumerate(["a", "b", "bad", "c"])}
    samples = tm.time_interleaved(launchers, rounds=3, timer=timer)
    assert [n for n, _ in order[:3]] == ["a", "b", "c"]  # round 0: as given
    assert [n for n, _ in order[3:6]] == ["a", "c", "b"]  # round 1: rotated by one, reversed
    assert [n for n, _ in order[6:]] == ["c", "a", "b"]  # round 2: rotated by two
    assert all(n == 20 for _, n in order)
    assert samples[0] == samples[1] == samples[3] == [1.0, 2.0] * 3
    assert isinstance(samples[2], RuntimeError)


def test_tune_measure_uses_the_graph_timer_not_stream_events():
    # The launch gap between stream launches diluted the ranking (rmsnorm 4-5 us per stream launch
    # vs 1.6-2.8 us under graph replay): the measure step must time with time_graph.
    src = (REPO_ROOT / "scripts" / "tune_measure.py").read_text()
    assert "time_graph(" in src and "time_launches(" not in src


def test_tune_measure_refuses_a_counter_left_non_zero():
    import torch

    tm = _load_tune_measure()
    ref = {"y": torch.ones(4, dtype=torch.float32)}
    assert tm._compare(ref, ref, {"counters": torch.zeros(3, dtype=torch.int32)}) is None
    left = torch.tensor([0, 1, 0], dtype=torch.int32)
    assert "left non-zero" in tm._compare(ref, ref, {"counters": left})
