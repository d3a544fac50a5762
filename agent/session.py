"""The state one proposal run shares between the loop, its tools and its proposer: the worktree and
its scope, budgets, trajectory, progress display, and the record of every attempt.

An attempt is one candidate state of the kernel's sources: it opens with the first edit after a
check (or at the start), collects the checks run on it, and closes accepted or rejected (with the
reasons) when it is submitted, or abandoned when the run ends first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent.budget import BudgetTracker
from agent.interrupt import InterruptGuard
from agent.trajectory import Trajectory
from agent.workspace import KernelScope


class BudgetExhausted(Exception):
    """Raised between steps when a budget is reached; the message says which."""


class RunStopped(Exception):
    """The proposer ended the run without an accepted proposal; `outcome` names why."""

    def __init__(self, outcome: str, reason: str):
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


@dataclass
class Attempt:
    number: int
    files_edited: list[str] = field(default_factory=list)
    edits: int = 0
    checks: list[dict] = field(default_factory=list)  # {check, status, summary}
    verdict: str = "open"  # open | accepted | rejected | abandoned
    reasons: list[str] = field(default_factory=list)
    prediction: str = ""
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Session:
    kernel: str
    goal: str
    spec: Any  # kernels.manifest.KernelSpec
    worktree: Path
    run_dir: Path
    scope: KernelScope
    backends: Any  # agent.backends.Backends
    budget: BudgetTracker
    trajectory: Trajectory
    progress: Any  # agent.progress.Progress
    guard: InterruptGuard
    base_sha: str = ""
    repo_root: Path | None = None  # the user's repository (the base revision is read from it)
    wt: Any = None  # agent.workspace.Worktree: removed when the run commits nothing
    # The tuner may also change this kernel's tunable defaults in kernels/manifest.toml.
    tunable_edits_allowed: bool = False
    attempts: list[Attempt] = field(default_factory=list)
    best: str = ""  # one line: the best result so far
    _needs_new_attempt: bool = True

    def current_attempt(self) -> Attempt:
        if not self.attempts or self.attempts[-1].verdict != "open":
            self.attempts.append(Attempt(number=len(self.attempts) + 1))
            self.progress.update(attempt=len(self.attempts))
        return self.attempts[-1]

    def note_edit(self, path: str) -> None:
        a = self.attempts[-1] if self.attempts else None
        # An edit after checks starts a new candidate: the old one was checked and moved on from.
        if a is None or a.verdict != "open" or a.checks:
            if a is not None and a.verdict == "open":
                a.verdict = "superseded"
                a.reasons.append("edited further before submission")
            a = self.current_attempt()
        if path not in a.files_edited:
            a.files_edited.append(path)
        a.edits += 1

    def note_check(self, result) -> None:
        a = self.current_attempt()
        a.checks.append({"check": result.check, "status": result.status,
                         "summary": result.summary[:500]})

    def close_attempt(self, verdict: str, reasons: list[str], **metrics) -> Attempt:
        a = self.current_attempt()
        a.verdict = verdict
        a.reasons.extend(reasons)
        a.metrics.update(metrics)
        return a

    def check_budget(self) -> None:
        """Raise BudgetExhausted when a limit is reached (called between steps only)."""
        reason = self.budget.exhausted()
        if reason:
            raise BudgetExhausted(reason)

    def stage(self, name: str) -> None:
        self.progress.update(stage=name, **self.budget.snapshot())

    def set_best(self, text: str) -> None:
        self.best = text
        self.progress.update(best=text)
