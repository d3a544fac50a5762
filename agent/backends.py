"""The narrow seam between the agent and the rest of fasttrack: build, static audit, validate,
benchmark.

The proposer's edits live in a worktree, so every check must run the worktree's code, not the
installed checkout's: each check runs in a child process with the worktree first on PYTHONPATH
(which also bounds it with a timeout and keeps a crashing compiler out of the loop). A stage whose
code has not landed, or whose subcommand is not registered, reports `unavailable` with the reason
instead of failing the run. Tests replace `RepoBackends` with a fake that has the same methods.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from agent.trajectory import scrubbed_environment

OK, FAILED, UNAVAILABLE, NO_GPU = "ok", "failed", "unavailable", "no_gpu"


@dataclass
class CheckResult:
    """The outcome of one check: `status` is ok | failed | unavailable | no_gpu."""

    check: str
    status: str
    summary: str  # what the proposer is told (short, human-readable)
    data: dict = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        return asdict(self)


class Backends(Protocol):
    def gpu_available(self) -> bool: ...

    def build(self, root: Path, kernel: str, shapes: list[dict] | None = None,
              tunables: dict | None = None) -> CheckResult: ...

    def audit(self, root: Path, kernel: str) -> CheckResult: ...

    def validate(self, root: Path, kernel: str, out_dir: Path, base: str | None = None) -> CheckResult: ...

    def benchmark(self, root: Path, kernel: str, out_dir: Path, base: str | None = None) -> CheckResult: ...


# Runs inside the worktree: builds the requested variants with the worktree's kernels/build.py and
# prints one JSON object. Kept as text so it needs nothing from the agent package in the worktree.
_BUILD_RUNNER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    req = json.loads(sys.argv[1])
    try:
        from kernels import build as B
    except ImportError as e:
        print(json.dumps({"unavailable": f"kernels.build is not importable here: {e}"})); sys.exit(0)
    try:
        arts = B.build_kernel(req["kernel"], shapes=req["shapes"], tunables=req["tunables"],
                              root=Path(req["root"]))
    except Exception as e:  # BuildError names the kernel, the variant and the source line
        print(json.dumps({"error": f"{type(e).__name__}: {e}"})); sys.exit(1)
    out = []
    for a in arts:
        meta = a.meta or {}
        out.append({
            "variant": a.shape, "tunables": a.tunables, "dir": str(a.dir), "cache_hit": a.cache_hit,
            "cubin_sha256": (meta.get("hashes") or {}).get("cubin_sha256"),
            "resources": meta.get("resources", {}), "launch": meta.get("launch", {}),
        })
    print(json.dumps({"built": out}))
    """
)


def _tail(text: str, n: int = 4000) -> str:
    text = text.strip()
    return text if len(text) <= n else "...(truncated)...\n" + text[-n:]


class RepoBackends:
    """Checks run by the worktree's own code in child processes."""

    def __init__(self, *, python: str = sys.executable, timeout_s: float = 1800.0):
        self.python = python
        self.timeout_s = timeout_s
        self._gpu: bool | None = None

    def gpu_available(self) -> bool:
        if self._gpu is None:
            try:
                import torch

                self._gpu = bool(torch.cuda.is_available())
            except Exception:
                self._gpu = False
        return self._gpu

    def _run(self, root: Path, args: list[str]) -> subprocess.CompletedProcess:
        # The child runs the proposed kernel's Python (the build imports it): no secret of this
        # process (the API key, a signing key's path) is handed to it.
        env = scrubbed_environment()
        env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [env.get("PYTHONPATH")] if p])
        return subprocess.run(
            [self.python, *args], cwd=root, env=env, capture_output=True, text=True,
            timeout=self.timeout_s,
        )

    def _cli(self, root: Path, check: str, args: list[str]) -> tuple[CheckResult | None, subprocess.CompletedProcess]:
        proc = self._run(root, ["-m", "validation.cli", *args])
        if proc.returncode == 2 and "invalid choice" in proc.stderr:
            return CheckResult(check, UNAVAILABLE,
                               f"`fasttrack {args[0]}` is not available in this revision"), proc
        return None, proc

    def build(self, root, kernel, shapes=None, tunables=None) -> CheckResult:
        req = {"kernel": kernel, "shapes": shapes, "tunables": tunables, "root": str(Path(root) / "build")}
        try:
            proc = self._run(Path(root), ["-c", _BUILD_RUNNER, json.dumps(req)])
        except subprocess.TimeoutExpired:
            return CheckResult("build", FAILED, f"build timed out after {self.timeout_s:.0f} s")
        try:
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return CheckResult("build", FAILED, "build crashed:\n" + _tail(proc.stderr or proc.stdout))
        if "unavailable" in out:
            return CheckResult("build", UNAVAILABLE, out["unavailable"])
        if "error" in out:
            return CheckResult("build", FAILED, out["error"], {"built": out.get("built", []),
                                                                "variant": out.get("variant")})
        return CheckResult("build", OK, format_build_table(out["built"]), {"built": out["built"]})

    def audit(self, root, kernel) -> CheckResult:
        try:
            res, proc = self._cli(Path(root), "audit", ["audit", kernel, "--json"])
        except subprocess.TimeoutExpired:
            return CheckResult("audit", FAILED, "static audit timed out")
        if res:
            return res
        try:
            data = json.loads(proc.stdout)
        except json.JSONDecodeError:
            data = {}
        if proc.returncode == 0:
            return CheckResult("audit", OK, format_audit(data) or "static audit clean", data)
        if proc.returncode == 1:
            return CheckResult("audit", FAILED, format_audit(data) or _tail(proc.stdout or proc.stderr, 4000), data)
        return CheckResult("audit", FAILED, "static audit could not run:\n" + _tail(proc.stderr))

    def _validate(self, root, kernel, out_dir, check: str, extra: list[str]) -> CheckResult:
        try:
            res, proc = self._cli(Path(root), check, ["validate", kernel, "--out", str(out_dir),
                                                      "--build-root", str(Path(root) / "build"), *extra])
        except subprocess.TimeoutExpired:
            return CheckResult(check, FAILED, f"{check} timed out after {self.timeout_s:.0f} s")
        if res:
            return CheckResult(check, UNAVAILABLE, res.summary)
        bundle_path = Path(out_dir) / "bundle.json"
        try:
            bundle = json.loads(bundle_path.read_text())
        except (OSError, json.JSONDecodeError):
            return CheckResult(check, FAILED, "validation wrote no bundle:\n" + _tail(proc.stderr or proc.stdout))
        status = OK if proc.returncode == 0 and bundle.get("verdict") == "pass" else FAILED
        return CheckResult(check, status, format_bundle(bundle, benchmark=check == "benchmark"),
                           {"bundle": str(bundle_path), "verdict": bundle.get("verdict")})

    def validate(self, root, kernel, out_dir, base=None) -> CheckResult:
        """`fasttrack validate` of the worktree's kernel; timed against `base` (the session's base
        commit) when given, which is the only baseline the gate takes as no-regression evidence."""
        if not self.gpu_available():
            return CheckResult("validate", NO_GPU,
                               "no CUDA device on this host: numerics, sanitizers and benchmarks were "
                               "NOT run; evidence must come from a GPU host (`fasttrack validate`)")
        return self._validate(root, kernel, out_dir, "validate", ["--require-gpu", *_base_args(base)])

    def benchmark(self, root, kernel, out_dir, base=None) -> CheckResult:
        """A quick validation (one seed per variant) timed against `base` when given, else torch."""
        if not self.gpu_available():
            return CheckResult("benchmark", NO_GPU,
                               "no CUDA device on this host: no benchmark was run, so there is no "
                               "timing to report")
        return self._validate(root, kernel, out_dir, "benchmark",
                              ["--require-gpu", *_base_args(base, fallback="torch"), "--quick"])


def _base_args(base: str | None, fallback: str | None = None) -> list[str]:
    """`--base REV` for `fasttrack validate`: the gate rejects bundles not timed against the
    change's base revision, so the agent passes the commit its worktree started from."""
    chosen = base or fallback
    return ["--base", chosen] if chosen else []


def format_audit(data: dict) -> str:
    """One line per finding of `fasttrack audit --json` output (empty when it has no reports)."""
    lines = []
    for rep in (data or {}).get("reports", []):
        findings = rep.get("findings", [])
        lines.append(f"{rep.get('kernel')}: {'clean' if rep.get('clean') else f'{len(findings)} finding(s)'} "
                     f"(checked {', '.join(rep.get('checked', []))})")
        for f in findings[:20]:
            where = "; ".join(x for x in (f.get("source") and f"source {f['source']}", f.get("ptx"), f.get("sass")) if x)
            lines.append(f"  [{f.get('severity')}] {f.get('rule')}: {f.get('message')} ({where})")
    return "\n".join(lines)


def format_bundle(bundle: dict, *, benchmark: bool = False) -> str:
    """The verdict, its reasons, and (for benchmarks) each case's time and verdict."""
    lines = [f"verdict: {bundle.get('verdict')}"]
    lines += [f"- {r}" for r in (bundle.get("reasons") or [])[:15]]
    if benchmark:
        for c in ((bundle.get("benchmark") or {}).get("cases") or [])[:60]:
            keys = ("variant", "median_us", "base_median_us", "speedup", "fraction_of_read_ceiling", "verdict")
            lines.append("  " + ", ".join(f"{k}={c[k]}" for k in keys if k in c))
    nc = bundle.get("not_covered") or []
    if nc:
        lines.append("not covered: " + "; ".join(str(x) for x in nc[:10]))
    return "\n".join(lines)


def format_build_table(built: list[dict]) -> str:
    """One line per variant: registers, spills, shared memory, cubin hash prefix."""
    if not built:
        return "nothing built"
    lines = ["variant | registers | spill store/load bytes | smem static+dynamic bytes | cubin"]
    for b in built:
        r = b.get("resources") or {}
        var = ",".join(f"{k}={v}" for k, v in (b.get("variant") or {}).items())
        spills = f"{r.get('spill_store_bytes', '?')}/{r.get('spill_load_bytes', '?')}"
        smem = f"{r.get('static_smem_bytes', '?')}+{r.get('dynamic_smem_bytes', 0)}"
        lines.append(f"{var} | {r.get('registers', '?')} | {spills} | {smem} | "
                     f"{(b.get('cubin_sha256') or '?')[:12]}")
    return "\n".join(lines)
