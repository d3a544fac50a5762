"""The dynamic audit: compute-sanitizer tools around a child process that runs the kernel.

A tool run counts as clean only when both hold:
  * the tool printed its explicit clean summary ("ERROR SUMMARY: 0 errors", or racecheck's
    "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)");
  * the child printed the run marker for every kernel it was asked to run, with `ok=1`, i.e. it
    launched the kernel and checked its output against the reference inside the sanitized run.
A timeout (a hung spin), a crash, a missing summary or a missing marker is not clean. Parsing is
pure and tested on the CPU; `run_tool` needs a GPU host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
RUN_MARKER = "FASTTRACK-RAN"
_MARKER = re.compile(rf"^{RUN_MARKER} kernel=(\S+) ok=([01])(.*)$", re.M)
_ERROR_SUMMARY = re.compile(r"=+ ERROR SUMMARY: (\d+) errors?")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")
# what a kernel's watchdog prints before it traps (kernels/ops/megakernel.py `_wait`)
_WATCHDOG = re.compile(r"^.*\bwatchdog: .*$", re.M)
_RACE_SUMMARY = re.compile(r"=+ RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


@dataclass
class ToolResult:
    tool: str
    clean: bool
    reason: str
    errors: int | None
    kernels_ran: dict[str, bool] = field(default_factory=dict)
    returncode: int | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def marker(kernel: str, ok: bool, **info) -> str:
    """The line a sanitized child prints after running `kernel` and checking its output."""
    extra = "".join(f" {k}={v}" for k, v in info.items())
    return f"{RUN_MARKER} kernel={kernel} ok={int(bool(ok))}{extra}"


def parse_tool_output(tool: str, text: str, expected: list[str], returncode: int | None,
                      timed_out: bool = False) -> ToolResult:
    """Judge one sanitizer run from its combined output (see the module docstring)."""
    markers = list(_MARKER.finditer(text))
    ran = {m.group(1): m.group(2) == "1" for m in markers}
    whys = {m.group(1): _why(m.group(3)) for m in markers}
    trapped = _WATCHDOG.search(text)  # a hung wait the kernel's watchdog turned into a trap
    dog = f"the kernel's watchdog trapped a wait: {trapped.group(0).strip()}" if trapped else ""
    errors = None
    if tool == "racecheck":
        m = _RACE_SUMMARY.search(text)
        if m:
            errors = int(m.group(1))
        summary_clean = bool(m) and int(m.group(1)) == 0 and int(m.group(2)) == 0 and int(m.group(3)) == 0
    else:
        m = _ERROR_SUMMARY.search(text)
        if m:
            errors = int(m.group(1))
        summary_clean = bool(m) and int(m.group(1)) == 0
    if timed_out:
        return ToolResult(tool, False, "timed out (a hung kernel?)" + (f": {dog}" if dog else ""), errors, ran,
                          returncode)
    missing = [k for k in expected if k not in ran]
    failed = [k for k in expected if k in ran and not ran[k]]
    if errors is None:
        reason = "no clean summary printed"
    elif not summary_clean:
        reason = f"{errors} error(s)/hazard(s) reported"
    elif missing:
        reason = "no proof the kernel ran: " + ", ".join(missing)
    elif failed:
        reason = "; ".join(_failed_reason(k, whys.get(k, ""), dog) for k in failed)
    elif returncode not in (0, None):
        reason = f"child exited with {returncode}"
    else:
        return ToolResult(tool, True, "clean summary and every kernel ran and checked", errors, ran, returncode)
    return ToolResult(tool, False, reason, errors, ran, returncode)


def _why(rest: str) -> str:
    """The `why` a run marker carries (a JSON string), or ""."""
    m = re.search(r'\bwhy=("(?:[^"\\]|\\.)*")', rest)
    if not m:
        return ""
    try:
        return str(json.loads(m.group(1)))
    except ValueError:
        return m.group(1)


def _failed_reason(kernel: str, why: str, dog: str) -> str:
    """One kernel's failed run marker in words: an exception means the launch never completed
    (a trap, an illegal address), not that its output was judged wrong; `dog`, the watchdog's
    line if one was printed, goes after it."""
    first = why.split("\n")[0].strip()
    if _EXCEPTION.match(first):
        out = f"kernel launch failed inside the sanitized run: {kernel}: {first}"
    else:
        out = f"kernel output wrong inside the sanitized run: {kernel}" + (f": {first}" if first else "")
    return out + (f" ({dog})" if dog else "")


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, beside nvcc, or under /usr/local/cuda/bin."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    cands = ([Path(nvcc).parent / "compute-sanitizer"] if nvcc else []) + [
        Path("/usr/local/cuda/bin/compute-sanitizer"),
        Path("/usr/local/cuda/compute-sanitizer/compute-sanitizer"),
    ]
    for c in cands:
        if c.is_file():
            return str(c)
    return None


def sanitizer_command(sanitizer: str, tool: str, child: list[str]) -> list[str]:
    """The command line of one tool run (API-error reports off; racecheck reports everything)."""
    if tool not in TOOLS:
        raise ValueError(f"unknown sanitizer tool {tool!r}; tools are {', '.join(TOOLS)}")
    cmd = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--print-limit", "50"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    return cmd + child


def run_tool(tool: str, child: list[str], expected: list[str], *, timeout_s: float = 120.0,
             log_path: Path | None = None, sanitizer: str | None = None) -> ToolResult:
    """Run `child` (a command that launches the kernels and prints markers) under one tool."""
    import time

    san = sanitizer or find_sanitizer()
    if san is None:
        return ToolResult(tool, False, "compute-sanitizer not found", None)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    t0 = time.perf_counter()
    cmd = sanitizer_command(san, tool, child)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        text, rc, to = p.stdout + p.stderr, p.returncode, False
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        text, rc, to = out + err, None, True
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"\n===== {tool}: {' '.join(cmd[-4:])}\n{text}\n")
    res = parse_tool_output(tool, text, expected, rc, to)
    res.seconds = time.perf_counter() - t0
    return res
