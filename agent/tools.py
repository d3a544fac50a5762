"""The proposer's tools (SWE-agent style: view, search, exact search/replace edit, named checks).

`TOOL_DEFINITIONS` are the Messages API tool schemas; `Toolbox.call(name, input, call_id)` runs
one, logs the call and its result to the trajectory and returns a `ToolOutcome`. A tool that cannot
do what was asked (a path outside the scope, an edit whose text is not found, a compile error, no
GPU) returns `is_error=True` with the reason, which the Claude proposer sends back as the
tool_result. Observations are truncated so one call cannot flood the context.
"""

from __future__ import annotations

import fnmatch
import re
import time
from dataclasses import dataclass
from pathlib import Path

from agent.backends import FAILED, NO_GPU, OK, UNAVAILABLE, CheckResult
from agent.rfc import REQUIRED_FIELDS, Proposal
from agent.session import Session
from agent.workspace import ScopeViolation, diff_numstat, diff_text, write_file_atomic

MAX_OBSERVATION_CHARS = 12000
MAX_VIEW_LINES = 400
MAX_SEARCH_HITS = 60


@dataclass
class ToolOutcome:
    content: str
    is_error: bool = False
    proposal: Proposal | None = None  # set when a submission was accepted
    give_up: str | None = None  # set when the proposer gave up (the reason)


def _truncate(text: str, limit: int = MAX_OBSERVATION_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n...[truncated: {len(text) - limit} more characters]"


_PATH = {"type": "string", "description": "Path relative to the repository root."}

TOOL_DEFINITIONS: list[dict] = [
    {
        "name": "view_file",
        "description": "Show a file of the repository with line numbers (at most 400 lines per call).",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": _PATH,
                "start_line": {"type": "integer", "minimum": 1},
                "end_line": {"type": "integer", "minimum": 1},
            },
            "required": ["path"],
        },
    },
    {
        "name": "search",
        "description": "Search the repository's files for a regular expression; returns path:line: text.",
        "input_schema": {
            "type": "object",
            "properties": {
                "pattern": {"type": "string", "description": "Python regular expression."},
                "glob": {"type": "string", "description": "Only files matching this glob, e.g. 'kernels/**/*.py'."},
            },
            "required": ["pattern"],
        },
    },
    {
        "name": "edit_file",
        "description": (
            "Replace one exact occurrence of old_str with new_str in one of the kernel's declared "
            "source files (the only files you may edit). old_str must match exactly once, including "
            "whitespace; include enough surrounding lines to make it unique."
        ),
        "input_schema": {
            "type": "object",
            "properties": {"path": _PATH, "old_str": {"type": "string"}, "new_str": {"type": "string"}},
            "required": ["path", "old_str", "new_str"],
        },
    },
    {
        "name": "show_diff",
        "description": "Show the current change against the base revision (unified diff) and its line counts.",
        "input_schema": {"type": "object", "properties": {}},
    },
    {
        "name": "build",
        "description": (
            "Compile the kernel (CuTe DSL -> PTX/cubin for sm_90a) and run the static race audit. "
            "Reports compile errors with the source line, registers, spills and shared memory per "
            "variant, and audit findings. scope 'quick' builds a few representative variants, 'all' "
            "every validation shape."
        ),
        "input_schema": {
            "type": "object",
            "properties": {"scope": {"type": "string", "enum": ["quick", "all"]}},
        },
    },
    {
        "name": "validate",
        "description": (
            "Run the validator on a GPU: numerics against the float64 oracle over every validation "
            "shape, adversarial defences and the race audit. Without a local GPU it says so."
        ),
        "input_schema": {"type": "object", "properties": {}},
    },
    {
        "name": "benchmark",
        "description": "Time the kernel against the base revision on a local GPU. Without one it says so.",
        "input_schema": {"type": "object", "properties": {}},
    },
    {
        "name": "submit_proposal",
        "description": (
            "Submit the current change as the proposal. It is accepted only if it is non-empty, "
            "confined to the kernel's sources, builds for every variant and passes the static audit "
            "(and validation when a GPU is present). The text fields become the RFC. State a "
            "measurable prediction: what should move, by how much, for which shapes."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "summary": {"type": "string"},
                "motivation": {"type": "string"},
                "design": {"type": "string"},
                "prediction": {"type": "string", "description": "What should move and by how much."},
                "predicted_time_change_pct": {
                    "type": "number",
                    "description": "Expected change of median kernel time in percent (negative = faster).",
                },
                "predicted_cases": {"type": "string", "description": "Which shapes/batches the prediction covers."},
                "predicted_batches": {
                    "type": "array", "items": {"type": "integer"},
                    "description": "Batch sizes where a speedup is claimed (omit: every measured batch).",
                },
                "risks": {"type": "string"},
                "rollback": {"type": "string", "description": "What measurement would trigger a rollback."},
                "alternatives": {"type": "string"},
                "questions": {"type": "string"},
            },
            "required": list(REQUIRED_FIELDS) + ["predicted_time_change_pct"],
        },
    },
    {
        "name": "give_up",
        "description": "End the run without a proposal, saying why.",
        "input_schema": {"type": "object", "properties": {"reason": {"type": "string"}}, "required": ["reason"]},
    },
]


MANIFEST = "kernels/manifest.toml"

# Not offered to the model (tunable defaults are the tuner's): enabled only when the session allows
# tunable edits, i.e. for the tuner and for replays of its trajectories.
SET_TUNABLE_DEFAULTS = {
    "name": "set_tunable_defaults",
    "description": "Set the kernel's tunable defaults in its manifest entry (the one place they are declared).",
    "input_schema": {
        "type": "object",
        "properties": {"values": {"type": "object"}},
        "required": ["values"],
    },
}


def _base_text(worktree: Path, path: str, base: str = "HEAD") -> str:
    import git

    return git.Repo(worktree).git.show(f"{base}:{path}")


def quick_shapes(shapes: tuple[dict, ...] | list[dict]) -> list[dict]:
    """A few representative variants: first, middle and last of the manifest's order."""
    shapes = list(shapes)
    idx = sorted({0, len(shapes) // 2, len(shapes) - 1})
    return [shapes[i] for i in idx if 0 <= i < len(shapes)]


class Toolbox:
    """Runs the tools against one session's worktree."""

    def __init__(self, session: Session):
        self.s = session
        self._handlers = {
            "view_file": self._view_file,
            "search": self._search,
            "edit_file": self._edit_file,
            "show_diff": self._show_diff,
            "build": self._build,
            "validate": self._validate,
            "benchmark": self._benchmark,
            "submit_proposal": self._submit,
            "give_up": self._give_up,
        }
        if session.tunable_edits_allowed:
            self._handlers["set_tunable_defaults"] = self._set_tunable_defaults

    @property
    def definitions(self) -> list[dict]:
        return TOOL_DEFINITIONS

    def call(self, name: str, tool_input: dict, call_id: str = "") -> ToolOutcome:
        """Run one tool (budget checked first); the call and its outcome go to the trajectory."""
        self.s.check_budget()
        self.s.trajectory.event("tool_call", id=call_id, name=name, input=tool_input)
        self.s.stage(f"tool: {name}")
        t0 = time.monotonic()
        handler = self._handlers.get(name)
        if handler is None:
            out = ToolOutcome(f"unknown tool {name!r}; tools are: {', '.join(self._handlers)}", True)
        elif not isinstance(tool_input, dict):
            out = ToolOutcome("tool input must be a JSON object", True)
        else:
            try:
                out = handler(tool_input)
            except ScopeViolation as e:
                out = ToolOutcome(f"refused: {e}", True)
            except (KeyError, TypeError, ValueError) as e:
                out = ToolOutcome(f"bad input for {name}: {e}", True)
        # The result goes back to the model: a secret that a check printed (a kernel's Python runs
        # in the build) is redacted here as it is in the trajectory.
        out.content = _truncate(self.s.trajectory.redactor.text(out.content))
        self.s.trajectory.event(
            "tool_result", id=call_id, name=name, is_error=out.is_error, content=out.content,
            elapsed_s=round(time.monotonic() - t0, 3),
            accepted=out.proposal is not None, give_up=out.give_up,
        )
        return out

    # -- reading -----------------------------------------------------------------------------
    def _view_file(self, inp: dict) -> ToolOutcome:
        p = self.s.scope.readable(inp["path"])
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            return ToolOutcome(f"{inp['path']} is not a text file", True)
        start = max(1, int(inp.get("start_line") or 1))
        end = int(inp.get("end_line") or (start + MAX_VIEW_LINES - 1))
        end = min(end, len(lines), start + MAX_VIEW_LINES - 1)
        if start > max(len(lines), 1):
            return ToolOutcome(f"{inp['path']} has {len(lines)} lines; start_line {start} is past the end", True)
        body = "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(start, end + 1))
        more = f"\n[lines {start}-{end} of {len(lines)}]" if end < len(lines) or start > 1 else ""
        return ToolOutcome(body + more)

    def _search(self, inp: dict) -> ToolOutcome:
        try:
            rx = re.compile(inp["pattern"])
        except re.error as e:
            return ToolOutcome(f"bad regular expression: {e}", True)
        glob = inp.get("glob") or "*"
        root = self.s.scope.root
        hits: list[str] = []
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith((".git/", "build/")) or rel == ".git" or path.is_symlink() or not path.is_file():
                continue
            if not (fnmatch.fnmatch(rel, glob) or fnmatch.fnmatch(rel, glob.replace("**/", ""))):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for i, line in enumerate(text.splitlines(), 1):
                if rx.search(line):
                    hits.append(f"{rel}:{i}: {line.strip()[:200]}")
                    if len(hits) >= MAX_SEARCH_HITS:
                        return ToolOutcome("\n".join(hits) + f"\n[stopped at {MAX_SEARCH_HITS} matches]")
        return ToolOutcome("\n".join(hits) if hits else "no matches")

    # -- editing -----------------------------------------------------------------------------
    def _edit_file(self, inp: dict) -> ToolOutcome:
        path, name = self.s.scope.editable_path(inp["path"])
        old, new = inp["old_str"], inp["new_str"]
        if not isinstance(old, str) or not isinstance(new, str):
            return ToolOutcome("old_str and new_str must be strings", True)
        if not old:
            return ToolOutcome("old_str is empty; quote the exact text to replace", True)
        if old == new:
            return ToolOutcome("old_str and new_str are identical; nothing to change", True)
        text = path.read_text(encoding="utf-8")
        n = text.count(old)
        if n == 0:
            return ToolOutcome(
                f"old_str not found in {name}; it must match the file exactly (whitespace included). "
                "View the file and copy the text.", True)
        if n > 1:
            return ToolOutcome(f"old_str occurs {n} times in {name}; include more context so it is unique", True)
        new = self.s.trajectory.redactor.text(new)  # a secret never reaches a source file
        new_text = text.replace(old, new, 1)
        with self.s.guard.critical():
            write_file_atomic(path, new_text)
        self.s.note_edit(name)
        first = text[: text.index(old)].count("\n") + 1
        lines = new_text.splitlines()
        lo, hi = max(1, first - 3), min(len(lines), first + new.count("\n") + 3)
        snippet = "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(lo, hi + 1))
        stat = diff_numstat(self.s.worktree)
        added = sum(a for a, _ in stat.values())
        deleted = sum(d for _, d in stat.values())
        return ToolOutcome(f"edited {name} (lines {lo}-{hi} now):\n{snippet}\n"
                           f"change so far: +{added} -{deleted} lines")

    def _set_tunable_defaults(self, inp: dict) -> ToolOutcome:
        from agent.tunables import TunableEditError, manifest_change_reason, rewrite_manifest_defaults

        values = inp["values"]
        if not isinstance(values, dict) or not values:
            return ToolOutcome("values must be a non-empty object {tunable: value}", True)
        declared = {t.name: t for t in self.s.spec.tunables}
        for k, v in values.items():
            if k not in declared:
                return ToolOutcome(f"{k!r} is not a declared tunable of {self.s.kernel} "
                                   f"({', '.join(declared) or 'none'})", True)
            if v not in declared[k].choices:
                return ToolOutcome(f"{k}={v!r} is not one of its choices {list(declared[k].choices)}", True)
        wt = self.s.worktree
        manifest_path = wt / MANIFEST
        try:
            new_manifest = rewrite_manifest_defaults(manifest_path.read_text(), self.s.kernel, values)
            why = manifest_change_reason(_base_text(wt, MANIFEST, self.s.base_sha or "HEAD"), new_manifest,
                                         self.s.kernel)
            if why:
                return ToolOutcome(f"refused: {why}", True)
        except TunableEditError as e:
            return ToolOutcome(f"cannot set defaults: {e}", True)
        with self.s.guard.critical():
            write_file_atomic(manifest_path, new_manifest)
        self.s.note_edit(MANIFEST)
        return ToolOutcome(f"set {values} in {MANIFEST}")

    def _show_diff(self, inp: dict) -> ToolOutcome:
        d = diff_text(self.s.worktree)
        stat = diff_numstat(self.s.worktree)
        head = ", ".join(f"{p} +{a} -{d_}" for p, (a, d_) in stat.items()) or "no change"
        return ToolOutcome(f"{head}\n{d}" if d else "no change against the base revision")

    # -- checks ------------------------------------------------------------------------------
    def _record(self, result: CheckResult) -> CheckResult:
        self.s.note_check(result)
        self.s.trajectory.event("check", **result.to_dict())
        return result

    def _build(self, inp: dict) -> ToolOutcome:
        scope = inp.get("scope") or "quick"
        if scope not in ("quick", "all"):
            return ToolOutcome("scope must be 'quick' or 'all'", True)
        shapes = quick_shapes(self.s.spec.shapes) if scope == "quick" else None
        self.s.stage(f"build ({scope})")
        b = self._record(self.s.backends.build(self.s.worktree, self.s.kernel, shapes))
        if b.status != OK:
            return ToolOutcome(f"build {b.status}:\n{b.summary}", True)
        self.s.stage("static audit")
        a = self._record(self.s.backends.audit(self.s.worktree, self.s.kernel))
        audit_text = {OK: "static audit: clean", FAILED: "static audit: FINDINGS", UNAVAILABLE:
                      "static audit: not available in this revision (not run)"}.get(a.status, a.status)
        return ToolOutcome(f"build ok ({scope})\n{b.summary}\n\n{audit_text}\n{a.summary if a.status != OK else ''}".rstrip(),
                           is_error=a.status == FAILED)

    def _validate(self, inp: dict) -> ToolOutcome:
        self.s.stage("validate")
        r = self._record(self.s.backends.validate(self.s.worktree, self.s.kernel, self.s.run_dir / "validate",
                                                  base=self.s.base_sha or None))
        return ToolOutcome(f"validate {r.status}:\n{r.summary}", is_error=r.status != OK)

    def _benchmark(self, inp: dict) -> ToolOutcome:
        self.s.stage("benchmark")
        r = self._record(self.s.backends.benchmark(self.s.worktree, self.s.kernel, self.s.run_dir / "benchmark",
                                                   base=self.s.base_sha or None))
        return ToolOutcome(f"benchmark {r.status}:\n{r.summary}", is_error=r.status != OK)

    # -- ending ------------------------------------------------------------------------------
    def _give_up(self, inp: dict) -> ToolOutcome:
        reason = str(inp.get("reason") or "").strip() or "(no reason given)"
        return ToolOutcome("understood: the run ends without a proposal", give_up=reason)

    def _submit(self, inp: dict) -> ToolOutcome:
        try:
            proposal = Proposal.from_tool_input(inp)
        except ValueError as e:
            return ToolOutcome(f"submission incomplete: {e}", True)
        reasons, notes, evidence = self.evaluate_candidate()
        attempt_metrics = {"not_covered": notes, **evidence}
        if reasons:
            a = self.s.close_attempt("rejected", reasons, **attempt_metrics)
            a.prediction = proposal.prediction
            self.s.trajectory.event("attempt", **a.to_dict())
            return ToolOutcome("submission rejected:\n- " + "\n- ".join(reasons), True)
        a = self.s.close_attempt("accepted", [], **attempt_metrics)
        a.prediction = proposal.prediction
        self.s.trajectory.event("attempt", **a.to_dict())
        self.s.set_best(f"attempt {a.number} accepted: {proposal.title}")
        msg = "submission accepted; it will be committed."
        if notes:
            msg += "\nnot covered here:\n- " + "\n- ".join(notes)
        return ToolOutcome(msg, proposal=proposal)

    def evaluate_candidate(self) -> tuple[list[str], list[str], dict]:
        """Judge the worktree's current change: (rejection reasons, what was not covered, evidence).

        The gate's judgement first (agent/judge.py: scope against the base revision, policy, line
        bound, every variant of every touched kernel built sandboxed and audited); with a GPU,
        validation must pass too.
        """
        notes: list[str] = []
        evidence: dict = {}
        v = self.judge()
        evidence["files"] = v.files
        if not v.ok:
            return v.reasons, notes, evidence
        evidence["binaries"] = [dict(x, kernel=k) for k, xs in v.built.items() for x in xs]
        evidence["code_identical_to_base"] = v.code_identical_to_base
        notes += v.notes
        self.s.stage("validate")
        r = self._record(self.s.backends.validate(self.s.worktree, self.s.kernel, self.s.run_dir / "evidence",
                                                  base=self.s.base_sha or None))
        if r.status == FAILED:
            return [f"validation failed: {r.summary[:1500]}"], notes, evidence
        if r.status in (NO_GPU, UNAVAILABLE):
            notes.append(f"validation {r.status}: {r.summary[:300]}")
        else:
            evidence["bundle"] = r.data.get("bundle")
            report = Path(r.data["bundle"]).with_name("report.html") if r.data.get("bundle") else None
            evidence["report"] = str(report) if report and report.exists() else None
        return [], notes, evidence

    def judge(self, *, attempt: bool = True):
        """The gate's verdict on the worktree as it is now (agent/judge.py). Its checks are logged;
        with `attempt` they also count as checks of the open attempt (not at the commit, which
        judges the accepted attempt once more)."""
        from agent.judge import judge_change

        def log(r: CheckResult) -> CheckResult:
            self.s.trajectory.event("check", **r.to_dict(), final=True)
            return r

        return judge_change(self.s.repo_root or self.s.worktree, self.s.base_sha, self.s.worktree,
                            backends=self.s.backends, kernel=self.s.kernel, scratch=self.s.run_dir / "judge",
                            stage=self.s.stage, record=self._record if attempt else log)
