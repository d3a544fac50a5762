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


def run_plan_stage(name: str, module: str, plan_path: Path, build_root: Path, out_dir: Path, *,
                   timeout_s: float, batches=None) -> tuple[StageResult, dict | None]:
    """A plan stage's GPU child (`python -m MODULE run --plan P --build-root R --out
    OUT/NAME_run.json [--batches ...]`, its log OUT/NAME.log) under `run_stage`; the child's
    progress lines (those that start with `name`) and the stage's verdict go to stderr. Returns
    the stage and its result: on a timeout or crash, what the child had written so far (it
    rewrites its result after every batch), else None."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res_path, log_path = out_dir / f"{name}_run.json", out_dir / f"{name}.log"
    argv = ["-m", module, "run", "--plan", str(plan_path), "--build-root", str(build_root),
            "--out", str(res_path)] + (["--batches", *map(str, batches)] if batches else [])
    st = run_stage(name, argv, result_path=res_path, log_path=log_path, timeout_s=timeout_s)
    try:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(name):
                print(f"  {line}", file=sys.stderr, flush=True)
    except OSError:
        pass
    print(f"  stage {name}: {'ok' if st.ok else 'FAILED ' + st.reason} ({st.seconds:.0f} s)", file=sys.stderr,
          flush=True)
    result = st.result
    if result is None and res_path.exists():
        try:
            result = json.loads(res_path.read_text())
        except ValueError:
            result = None
    return st, result


def write_bundle_and_report(out_dir: Path, bundle: dict, name: str) -> None:
    """`bundle` as OUT/bundle.json (atomically), then its report.html; a report that fails to
    render is said on stderr (the bundle is the evidence; `fasttrack report` re-renders it)."""
    from . import bundle as B

    B.write_bundle_atomic(Path(out_dir) / "bundle.json", bundle)
    try:
        from .report import render_report

        (Path(out_dir) / "report.html").write_text(render_report(bundle))
    except Exception as e:  # noqa: BLE001 - the bundle is the evidence; the page can be re-rendered
        print(f"{name}: report.html not rendered ({type(e).__name__}: {e}); `fasttrack report` re-renders it",
              file=sys.stderr)


def plan_child_main(prog: str, run, errors: type[Exception], label: str, argv=None) -> int:
    """The `run` step's command line of a plan stage module: `run(plan, build_root, out,
    batches)`; an `errors` exception is one line on stderr and exit 2."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("step", choices=("run",))
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--build-root", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    a = ap.parse_args(argv)
    try:
        return run(a.plan, a.build_root, a.out, a.batches)
    except errors as e:
        print(f"{label}: {e}", file=sys.stderr)
        return 2
