"""The narrow seam between the agent and the rest of fasttrack: build, static audit, validate,
benchmark.

Proposed code is untrusted: a kernel module is Python that the build imports. So:
  * the build runs in a child process of TRUSTED code (this checkout's kernels/build.py, never
    the worktree's), which reads the worktree's sources and compiles each variant in compile
    children wrapped in the sandbox (kernels/sandbox.py: clean environment, no network, no other
    process's /proc, no key store, no home folder, the sources read-only, only its own output
    folders writable). The content-addressed cache (`build_root`, default `<repo>/build`) is
    shared: a sandboxed child can write only its own variant's temporary folder, which the trusted
    parent checks and installs under its content key;
  * the static audit is the gate's (`validation.gate.default_auditor`), run by trusted code on
    the PTX and SASS the build wrote;
  * validate and benchmark (GPU hosts only: they launch the kernel) run whole in the sandbox,
    with the GPU device nodes, the worktree read-only and only their output folders writable.
A stage whose code has not landed reports `unavailable` with the reason instead of failing the
run. Tests replace `RepoBackends` with a fake that has the same methods.
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


# Runs in a child process with THIS checkout first on the path: builds the requested variants
# of the worktree's sources (repo_root) with the compile children sandboxed, audits them with the
# gate's auditor when asked, and prints one JSON object.
_BUILD_RUNNER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    req = json.loads(sys.argv[1])
    from kernels import build as B
    from kernels.manifest import ManifestError, load_manifest
    from kernels.sandbox import Sandbox
    root = Path(req["repo_root"])
    try:
        manifest = load_manifest(root / "kernels" / "manifest.toml")
        arts = B.build_kernel(req["kernel"], shapes=req["shapes"], tunables=req["tunables"],
                              root=Path(req["build_root"]), manifest=manifest, repo_root=root,
                              sandbox=Sandbox(**req["sandbox"]))
    except (B.BuildError, ManifestError) as e:  # names the kernel, the variant and the source line
        print(json.dumps({"error": f"{type(e).__name__}: {e}"})); sys.exit(1)
    out = []
    for a in arts:
        meta = a.meta or {}
        h = meta.get("hashes") or {}
        out.append({
            "variant": a.shape, "tunables": a.tunables, "dir": str(a.dir), "cache_hit": a.cache_hit,
            "cubin_sha256": h.get("cubin_sha256"), "cubin_code_sha256": h.get("cubin_code_sha256"),
            "resources": meta.get("resources", {}), "launch": meta.get("launch", {}),
        })
    res = {"built": out}
    if req.get("audit"):
        from validation.gate import BuiltVariant, default_auditor
        built = [BuiltVariant(kernel=a.kernel, variant=dict(a.shape), tunables=dict(a.tunables or {}),
                              cubin_sha256=a.cubin_sha256, build_key=a.key, build_dir=str(a.dir)) for a in arts]
        o = default_auditor(manifest)(req["kernel"], built)
        res["audit"] = {"status": o.status, "detail": o.detail, "findings": list(o.findings)}
    print(json.dumps(res))
    """
)

TRUSTED_ROOT = Path(__file__).resolve().parents[1]  # this checkout: the code that judges


def _tail(text: str, n: int = 4000) -> str:
    text = text.strip()
    return text if len(text) <= n else "...(truncated)...\n" + text[-n:]


class RepoBackends:
    """Checks of a worktree's sources, run by this checkout's code, proposed code sandboxed."""

    def __init__(self, *, python: str = sys.executable, timeout_s: float = 1800.0,
                 build_root: Path | None = None, sandbox=None):
        from kernels.sandbox import Sandbox

        self.python = python
        self.timeout_s = timeout_s
        self.build_root = Path(build_root) if build_root else None
        self.sandbox = sandbox or Sandbox()
        self._gpu: bool | None = None

    def sandbox_problem(self) -> str | None:
        """Why proposed code cannot be built sandboxed here (None when it can)."""
        return self.sandbox.problem()

    def gpu_available(self) -> bool:
        if self._gpu is None:
            try:
                import torch

                self._gpu = bool(torch.cuda.is_available())
            except Exception:
                self._gpu = False
        return self._gpu

    def _sandbox_args(self) -> dict:
        sb = self.sandbox
        return {"bwrap": sb.bwrap, "key_roots": list(sb.key_roots), "hidden": list(sb.hidden)}

    def _run_trusted(self, args: list[str]) -> subprocess.CompletedProcess:
        # Trusted code (this checkout) in a child: a timeout bounds it, a crash stays out of the
        # loop, and it gets no secret of this process (the API key, a signing key's path).
        env = scrubbed_environment()
        env["PYTHONPATH"] = os.pathsep.join([str(TRUSTED_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        return subprocess.run([self.python, *args], cwd=TRUSTED_ROOT, env=env, capture_output=True,
                              text=True, timeout=self.timeout_s)

    def _build_request(self, root, kernel, shapes, tunables, audit: bool) -> tuple[dict | None, str]:
        req = {"kernel": kernel, "shapes": shapes, "tunables": tunables, "repo_root": str(Path(root).resolve()),
               "build_root": str(self.build_root or Path(root) / "build"), "sandbox": self._sandbox_args(),
               "audit": audit}
        try:
            proc = self._run_trusted(["-c", _BUILD_RUNNER, json.dumps(req)])
        except subprocess.TimeoutExpired:
            return None, f"build timed out after {self.timeout_s:.0f} s"
        try:
            return json.loads(proc.stdout.strip().splitlines()[-1]), ""
        except (json.JSONDecodeError, IndexError):
            return None, "build crashed:\n" + _tail(proc.stderr or proc.stdout)

    def build(self, root, kernel, shapes=None, tunables=None) -> CheckResult:
        out, why = self._build_request(root, kernel, shapes, tunables, audit=False)
        if out is None:
            return CheckResult("build", FAILED, why)
        if "error" in out:
            return CheckResult("build", FAILED, out["error"])
        return CheckResult("build", OK, format_build_table(out["built"]), {"built": out["built"]})

    def audit(self, root, kernel) -> CheckResult:
        """The gate's static audit of every variant (built first: a cache hit after `build`)."""
        out, why = self._build_request(root, kernel, None, None, audit=True)
        if out is None or "error" in out:
            return CheckResult("audit", FAILED, "static audit could not run: " + (why or out["error"]))
        a = out["audit"]
        text = "\n".join([a["detail"], *a["findings"][:20]])
        status = {"pass": OK, "fail": FAILED}.get(a["status"], UNAVAILABLE)
        return CheckResult("audit", status, text, a)

    def _validate(self, root, kernel, out_dir, check: str, extra: list[str]) -> CheckResult:
        # The validator launches the proposed kernel and imports its module: the whole child runs
        # sandboxed, with the GPU, the worktree read-only and only its output folder writable.
        out_dir = Path(out_dir)
        build_root = out_dir / "build"
        build_root.mkdir(parents=True, exist_ok=True)
        cmd = [self.python, "-m", "validation.cli", "validate", kernel, "--out", str(out_dir),
               "--build-root", str(build_root), *extra]
        try:
            proc = self._run_sandboxed(cmd, root=Path(root), write=[out_dir])
        except subprocess.TimeoutExpired:
            return CheckResult(check, FAILED, f"{check} timed out after {self.timeout_s:.0f} s")
        if proc.returncode == 2 and "invalid choice" in proc.stderr:
            return CheckResult(check, UNAVAILABLE, "`fasttrack validate` is not available in this revision")
        bundle_path = out_dir / "bundle.json"
        try:
            bundle = json.loads(bundle_path.read_text())
        except (OSError, json.JSONDecodeError):
            return CheckResult(check, FAILED, "validation wrote no bundle:\n" + _tail(proc.stderr or proc.stdout))
        status = OK if proc.returncode == 0 and bundle.get("verdict") == "pass" else FAILED
        return CheckResult(check, status, format_bundle(bundle, benchmark=check == "benchmark"),
                           {"bundle": str(bundle_path), "verdict": bundle.get("verdict")})

    def _run_sandboxed(self, cmd: list[str], *, root: Path, write: list[Path]) -> subprocess.CompletedProcess:
        """`cmd` in the sandbox with the GPU, the worktree `root` read-only (its code first on the
        path) and only `write` writable."""
        sb = type(self.sandbox)(bwrap=self.sandbox.bwrap, key_roots=self.sandbox.key_roots,
                                hidden=self.sandbox.hidden, gpu=True)
        # `--base REV` reads the base revision from git: the repository's object store, read-only
        # (no secret lives there, and nothing can be planted in it).
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=root,
                                capture_output=True, text=True).stdout.strip()
        read = [root] + ([common] if common and Path(common).is_dir() else [])
        wrapped = sb.command(cmd, env={"PYTHONPATH": str(Path(root).resolve())}, read=read, write=write,
                             cwd=root)
        return subprocess.run(wrapped, capture_output=True, text=True, timeout=self.timeout_s)

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
