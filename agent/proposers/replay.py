"""The replay proposer: re-runs a recorded trajectory's tool calls, in order, in a fresh worktree.

No model is called. Each recorded `tool_call` is executed again through the same tools; its outcome
is compared with the recorded `tool_result` (error flag and text) and every difference is logged as
a `replay_divergence` event, so a replay both reproduces a run's change deterministically and shows
where today's checks answer differently than they did then. The run ends as the recording did: an
accepted submission is committed; a recording that gave up or stopped without one ends the same way.
"""

from __future__ import annotations

from pathlib import Path

from agent.rfc import Proposal
from agent.session import RunStopped, Session
from agent.tools import Toolbox
from agent.trajectory import read_trajectory


class ReplayProposer:
    name = "replay"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.events = read_trajectory(self.path)  # TrajectoryError for a bad file, before any work
        start = next((e for e in self.events if e["kind"] == "start"), {})
        self.recorded_kernel = start.get("kernel")
        self.recorded_proposer = start.get("proposer")
        self.divergences: list[dict] = []
        # A tuner's change sets tunable defaults; its replay needs the same (and only that) licence.
        self.allows_tunable_edits = self.recorded_proposer == "tuner"

    def run(self, session: Session, toolbox: Toolbox) -> Proposal:
        if self.recorded_kernel and self.recorded_kernel != session.kernel:
            raise RunStopped("error", f"the trajectory is for kernel {self.recorded_kernel!r}, "
                             f"not {session.kernel!r}")
        results = {e.get("id"): e for e in self.events if e["kind"] == "tool_result"}
        calls = [e for e in self.events if e["kind"] == "tool_call"]
        session.trajectory.event("replay_start", source=self.path.name, calls=len(calls),
                                 recorded_proposer=self.recorded_proposer)
        for i, call in enumerate(calls, 1):
            session.progress.update(turn=i)
            out = toolbox.call(call["name"], call.get("input", {}), call.get("id", f"replay-{i}"))
            rec = results.get(call.get("id"))
            if rec is not None and (rec.get("is_error") != out.is_error or rec.get("content") != out.content):
                d = {"call": i, "name": call["name"], "recorded_is_error": rec.get("is_error"),
                     "replayed_is_error": out.is_error,
                     "recorded": str(rec.get("content"))[:500], "replayed": out.content[:500]}
                self.divergences.append(d)
                session.trajectory.event("replay_divergence", **d)
            if out.give_up is not None:
                raise RunStopped("gave_up", f"the recorded run gave up: {out.give_up}")
            if out.proposal is not None:
                return out.proposal
        end = next((e for e in reversed(self.events) if e["kind"] == "end"), None)
        how = f" (it ended: {end.get('outcome')}: {end.get('reason')})" if end else ""
        raise RunStopped("no_proposal", f"the replayed trajectory has no accepted submission{how}")

    def measurements_bound(self, built: list[dict]) -> bool:
        """Whether the recording's claim of measurements stands: a recording that claims none
        (no `measurements` event, not a tuner's) has nothing to bind; one that does must carry
        them bound to the cubins the replayed change builds (every variant's cubin sha256 or
        code sha256 among the measured ones). Otherwise the change is unmeasured."""
        measured = [e for e in self.events if e["kind"] == "measurements"]
        if not measured and self.recorded_proposer != "tuner":
            return True
        hashes = {str(x.get(k)) for e in measured for x in (e.get("binaries") or []) if isinstance(x, dict)
                  for k in ("cubin_sha256", "cubin_code_sha256") if x.get(k)}
        return bool(built) and all(b.get("cubin_sha256") in hashes or b.get("cubin_code_sha256") in hashes
                                   for b in built)

    def summary_extra(self) -> dict:
        return {"replay": {"source": self.path.name, "divergences": self.divergences}}
