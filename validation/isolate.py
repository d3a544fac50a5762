"""Run each GPU stage in a child process with a timeout (ARCHITECTURE.md, decision 6).

A hung persistent kernel, an illegal address that poisons the CUDA context, or a crash of the
driver becomes a failed `StageResult` with the child's log, never a hung or lost validation run.
The child writes its result as JSON to a file the parent names; its stdout and stderr go to a log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOG_TAIL_CHARS = 4000


@dataclass
class StageResult:
    name: str
    ok: bool  # exited 0 and wrote a result
    returncode: int | None
    timed_out: bool
    seconds: float
    result: dict | None  # the child's JSON result
    log_path: str
    log_tail: str
    reason: str  # why not ok ("" when ok)

    def to_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "returncode": self.returncode,
                "timed_out": self.timed_out, "seconds": round(self.seconds, 3),
                "log_tail": self.log_tail, "reason": self.reason}


def run_stage(name: str, argv: list[str], *, result_path: Path, log_path: Path, timeout_s: float,
              cwd: Path | None = None, env: dict | None = None) -> StageResult:
    """Run `python argv...` in a new process group; kill the whole group at `timeout_s`.

    Promises: never raises for anything the child does; returns ok only when the child exited 0
    and `result_path` holds a JSON object.
    """
    result_path, log_path = Path(result_path), Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the child's own group only
            except ProcessLookupError:
                pass
            rc = proc.wait()
    seconds = time.monotonic() - t0
    tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log_path.exists() else ""
    result = None
    reason = ""
    if timed_out:
        reason = f"stage {name} timed out after {timeout_s:.0f} s (hang?) and was killed"
    elif rc != 0:
        last = [l for l in tail.strip().splitlines() if l.strip()]
        reason = f"stage {name} exited with code {rc}" + (f": {last[-1].strip()}" if last else "")
    else:
        try:
            result = json.loads(result_path.read_text())
            if not isinstance(result, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as e:
            reason = f"stage {name} exited 0 but wrote no result ({e})"
            result = None
    ok = not reason
    return StageResult(name, ok, rc, timed_out, seconds, result, str(log_path), tail, reason)
