"""One proposal run, end to end: check the request, make the isolated worktree, let the proposer
work through the tools under budgets, then commit the accepted change with its RFC front-matter and
evidence, or leave a summary of every attempt and why it was rejected.

Files a run writes (never in the user's checkout):
  <runs>/<run-id>/config.json       the run's configuration (secrets redacted)
  <runs>/<run-id>/trajectory.jsonl  every prompt, model output, tool call and result, timing, usage
  <runs>/<run-id>/summary.{json,md} outcome, budgets spent, every attempt with its verdict
  <worktrees>/<run-id>/             the git worktree on branch propose/<kernel>/<run-id>; on success
                                    its one new commit holds the kernel change and
                                    evidence_reports/<run-id>/{rfc.toml, bundle.json, report.html}
"""

from __future__ import annotations

import secrets
import shutil
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.budget import BudgetLimits, BudgetTracker
from agent.interrupt import InterruptGuard
from agent.progress import NullProgress
from agent.rfc import Proposal, render_rfc_toml
from agent.session import BudgetExhausted, RunStopped, Session
from agent.tools import Toolbox
from agent.trajectory import Redactor, Trajectory, write_json_atomic, write_text_atomic
from agent.workspace import KernelScope, WorkspaceError, branch_name, commit, create_worktree, remove_worktree

EXIT_CODES = {"committed": 0, "interrupted": 130, "api_error": 2, "error": 2}


class UserError(Exception):
    """A request the user can fix (unknown kernel, bad revision, missing key or file)."""


@dataclass
class RunConfig:
    kernel: str
    goal: str
    proposer: str = "claude"
    base: str = "HEAD"
    repo: Path = Path(".")
    runs_dir: Path | None = None  # default <repo>/.fasttrack/runs
    worktrees_dir: Path | None = None  # default <repo>/.fasttrack/worktrees
    budget: BudgetLimits = field(default_factory=BudgetLimits)
    model: str = ""
    max_tokens: int = 16000
    max_retries: int = 4
    replay_from: Path | None = None
    measurements: list[Path] | None = None
    tuner_eta: int = 2
    tuner_min_gain_pct: float = 2.0
    run_id: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, Path):
                d[k] = str(v)
            elif isinstance(v, list) and v and isinstance(v[0], Path):
                d[k] = [str(x) for x in v]
        return d


@dataclass
class RunResult:
    outcome: str  # committed | no_change | needs_measurements | rejected | no_proposal | gave_up | refused |
    #               budget_exhausted | max_tokens | context_exceeded | api_error | interrupted | error
    reason: str
    run_id: str
    run_dir: Path
    worktree: Path | None = None
    branch: str | None = None
    commit: str | None = None
    attempts: list[dict] = field(default_factory=list)
    spent: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.outcome, 1)


def new_run_id(kernel: str) -> str:
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{kernel}-{secrets.token_hex(2)}"


def load_kernel_spec(repo: Path, base: str, kernel: str):
    """The kernel's manifest entry at revision `base` (before anything is created)."""
    import git

    from kernels.manifest import ManifestError, parse_manifest

    try:
        r = git.Repo(repo)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise UserError(f"{repo} is not a git repository") from None
    try:
        text = r.git.show(f"{base}:kernels/manifest.toml")
    except git.GitCommandError:
        try:
            r.commit(base)
        except Exception:
            raise UserError(f"unknown base revision {base!r}") from None
        raise UserError(f"revision {base!r} has no kernels/manifest.toml") from None
    try:
        return parse_manifest(text).kernel(kernel)
    except ManifestError as e:
        raise UserError(str(e)) from None


def run_proposal(cfg: RunConfig, proposer, *, backends, progress=None, secrets_to_redact=()) -> RunResult:
    """Run `proposer` on `cfg.kernel` in a fresh worktree; returns what happened.

    Raises UserError before anything is written when the kernel, the base revision or the
    repository is wrong. Every other ending (success, rejection, budget, refusal, API error,
    Ctrl-C) returns a RunResult after writing the summary.
    """
    repo = Path(cfg.repo).resolve()
    spec = load_kernel_spec(repo, cfg.base, cfg.kernel)
    run_id = cfg.run_id or new_run_id(cfg.kernel)
    runs_dir = Path(cfg.runs_dir or repo / ".fasttrack" / "runs")
    wt_dir = Path(cfg.worktrees_dir or repo / ".fasttrack" / "worktrees")
    run_dir = runs_dir / run_id
    if run_dir.exists():
        raise UserError(f"run folder {run_dir} already exists")
    redactor = Redactor(secrets_to_redact)
    try:
        wt = create_worktree(repo, wt_dir / run_id, branch_name(cfg.kernel, run_id), cfg.base)
    except WorkspaceError as e:
        raise UserError(str(e)) from None
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "config.json", {**cfg.to_dict(), "run_id": run_id,
                                                "proposer_name": proposer.name,
                                                "branch": wt.branch, "base_sha": wt.base_sha}, redactor)
    progress = progress or NullProgress()
    budget = BudgetTracker(cfg.budget, model=cfg.model if proposer.name == "claude" else "")
    traj = Trajectory(run_dir / "trajectory.jsonl", redactor)
    guard = InterruptGuard()
    session = Session(
        kernel=cfg.kernel, goal=cfg.goal, spec=spec, worktree=wt.path, run_dir=run_dir, base_sha=wt.base_sha,
        scope=KernelScope(wt.path, spec.sources), backends=backends, budget=budget, repo_root=repo,
        trajectory=traj, progress=progress, guard=guard,
        tunable_edits_allowed=bool(getattr(proposer, "allows_tunable_edits", False)),
    )
    session.wt = wt
    toolbox = Toolbox(session)
    traj.event("start", run_id=run_id, kernel=cfg.kernel, goal=cfg.goal, proposer=proposer.name,
               base=wt.base_sha, branch=wt.branch, sources=list(spec.sources),
               budget=cfg.budget.to_dict())
    result = RunResult("error", "", run_id, run_dir, wt.path, wt.branch)
    try:
        with guard, progress:
            _drive(session, toolbox, proposer, cfg, run_id, result, redactor)
    finally:
        traj.close()
    return result


def _discard(wt, result: RunResult) -> None:
    """A run that committed nothing keeps only its record (the run folder): no worktree, no branch
    (the trajectory holds every edit, and a replay re-makes them)."""
    try:
        remove_worktree(wt, delete_branch=True)
    except Exception as e:  # noqa: BLE001 - the cleanup never costs the run its summary
        result.reason += f" (its worktree could not be removed: {str(e).splitlines()[0][:200]})"
    else:
        result.worktree, result.branch = None, None


def _drive(session, toolbox, proposer, cfg, run_id, result, redactor) -> None:
    """Let the proposer work, commit what it proposes, and always write the summary."""
    guard = session.guard
    try:
        try:
            proposal = proposer.run(session, toolbox)
            session.stage("committing")
            with guard.critical():
                result.commit = _commit_proposal(session, toolbox, proposal, proposer, cfg, run_id)
            result.outcome, result.reason = "committed", f"committed {result.commit[:12]} on {result.branch}"
        except RunStopped as e:
            result.outcome, result.reason = e.outcome, e.reason
        except BudgetExhausted as e:
            result.outcome, result.reason = "budget_exhausted", str(e)
        except KeyboardInterrupt:
            result.outcome, result.reason = "interrupted", "stopped by Ctrl-C; the trajectory keeps what was written"
    except KeyboardInterrupt:  # a second Ctrl-C while the first was being handled
        result.outcome, result.reason = "interrupted", "stopped by Ctrl-C"
    with guard.critical():
        if result.outcome != "committed":
            _discard(session.wt, result)
        shutil.rmtree(session.run_dir / "judge", ignore_errors=True)  # the base checkout it built
        _finish(session, result, cfg, proposer, redactor)


UNMEASURED = ("unmeasured: the trajectory it replays claims measurements but does not carry them bound "
              "to the cubin hashes this change builds, so no speedup is claimed")
CODE_IDENTICAL = ("code identical to base: every variant's cubin code hash equals the base revision's, "
                  "so the change cannot be faster and no speedup is claimed")


def _provenance(session: Session, proposer, metrics: dict) -> list[str]:
    """Why the proposal may not claim a speedup (empty when its claim stands), from the accepted
    attempt's judgement: its cubins' code hashes against the base's, and whether the measurements
    a replayed trajectory claims are bound to those cubins."""
    why = []
    if metrics.get("code_identical_to_base"):
        why.append(CODE_IDENTICAL)
    bound = getattr(proposer, "measurements_bound", None)
    built = [b for b in metrics.get("binaries", []) if b.get("kernel") == session.kernel]
    if callable(bound) and not bound(built):
        why.append(UNMEASURED)
    return why


def _commit_proposal(session: Session, toolbox: Toolbox, proposal: Proposal, proposer, cfg: RunConfig,
                     run_id: str) -> str:
    wt = session.worktree
    evidence_rel = f"evidence_reports/{run_id}"
    ev_dir = wt / evidence_rel
    accepted = next((a for a in reversed(session.attempts) if a.verdict == "accepted"), None)
    metrics = accepted.metrics if accepted else {}
    # The gate's judgement of exactly what will be committed is taken after the evidence is
    # written (it is part of the change); a refusal ends the run with its reasons.
    unclaimed = _provenance(session, proposer, metrics)
    if unclaimed:
        proposal.predicted_time_change_pct = None
        proposal.predicted_batches = None
        proposal.prediction = f"{proposal.prediction}\n\nNo speedup claimed: " + "; ".join(unclaimed)
        if UNMEASURED in unclaimed and not proposal.title.startswith("(unmeasured) "):
            proposal.title = "(unmeasured) " + proposal.title
    ev_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for key, name in (("bundle", "bundle.json"), ("report", "report.html")):
        src = metrics.get(key)
        if src and Path(src).exists():
            shutil.copyfile(src, ev_dir / name)
            copied.append(name)
    not_covered = list(metrics.get("not_covered", [])) + unclaimed
    if "bundle.json" not in copied:
        not_covered.append("no evidence bundle: it must be produced on a GPU host (`fasttrack validate`) "
                           "and committed before the gate can pass")
    extra = getattr(proposer, "extra_evidence", None)
    for name, text in ((extra() if callable(extra) else None) or {}).items():
        (ev_dir / name).write_text(session.trajectory.redactor.text(text))
        copied.append(name)
    agent_record = {
        "proposer": proposer.name,
        "model": cfg.model if proposer.name == "claude" else None,
        "run_id": run_id,
        "goal": cfg.goal,
        "base": session.base_sha,
        "turns": session.budget.spent.turns,
        "spent": session.budget.snapshot(),
        "attempts": [a.to_dict() for a in session.attempts],
        "prediction": {"time_change_pct": proposal.predicted_time_change_pct,
                       "cases": proposal.predicted_cases, "batches": proposal.predicted_batches},
        "measured": UNMEASURED not in unclaimed,
        "code_identical_to_base": CODE_IDENTICAL in unclaimed,
        "evidence": {"bundle": "bundle.json" if "bundle.json" in copied else None,
                     "report": "report.html" if "report.html" in copied else None},
        "not_covered": not_covered,
    }
    for a in agent_record["attempts"]:  # absolute paths of this machine stay out of commits
        a["metrics"] = {k: v for k, v in a.get("metrics", {}).items() if k not in ("bundle", "report")}
    write_json_atomic(ev_dir / "agent.json", agent_record, session.trajectory.redactor)
    copied.append("agent.json")
    (ev_dir / "rfc.toml").write_text(session.trajectory.redactor.text(render_rfc_toml(proposal)))
    verdict = toolbox.judge(attempt=False)
    if not verdict.ok:
        raise RunStopped("rejected", "the gate would refuse this change, so nothing was committed: "
                         + "; ".join(verdict.reasons))
    message = (
        f"{session.kernel}: {proposal.title}\n\n{proposal.summary}\n\n"
        f"Prediction: {proposal.prediction}\n"
        + "".join(f"Not-claimed: {u}\n" for u in unclaimed)
        + f"Proposed-by: propose-optimization ({proposer.name}"
        + (f", {cfg.model}" if proposer.name == "claude" else "") + f"), run {run_id}\n"
    )
    message = session.trajectory.redactor.text(message)
    files = list(verdict.files)
    for f in files:  # a secret in any encoding never reaches a commit
        p = wt / f
        if p.is_file() and not p.is_symlink() and session.trajectory.redactor.contains(
                p.read_bytes().decode("utf-8", "replace")):
            raise RunStopped("rejected", f"{f} holds a secret (the API key or a signing key, in some "
                             "encoding), so nothing was committed")
    sha = commit(wt, files, message)
    session.trajectory.event("commit", sha=sha, files=files, evidence=evidence_rel, not_claimed=unclaimed)
    return sha


def _finish(session: Session, result: RunResult, cfg: RunConfig, proposer, redactor: Redactor) -> None:
    for a in session.attempts:
        if a.verdict == "open":
            a.verdict = "abandoned"
            a.reasons.append(f"run ended before submission ({result.outcome})")
    result.attempts = [a.to_dict() for a in session.attempts]
    result.spent = session.budget.snapshot()
    repo = Path(cfg.repo).resolve()

    def rel(p):
        if p is None:
            return None
        try:
            return str(Path(p).resolve().relative_to(repo))
        except ValueError:
            return str(p)

    summary: dict[str, Any] = {
        "run_id": result.run_id, "kernel": cfg.kernel, "goal": cfg.goal, "proposer": proposer.name,
        "model": cfg.model if proposer.name == "claude" else None, "outcome": result.outcome,
        "reason": result.reason, "branch": result.branch, "worktree": rel(result.worktree),
        "commit": result.commit, "budget": cfg.budget.to_dict(), "spent": result.spent,
        "attempts": result.attempts,
    }
    extra = getattr(proposer, "summary_extra", None)
    if callable(extra):
        summary.update(extra() or {})
    evidence = getattr(proposer, "extra_evidence", None)
    for name, text in ((evidence() if callable(evidence) else None) or {}).items():
        write_text_atomic(result.run_dir / name, text, redactor)  # e.g. the tuner's search, kept on any outcome
    write_json_atomic(result.run_dir / "summary.json", summary, redactor)
    write_text_atomic(result.run_dir / "summary.md", render_summary_md(summary), redactor)
    session.trajectory.event("end", outcome=result.outcome, reason=result.reason, commit=result.commit,
                             spent=result.spent)


def clean_runs(repo: Path, runs_dir: Path | None = None) -> tuple[list[str], list[str]]:
    """Remove the worktree and branch of every run that did not commit (its record under runs/
    stays), and worktrees left without a record; returns (removed run ids, kept run ids)."""
    import json

    from agent.workspace import Worktree

    repo = Path(repo).resolve()
    runs = Path(runs_dir or repo / ".fasttrack" / "runs")
    wts = repo / ".fasttrack" / "worktrees"
    removed, kept = [], []
    for wt in sorted(wts.iterdir()) if wts.is_dir() else []:
        try:
            summary = json.loads((runs / wt.name / "summary.json").read_text())
        except (OSError, ValueError):
            summary = {}
        if summary.get("outcome") == "committed":
            kept.append(wt.name)
            continue
        try:
            cfg = json.loads((runs / wt.name / "config.json").read_text())
            branch = cfg.get("branch")
        except (OSError, ValueError):
            branch = None
        remove_worktree(Worktree(repo, wt, branch or "", ""), delete_branch=bool(branch))
        removed.append(wt.name)
    return removed, kept


def render_summary_md(s: dict) -> str:
    """A short human summary: outcome, spend, and every attempt with its verdict and reasons."""
    sp = s.get("spent", {})
    lines = [
        f"# propose-optimization run {s['run_id']}",
        "",
        f"- kernel: `{s['kernel']}`; proposer: {s['proposer']}" + (f" ({s['model']})" if s.get("model") else ""),
        f"- goal: {s['goal']}",
        f"- outcome: **{s['outcome']}**: {s['reason']}",
        f"- branch: `{s.get('branch')}`; worktree: `{s.get('worktree')}`"
        + (f"; commit `{s['commit'][:12]}`" if s.get("commit") else ""),
        f"- spent: {sp.get('turns', 0)} turns, {sp.get('input_tokens', 0)} input / "
        f"{sp.get('output_tokens', 0)} output / {sp.get('cache_read_tokens', 0)} cache-read / "
        f"{sp.get('cache_write_tokens', 0)} cache-write tokens, ~${sp.get('cost_usd', 0):.4f}, "
        f"{sp.get('elapsed_s', 0):.1f} s",
        "",
        "## Attempts",
        "",
    ]
    if not s.get("attempts"):
        lines.append("(no attempt: nothing was edited)")
    for a in s.get("attempts", []):
        files = ", ".join(a.get("files_edited", [])) or "-"
        lines.append(f"{a['number']}. **{a['verdict']}**: files {files}; {a.get('edits', 0)} edit(s)")
        for c in a.get("checks", []):
            lines.append(f"   - {c['check']}: {c['status']}")
        for r in a.get("reasons", []):
            lines.append(f"   - reason: {r.splitlines()[0][:300] if r else r}")
        if a.get("prediction"):
            lines.append(f"   - prediction: {a['prediction'][:300]}")
    for key in ("tuning",):
        if key in s:
            lines += ["", f"## {key.title()}", "", "```", _short_json(s[key]), "```"]
    return "\n".join(lines) + "\n"


def _short_json(obj) -> str:
    import json

    text = json.dumps(obj, indent=1, default=str)
    return text if len(text) < 6000 else text[:6000] + "\n..."
