"""The Claude proposer end to end: the real `anthropic` client over a scripted HTTP transport (no
network), a temporary git repository with a toy kernel, and fake build/validate backends."""

from __future__ import annotations

import json
import os
import tomllib

import pytest
from agent_helpers import (API_KEY, TOY_SOURCE, FakeBackends, ScriptedAPI, all_written_text, error_response, git,
                           make_repo, message, text, tool_use, usage)

from agent import cli
from agent.backends import FAILED, CheckResult, RepoBackends
from agent.proposers.claude import DEFAULT_MODEL, MODEL_ENV

EDIT = {"path": "kernels/ops/toy.py", "old_str": "    for v in x:\n        acc += v\n    return acc\n",
        "new_str": "    return sum(x)\n"}
SUBMIT = {
    "title": "toy: sum with the builtin",
    "summary": "Replace the Python loop by sum().",
    "motivation": "The loop is slow.",
    "design": "One call instead of a loop.",
    "prediction": "Median time 30% lower at every batch.",
    "predicted_time_change_pct": -30,
    "predicted_batches": [1, 8],
    "risks": "None known.",
    "rollback": "Any SLOW verdict.",
}


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    monkeypatch.delenv(MODEL_ENV, raising=False)
    return make_repo(tmp_path / "repo")


def run(repo, api, *extra, backends=None):
    argv = ["--kernel", "toy", "--goal", "make it faster", "--repo", str(repo), "--no-progress", *extra]
    return cli.main(argv, backends=backends or FakeBackends(), http_client=api.client())


def summary(repo) -> dict:
    (run_dir,) = list((repo / ".fasttrack" / "runs").iterdir())
    return json.loads((run_dir / "summary.json").read_text())


def trajectory(repo) -> list[dict]:
    (run_dir,) = list((repo / ".fasttrack" / "runs").iterdir())
    return [json.loads(line) for line in (run_dir / "trajectory.jsonl").read_text().splitlines()]


def tool_results(request: dict) -> list[dict]:
    last = request["messages"][-1]
    return [b for b in last["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]


def test_successful_proposal_ends_in_one_commit(repo, capsys):
    api = ScriptedAPI([
        message([text("Let me read the kernel."), tool_use("view_file", {"path": "kernels/ops/toy.py"}, "t1")],
                u=usage(1000, 50, cache_write=900), n=1),
        message([tool_use("edit_file", EDIT, "t2")], u=usage(50, 80, cache_read=900), n=2),
        message([tool_use("build", {"scope": "quick"}, "t3")], n=3),
        message([tool_use("submit_proposal", SUBMIT, "t4")], n=4),
    ])
    assert run(repo, api) == 0
    out = capsys.readouterr().out
    assert out.startswith("committed:")

    # The request carried the stable prefix marked for caching, the default model, and tool results.
    first = api.requests[0]
    assert first["model"] == DEFAULT_MODEL
    assert first["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert first["tools"][-1]["cache_control"] == {"type": "ephemeral"}
    assert first["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert "kernels/ops/toy.py" in first["messages"][0]["content"][0]["text"]
    (viewed,) = tool_results(api.requests[1])
    assert viewed["tool_use_id"] == "t1" and not viewed["is_error"] and "TUNABLES" in viewed["content"]
    # The assistant turn is sent back verbatim before the results.
    assert api.requests[1]["messages"][-2]["content"][1]["id"] == "t1"
    # Only the moving breakpoint of the latest message: earlier messages lose theirs.
    assert "cache_control" not in json.dumps(api.requests[1]["messages"][:-1])

    s = summary(repo)
    assert s["outcome"] == "committed" and s["spent"]["turns"] == 4
    assert s["spent"]["cache_read_tokens"] == 900 and s["spent"]["cache_write_tokens"] == 900
    wt = repo / s["worktree"]
    branch = s["branch"]
    # Exactly one commit on the new branch, holding the kernel change and its RFC + agent record.
    assert git(repo, "rev-list", "--count", f"main..{branch}") == "1"
    files = git(repo, "show", "--name-only", "--format=", branch).splitlines()
    run_id = s["run_id"]
    assert sorted(files) == sorted(["kernels/ops/toy.py", f"evidence_reports/{run_id}/rfc.toml",
                                    f"evidence_reports/{run_id}/agent.json"])
    assert "return sum(x)" in git(repo, "show", f"{branch}:kernels/ops/toy.py")
    rfc = tomllib.loads(git(repo, "show", f"{branch}:evidence_reports/{run_id}/rfc.toml"))
    assert rfc["title"] == SUBMIT["title"] and rfc["claim"] == {"speedup": True, "batches": [1, 8]}
    assert "-30.0%" in rfc["prediction"]
    # The gate's own parser reads it.
    from validation.rfc import parse_front_matter

    fm = parse_front_matter(git(repo, "show", f"{branch}:evidence_reports/{run_id}/rfc.toml"), "rfc.toml")
    assert fm.claim.speedup and fm.fields["risks"] == "None known."
    agent_rec = json.loads(git(repo, "show", f"{branch}:evidence_reports/{run_id}/agent.json"))
    assert any("no evidence bundle" in n for n in agent_rec["not_covered"])
    assert str(repo) not in json.dumps(agent_rec)  # no absolute path of this machine in a commit
    # The user's checkout is untouched.
    assert (repo / "kernels" / "ops" / "toy.py").read_text() == TOY_SOURCE
    assert git(repo, "status", "--porcelain") == ""
    assert wt.is_dir()


def test_validate_and_benchmark_are_timed_against_the_session_base(repo):
    # The gate takes only bundles timed against the change's base revision, so every GPU check the
    # agent runs names the commit its worktree started from.
    base_sha = git(repo, "rev-parse", "HEAD")
    backends = FakeBackends(gpu=True)
    api = ScriptedAPI([
        message([tool_use("edit_file", EDIT, "t1")], n=1),
        message([tool_use("benchmark", {}, "t2")], n=2),
        message([tool_use("validate", {}, "t3")], n=3),
        message([tool_use("submit_proposal", SUBMIT, "t4")], n=4),
    ])
    assert run(repo, api, backends=backends) == 0
    gpu_calls = [c for c in backends.calls if c[0] in ("validate", "benchmark")]
    assert [c[0] for c in gpu_calls] == ["benchmark", "validate", "validate"]  # the last: the submission's
    assert {c[2] for c in gpu_calls} == {base_sha}


def test_edit_outside_scope_is_refused_and_the_model_told_why(repo, tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_text("secret = 1\n")
    wt_link_target = "kernels/ops/link.py"
    api = ScriptedAPI([
        message([tool_use("edit_file", {"path": "kernels/reference.py", "old_str": "sum(x)", "new_str": "0"}, "a"),
                 tool_use("edit_file", {"path": "kernels/ops/../reference.py", "old_str": "sum", "new_str": "0"}, "b"),
                 tool_use("edit_file", {"path": str(outside), "old_str": "1", "new_str": "2"}, "c"),
                 tool_use("view_file", {"path": ".git/config"}, "d"),
                 tool_use("edit_file", {"path": wt_link_target, "old_str": "1", "new_str": "2"}, "e")], n=1),
        message([tool_use("give_up", {"reason": "scope too narrow"}, "f")], "tool_use", n=2),
    ])
    assert run(repo, api) == 1
    results = {r["tool_use_id"]: r for r in tool_results(api.requests[1])}
    assert all(r["is_error"] for r in results.values())
    assert "outside this change's scope" in results["a"]["content"] and "kernels/ops/toy.py" in results["a"]["content"]
    assert "'..'" in results["b"]["content"]
    assert "absolute" in results["c"]["content"]
    assert ".git" in results["d"]["content"]
    assert outside.read_text() == "secret = 1\n"
    s = summary(repo)
    assert s["outcome"] == "gave_up" and "scope too narrow" in s["reason"]
    assert (repo / "kernels" / "reference.py").read_text() == "def toy(x):\n    return sum(x)\n"
    assert s["worktree"] is None and s["branch"] is None  # a failed run keeps only its record


def test_symlinked_source_is_refused(repo):
    # A declared source that is a symlink (here: to the reference) must not be written through.
    import os

    toy = repo / "kernels" / "ops" / "toy.py"
    toy.unlink()
    os.symlink("../reference.py", toy)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "symlink")
    api = ScriptedAPI([
        message([tool_use("edit_file", {"path": "kernels/ops/toy.py", "old_str": "sum(x)", "new_str": "0"}, "a")]),
        message([tool_use("give_up", {"reason": "symlink"}, "b")]),
    ])
    assert run(repo, api) == 1
    (r,) = tool_results(api.requests[1])
    assert r["is_error"] and "symlink" in r["content"]
    assert (repo / "kernels" / "reference.py").read_text() == "def toy(x):\n    return sum(x)\n"


def test_tool_error_goes_back_and_the_model_recovers(repo):
    broken = {"path": "kernels/ops/toy.py", "old_str": "    return acc\n", "new_str": "    return acc +\n"}
    fix = {"path": "kernels/ops/toy.py", "old_str": "    return acc +\n", "new_str": "    return acc + 0\n"}
    api = ScriptedAPI([
        message([tool_use("edit_file", broken, "t1")], n=1),
        message([tool_use("build", {}, "t2")], n=2),
        message([tool_use("edit_file", {**fix, "old_str": "no such text"}, "t3")], n=3),
        message([tool_use("edit_file", fix, "t4"), tool_use("no_such_tool", {}, "t5")], n=4),
        message([tool_use("submit_proposal", SUBMIT, "t6")], n=5),
    ])
    assert run(repo, api) == 0
    (build_result,) = tool_results(api.requests[2])
    assert build_result["is_error"] and "kernels/ops/toy.py:10" in build_result["content"]
    (not_found,) = tool_results(api.requests[3])
    assert not_found["is_error"] and "not found" in not_found["content"]
    r4 = {r["tool_use_id"]: r for r in tool_results(api.requests[4])}
    assert not r4["t4"]["is_error"] and r4["t5"]["is_error"] and "unknown tool" in r4["t5"]["content"]
    s = summary(repo)
    verdicts = [a["verdict"] for a in s["attempts"]]
    assert verdicts == ["superseded", "accepted"]  # the broken build, then the fix


def test_rejected_submission_is_explained_then_run_ends(repo):
    nc = {"path": "kernels/ops/toy.py", "old_str": "    return acc\n", "new_str": "    return acc  # ld.global.nc\n"}
    api = ScriptedAPI([
        message([tool_use("submit_proposal", SUBMIT, "t0")], n=0),  # empty change
        message([tool_use("edit_file", nc, "t1")], n=1),
        message([tool_use("submit_proposal", {"title": "x"}, "t2")], n=2),  # incomplete
        message([tool_use("submit_proposal", SUBMIT, "t3")], n=3),  # audit finding
        message([text("I cannot fix this.")], "end_turn", n=4),
        message([text("Still nothing.")], "end_turn", n=5),
        message([text("Done.")], "end_turn", n=6),
    ])
    assert run(repo, api) == 1
    (empty,) = tool_results(api.requests[1])
    assert empty["is_error"] and "empty" in empty["content"]
    (incomplete,) = tool_results(api.requests[3])
    assert incomplete["is_error"] and "missing required field" in incomplete["content"]
    (audit,) = tool_results(api.requests[4])
    assert audit["is_error"] and "NC_ON_ACTIVATION" in audit["content"]
    # end_turn without a submission: nudged twice, then the run ends.
    assert "without calling submit_proposal" in api.requests[5]["messages"][-1]["content"][-1]["text"]
    s = summary(repo)
    assert s["outcome"] == "no_proposal"
    assert [a["verdict"] for a in s["attempts"]] == ["rejected", "rejected"]
    assert "empty" in s["attempts"][0]["reasons"][0] and "static audit" in s["attempts"][1]["reasons"][0]
    md = (repo / ".fasttrack" / "runs" / s["run_id"] / "summary.md").read_text()
    assert "rejected" in md and "static audit" in md


def test_max_tokens_stop_sends_errors_for_cut_calls_and_continues(repo):
    api = ScriptedAPI([
        message([text("Here is a long"), tool_use("edit_file", {"path": "kernels/ops/toy.py"}, "t1")],
                "max_tokens", n=1),
        message([tool_use("give_up", {"reason": "enough"}, "t2")], n=2),
    ])
    assert run(repo, api, "--max-tokens", "64") == 1
    assert api.requests[0]["max_tokens"] == 64
    last = api.requests[1]["messages"][-1]["content"]
    assert last[0]["type"] == "tool_result" and last[0]["tool_use_id"] == "t1" and last[0]["is_error"]
    assert "max_tokens" in last[0]["content"] and "cut off" in last[1]["text"]
    # The cut call was not executed.
    assert not any(e["kind"] == "tool_call" and e["name"] == "edit_file" for e in trajectory(repo))
    assert summary(repo)["outcome"] == "gave_up"


def test_repeated_max_tokens_ends_the_run(repo):
    api = ScriptedAPI([message([text("a")], "max_tokens", n=i) for i in range(3)])
    assert run(repo, api) == 1
    s = summary(repo)
    assert s["outcome"] == "max_tokens" and "3 times" in s["reason"]


def test_refusal_ends_the_run_without_commit(repo):
    api = ScriptedAPI([message([tool_use("edit_file", EDIT, "t1")], n=1),
                       message([], "refusal", n=2)])
    assert run(repo, api) == 1
    s = summary(repo)
    assert s["outcome"] == "refused" and s["commit"] is None
    assert len(api.requests) == 2
    # A failed run leaves no branch and no worktree; its record keeps the edit (a replay re-makes it).
    assert s["branch"] is None and s["worktree"] is None
    assert git(repo, "branch", "--list").strip() == "* main"
    assert not any((repo / ".fasttrack" / "worktrees").iterdir())
    traj = (repo / ".fasttrack" / "runs" / s["run_id"] / "trajectory.jsonl").read_text()
    assert "return sum(x)" in traj
    assert s["attempts"][0]["verdict"] == "abandoned"


def test_pause_turn_resends_the_conversation(repo):
    api = ScriptedAPI([message([text("thinking...")], "pause_turn", n=1),
                       message([tool_use("give_up", {"reason": "x"}, "t1")], n=2)])
    assert run(repo, api) == 1
    assert api.requests[1]["messages"][-1]["role"] == "assistant"
    assert api.requests[1]["messages"][-1]["content"][0]["text"] == "thinking..."


@pytest.mark.parametrize("budget, reason", [
    ("turns=2", "turns 2 of 2"),
    ("output_tokens=100", "output tokens"),
    ("cost=0.001", "estimated cost"),
    ("cache_read_tokens=500", "cache-read tokens"),
])
def test_budget_exhaustion_ends_the_run_with_a_summary(repo, budget, reason):
    api = ScriptedAPI([message([tool_use("view_file", {"path": "kernels/ops/toy.py"}, f"t{i}")],
                               u=usage(100, 60, cache_read=300), n=i) for i in range(10)])
    assert run(repo, api, "--budget", budget) == 1
    s = summary(repo)
    assert s["outcome"] == "budget_exhausted" and reason in s["reason"]
    assert len(api.requests) < 10
    # The trajectory ends with a whole line and the end event.
    assert trajectory(repo)[-1]["kind"] == "end"


def test_transient_529_is_retried(repo):
    api = ScriptedAPI([
        error_response(529, "overloaded_error", headers={"retry-after-ms": "5"}),
        error_response(429, "rate_limit_error", headers={"retry-after-ms": "5"}),
        message([tool_use("give_up", {"reason": "ok"}, "t1")], n=1),
    ])
    assert run(repo, api) == 1
    assert len(api.requests) == 3
    assert [h["x-stainless-retry-count"] for h in api.headers] == ["0", "1", "2"]  # the SDK's own retries
    assert summary(repo)["outcome"] == "gave_up"


def test_persistent_overload_ends_with_a_clear_reason(repo, capsys):
    api = ScriptedAPI([error_response(529, "overloaded_error", "Overloaded", headers={"retry-after-ms": "5"})] * 3)
    assert run(repo, api, "--max-retries", "2") == 2
    assert len(api.requests) == 3  # one try and two retries
    s = summary(repo)
    assert s["outcome"] == "api_error" and "529 overloaded_error" in s["reason"]


def test_model_id_from_flag_and_env(repo, monkeypatch):
    api = ScriptedAPI([message([tool_use("give_up", {"reason": "x"}, "t")])])
    monkeypatch.setenv(MODEL_ENV, "claude-sonnet-5-5")
    run(repo, api)
    assert api.requests[0]["model"] == "claude-sonnet-5-5"
    api2 = ScriptedAPI([message([tool_use("give_up", {"reason": "x"}, "t")])])
    run(repo, api2, "--model", "claude-haiku-4-5")
    assert api2.requests[0]["model"] == "claude-haiku-4-5"


def test_api_key_never_reaches_a_written_file(repo, monkeypatch):
    # The model even echoes something key-shaped and the key itself; neither may be written.
    api = ScriptedAPI([
        message([text(f"my key is {API_KEY}"), tool_use("edit_file", EDIT, "t1")], n=1),
        message([tool_use("submit_proposal", {**SUBMIT, "summary": f"uses {API_KEY}"}, "t2")], n=2),
    ])
    assert run(repo, api) == 0
    # It was used, on the wire only (as x-api-key or a bearer token, depending on the SDK).
    assert API_KEY in (api.headers[0].get("x-api-key", "") + api.headers[0].get("authorization", ""))
    s = summary(repo)
    written = all_written_text(repo / ".fasttrack" / "runs", repo / s["worktree"] / "evidence_reports")
    assert "[REDACTED]" in written
    assert API_KEY not in written
    assert API_KEY not in git(repo, "log", "-p", "--all")


def test_missing_key_and_unknown_kernel_are_clear_errors(tmp_path, monkeypatch, capsys):
    repo = make_repo(tmp_path / "r")
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    assert cli.main(["--kernel", "toy", "--goal", "g", "--repo", str(repo)], backends=FakeBackends()) == 2
    assert "ANTHROPIC_API_KEY is not set" in capsys.readouterr().err
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    assert cli.main(["--kernel", "nope", "--goal", "g", "--repo", str(repo)], backends=FakeBackends()) == 2
    err = capsys.readouterr().err
    assert "unknown kernel 'nope'" in err and "toy" in err
    assert cli.main(["--kernel", "toy", "--goal", "g", "--repo", str(repo), "--base", "nosuchrev"],
                    backends=FakeBackends()) == 2
    assert "unknown base revision" in capsys.readouterr().err
    assert cli.main(["--kernel", "toy", "--goal", "g", "--repo", str(repo), "--budget", "turns=x"],
                    backends=FakeBackends()) == 2
    assert "not a number" in capsys.readouterr().err
    # Nothing was created for the failed requests.
    assert not (repo / ".fasttrack").exists()
    assert git(repo, "branch", "--list").strip() == "* main"
    assert os.listdir(repo / "kernels" / "ops") == os.listdir(repo / "kernels" / "ops")


def test_a_secret_printed_by_a_check_never_reaches_the_model(repo, monkeypatch):
    # The build imports the proposed kernel's Python, so model-written code runs there: whatever
    # it prints (the API key from the environment, a signing key it read from disk) comes back in
    # a tool result. The child gets no secret-named variables, and the result is redacted.
    pem = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIFAKEFAKEFAKEFAKE\n-----END PRIVATE KEY-----"

    class Leaky(FakeBackends):
        def build(self, root, kernel, shapes=None, tunables=None):
            return CheckResult("build", FAILED, f"BuildError: kernels/ops/toy.py:1: {API_KEY} {pem}")

    api = ScriptedAPI([
        message([tool_use("build", {"scope": "quick"}, "t1")], n=1),
        message([tool_use("give_up", {"reason": "done"}, "t2")], n=2),
    ])
    run(repo, api, backends=Leaky())
    (res,) = tool_results(api.requests[1])
    assert res["is_error"] and "kernels/ops/toy.py:1" in res["content"]
    assert API_KEY not in res["content"] and "MC4CAQAw" not in res["content"]

    monkeypatch.setenv("FASTTRACK_SIGNING_KEY", "/keys/runner.pem")
    proc = RepoBackends()._run_trusted(["-c", "import os; print(os.environ.get('ANTHROPIC_API_KEY'), "
                                            "os.environ.get('FASTTRACK_SIGNING_KEY'), 'PATH' in os.environ)"])
    assert proc.stdout.split() == ["None", "None", "True"]
