"""Helpers for the scope, gate and RFC tests: real temporary git repositories with a minimal
manifest and fake kernel files, a fake builder, and evidence bundles signed in the test."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from validation.gate import BuiltVariant, canonical_json

REPO = Path(__file__).resolve().parent.parent

MANIFEST = """\
[kernels.alpha]
description = "fake kernel alpha"
op = "kernels.ops.alpha:AlphaOp"
reference = "kernels.reference:alpha"
sources = ["kernels/ops/alpha.py"]
params = [
  { name = "x", role = "activation" },
  { name = "w", role = "static" },
  { name = "y", role = "activation", direction = "out" },
]
[kernels.alpha.tunables]
threads = { choices = [128, 256], default = 128 }
[kernels.alpha.shapes]
batch = [1, 8]
problems = [{ n = 64 }]

[kernels.beta]
description = "fake kernel beta"
op = "kernels.ops.beta:BetaOp"
reference = "kernels.reference:beta"
sources = ["kernels/ops/beta.py"]
params = [
  { name = "x", role = "activation" },
  { name = "y", role = "activation", direction = "out" },
]
[kernels.beta.shapes]
batch = [1]
"""

KERNEL_SOURCE = "".join(f"LINE_{i} = {i}\n" for i in range(20))


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def write(root: Path, rel: str, text: str | bytes) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)


def commit(root: Path, message: str) -> str:
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return git(root, "rev-parse", "HEAD")


def make_repo(root: Path, *, public_key_pem: bytes | None = None, policy_text: str | None = None) -> str:
    """A repository with two fake kernels, a reference, a validator file, tests and the real
    policy; returns the base commit sha."""
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.email", "gate@test")
    git(root, "config", "user.name", "gate test")
    git(root, "config", "commit.gpgsign", "false")
    write(root, "kernels/manifest.toml", MANIFEST)
    write(root, "kernels/ops/alpha.py", KERNEL_SOURCE)
    write(root, "kernels/ops/beta.py", KERNEL_SOURCE)
    write(root, "kernels/reference.py", "def alpha(x):\n    return x\n")
    write(root, "validation/numerics.py", "TOLERANCE = 1e-3\n")
    write(root, "validation/policy.toml", policy_text or (REPO / "validation/policy.toml").read_text())
    write(root, "tests/test_alpha.py", "def test_alpha():\n    assert True\n")
    write(root, "README.md", "# demo\n")
    if public_key_pem is not None:
        write(root, f"validation/trusted_keys/{key_id_from_pem(public_key_pem)}.pub", public_key_pem)
    return commit(root, "base")


def edit_lines(root: Path, rel: str, n: int) -> None:
    """Change `n` lines of a fake kernel source (2n lines in the diff: n deleted, n added)."""
    p = root / rel
    lines = p.read_text().splitlines(keepends=True)
    for i in range(n):
        lines[i] = lines[i].replace("=", "= 1 +")
    p.write_text("".join(lines))


# -- building, faked ---------------------------------------------------------------------------

def fake_builder(root: Path, shapes: dict[str, list[dict]] | None = None):
    """A builder whose 'cubin hash' is the hash of the kernel's source bytes and variant: a
    source change changes every hash, as a real build would."""
    shapes = shapes or {"alpha": [{"batch": 1, "n": 64}, {"batch": 8, "n": 64}], "beta": [{"batch": 1}]}
    defaults = {"alpha": {"threads": 128}, "beta": {}}

    def build(kernel: str) -> list[BuiltVariant]:
        src = (root / f"kernels/ops/{kernel}.py").read_bytes()
        out = []
        for s in shapes[kernel]:
            h = hashlib.sha256(src + json.dumps(s, sort_keys=True).encode()).hexdigest()
            out.append(BuiltVariant(kernel, dict(s), dict(defaults[kernel]), h))
        return out

    return build


# -- signing -----------------------------------------------------------------------------------

def new_keypair():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    priv = Ed25519PrivateKey.generate()
    pem = priv.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    return priv, pem


def key_id_from_pem(pem: bytes) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = serialization.load_pem_public_key(pem).public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign(bundle: dict, priv) -> dict:
    """The bundle signed as the contract says: ed25519 over the canonical JSON without `signature`."""
    from cryptography.hazmat.primitives import serialization

    b = copy.deepcopy(bundle)
    b.pop("signature", None)
    raw = priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    b["signature"] = {"alg": "ed25519", "key_id": hashlib.sha256(raw).hexdigest()[:16],
                      "value": base64.b64encode(priv.sign(canonical_json(b))).decode()}
    return b


def make_bundle(kernel: str, built: list[BuiltVariant], *, base: str | None, verdicts=None, race=True,
                base_sources: dict[str, str] | None = None,
                validator: tuple[str, dict[str, str]] | None = None) -> dict:
    """A passing bundle for `built`, timed against `base`: a commit sha (the kernel at that
    revision, with base binaries recorded), "torch" or None. Every case is SAME unless `verdicts`
    maps batch -> verdict. `base_sources`: the base kernel's source hashes the bundle records.
    `validator`: the (validator_sha256, per-file hashes) it records (none, as bundles written
    before the field existed, when None)."""
    verdicts = verdicts or {}
    kind = "none" if base is None else "torch" if base == "torch" else "revision"
    cases = []
    for v in built:
        batch = v.variant.get("batch")
        cases.append({"variant": v.variant, "batch": batch, "base_us": 10.0, "head_us": 9.9,
                      "diff_pct": -1.0, "noise_pct": 2.0, "verdict": verdicts.get(batch, "SAME")})
    slow_fails = kind != "torch"
    binaries = [{"kernel": v.kernel, "side": "head", "variant": v.variant, "tunables": v.tunables,
                 "build_key": None, "cubin_sha256": v.cubin_sha256} for v in built]
    if kind == "revision":
        binaries += [{"kernel": v.kernel, "side": "base", "variant": v.variant, "tunables": v.tunables,
                      "build_key": None, "cubin_sha256": hashlib.sha256(b"base" + v.cubin_sha256.encode()).hexdigest()}
                     for v in built]
    change = {"kernel": kernel, "base": base, "head": None, "files": [], "title": "t", "summary": "s"}
    if base_sources is not None:
        change["base_sources_sha256"] = base_sources
    return {
        "schema": "fasttrack.evidence/1",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tool_version": "0.1.0",
        "change": change,
        "environment": {"gpu": "NVIDIA H200", "gpu_count": 1, **(
            {"validator_sha256": validator[0], "validator_sources_sha256": validator[1]} if validator else {})},
        "binaries": binaries,
        "correctness": {"passed": True, "policy": {"source": "validation/tolerances.toml"}, "cases": []},
        "defences": {"passed": True, "checks": []},
        "race": {"passed": True, "static": {}, "dynamic": {}, "stress": {}} if race else None,
        "benchmark": {"ceilings": {"read_tbps": 4.6}, "cases": cases, "baseline": {"kind": kind},
                      "passed": not any(c["verdict"] == "IMPOSSIBLE" or (c["verdict"] == "SLOW" and slow_fails)
                                        for c in cases)},
        "not_covered": [],
        "verdict": "pass",
        "reasons": [],
        "signature": None,
    }


def validator_of(root: Path) -> tuple[str, dict[str, str]]:
    """The validator's fingerprint of the checkout at `root`, as `fasttrack validate` records it."""
    from validation.bundle import validator_fingerprint_of_tree

    return validator_fingerprint_of_tree(root)


def sources_sha256(root: Path, paths: list[str]) -> dict[str, str]:
    """sha256 of each repo-relative file under `root`: what a bundle records for its base build."""
    return {p: hashlib.sha256((root / p).read_bytes()).hexdigest() for p in paths}


def commit_bundle(root: Path, bundle: dict, name: str = "change") -> str:
    write(root, f"evidence_reports/{name}/bundle.json", json.dumps(bundle, indent=1))
    return f"evidence_reports/{name}/bundle.json"


def shallow_clone(src: Path, dst: Path, depth: int = 1) -> None:
    subprocess.run(["git", "clone", "-q", "--depth", str(depth), f"file://{src}", str(dst)],
                   check=True, capture_output=True)


# -- scratch clones of this repository (the real kernels, the real gate) ----------------------

def scratch_clone(dst: Path, *, batches: list[int] | None = (1,), one_problem: tuple[str, ...] = ("rmsnorm",)) -> str:
    """A shallow clone of this repository's last commit at `dst`, with a base commit on top whose
    manifest declares only `batches` (and, for the kernels of `one_problem`, only their first
    problem): the real kernels and gate at a fraction of the variants. Returns the base sha.
    Builds of unchanged sources are cache hits in the shared build/ (build keys name sources,
    shape and tunables, not the manifest)."""
    import re

    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(dst)], check=True, capture_output=True)
    git(dst, "config", "user.email", "gate@test")
    git(dst, "config", "user.name", "gate test")
    git(dst, "config", "commit.gpgsign", "false")
    text = (dst / "kernels/manifest.toml").read_text()
    if batches is not None:
        text = re.sub(r"(?m)^batch = \[[0-9, ]+\]$", f"batch = {list(batches)}", text)
    for k in one_problem:
        text = re.sub(rf"(\[kernels\.{k}\.shapes\]\nbatch = [^\n]*\nproblems = \[)(\{{[^}}]*\}})[^\]]*\]",
                      r"\1\2]", text)
    write(dst, "kernels/manifest.toml", text)
    git(dst, "add", "-A")
    git(dst, "commit", "-q", "--allow-empty", "-m", "scratch base: fewer variants")
    return git(dst, "rev-parse", "HEAD")


PATH_MANIFEST_TAIL = """
[paths.decode]
kernels = ["alpha", "beta"]
composite = "block"
"""


class FakeArtifact:
    """What kernels.build.build_requests returns, for fake kernels: the 'code hash' is the hash of
    the source's parsed form (comments and blank lines aside), the cubin hash that of its bytes,
    as a real build's line tables would make it."""

    def __init__(self, rq):
        import ast

        src = (Path(rq.repo_root) / rq.spec.sources[0]).read_bytes()
        tag = json.dumps([rq.shape, rq.tunables], sort_keys=True).encode()
        self.kernel, self.shape, self.tunables = rq.spec.name, dict(rq.shape), dict(rq.tunables)
        self.cubin_code_sha256 = hashlib.sha256(ast.dump(ast.parse(src)).encode() + tag).hexdigest()
        self.cubin_sha256 = hashlib.sha256(src + tag).hexdigest()
        self.key, self.dir, self.cache_hit = self.cubin_sha256, None, False


def fake_code_build(requests):
    return [FakeArtifact(rq) for rq in requests]


def built_of(v) -> list[BuiltVariant]:
    """The gate's rebuilt variants (verdict.build) as BuiltVariants, to make a bundle bind."""
    return [BuiltVariant(b["kernel"], b["variant"], b["tunables"], b["cubin_sha256"],
                         cubin_code_sha256=b.get("cubin_code_sha256")) for b in v.build]
