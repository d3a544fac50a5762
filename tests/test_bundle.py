"""The evidence bundle: schema, atomic writes (also under SIGKILL), signing and tamper detection."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from validation import bundle as B

REPO = Path(__file__).resolve().parent.parent


def make(**over):
    kw = dict(
        change={"kernel": "gemv", "base": None, "head": "abc", "files": ["kernels/ops/gemv.py"],
                "title": "t", "summary": "s"},
        environment={"gpu": "NVIDIA H200", "gpu_count": 1, "sm_count": 132, "driver": "x",
                     "cuda_runtime": "13.0", "torch": "2.11", "dsl_version": "4.8.1",
                     "commit": "abc", "dirty": False, "hostname_hash": "h"},
        binaries=[{"kernel": "gemv", "side": "head", "variant": {"batch": 1}, "tunables": {},
                   "build_key": "k", "cubin_sha256": "0" * 64}],
        correctness={"passed": True, "policy": {}, "cases": []},
        defences={"passed": True, "checks": []},
        race=None,
        benchmark={"ceilings": {"read_tbps": 4.6, "copy_tbps": 4.2}, "cases": [], "passed": True},
        not_covered=["race: not run"],
    )
    kw.update(over)
    return B.new_bundle(**kw)


def test_new_bundle_follows_the_schema_and_verdict_rules():
    b = make()
    assert B.schema_problems(b) == []
    assert b["verdict"] == "pass" and b["schema"] == B.SCHEMA
    failed = make(correctness={"passed": False, "policy": {}, "cases": []})
    assert failed["verdict"] == "fail" and "correctness: failed" in failed["reasons"]
    assert make(benchmark=None)["verdict"] == "fail"
    with pytest.raises(B.BundleError):
        make(binaries=[{"kernel": "gemv"}])


def test_load_bundle_rejects_malformed_json_and_wrong_schema(tmp_path):
    p = tmp_path / "b.json"
    p.write_text("{not json")
    with pytest.raises(B.BundleError, match="not valid JSON"):
        B.load_bundle(p)
    p.write_text(json.dumps({"schema": "other/1"}))
    with pytest.raises(B.BundleError, match="schema"):
        B.load_bundle(p)
    with pytest.raises(B.BundleError, match="cannot read"):
        B.load_bundle(tmp_path / "missing.json")
    B.write_bundle_atomic(p, make())
    assert B.load_bundle(p)["verdict"] == "pass"


def test_failed_write_leaves_the_previous_bundle_intact(tmp_path, monkeypatch):
    p = tmp_path / "bundle.json"
    B.write_bundle_atomic(p, make())
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(B.os, "replace", boom)
    with pytest.raises(OSError):
        B.write_bundle_atomic(p, make(not_covered=["changed"]))
    assert p.read_bytes() == before
    assert [x.name for x in tmp_path.iterdir()] == ["bundle.json"]  # no temp file left behind


def test_killed_writer_never_leaves_a_partial_bundle(tmp_path):
    """A writer killed with SIGKILL at an arbitrary moment: the bundle on disk always loads."""
    p = tmp_path / "bundle.json"
    B.write_bundle_atomic(p, make())
    script = (
        "import sys; from tests.test_bundle import make; from validation.bundle import write_bundle_atomic\n"
        "big = make(not_covered=['x' * 200] * 20000)\n"
        "print('ready', flush=True)\n"
        "while True: write_bundle_atomic(sys.argv[1], big)\n"
    )
    for delay in (0.05, 0.13, 0.29):
        proc = subprocess.Popen([sys.executable, "-c", script, str(p)], cwd=REPO,
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        loaded = B.load_bundle(p)  # old or new, never torn
        assert loaded["schema"] == B.SCHEMA


def test_sign_and_verify_and_tamper(tmp_path):
    priv, pub, kid = B.generate_key(tmp_path / "keys", tmp_path / "trusted")
    assert pub.name == f"{kid}.pub" and oct(priv.stat().st_mode & 0o777) == "0o600"
    signed = B.sign_bundle(make(), priv)
    assert signed["signature"]["key_id"] == kid and signed["signature"]["alg"] == "ed25519"
    res = B.verify_bundle(signed, tmp_path / "trusted")
    assert res.ok and res.key_id == kid

    # Survives a write and a read (the signature covers canonical JSON, not formatting).
    B.write_bundle_atomic(tmp_path / "b.json", signed)
    assert B.verify_bundle(B.load_bundle(tmp_path / "b.json"), tmp_path / "trusted").ok

    tampered = json.loads(json.dumps(signed))
    tampered["benchmark"]["cases"].append({"verdict": "FAST"})
    res = B.verify_bundle(tampered, tmp_path / "trusted")
    assert not res.ok and "changed after signing" in res.reason

    flipped = json.loads(json.dumps(signed))
    flipped["verdict"] = "fail"
    assert not B.verify_bundle(flipped, tmp_path / "trusted").ok


def test_unsigned_and_untrusted_bundles_do_not_verify(tmp_path):
    assert B.verify_bundle(make(), tmp_path).reason == "the bundle is not signed"
    priv, _, kid = B.generate_key(tmp_path / "keys", tmp_path / "trusted_a")
    (tmp_path / "trusted_b").mkdir()
    (tmp_path / "trusted_b" / "README.pub").write_text("not a key")  # stray files are skipped
    res = B.verify_bundle(B.sign_bundle(make(), priv), tmp_path / "trusted_b")
    assert not res.ok and "not among the trusted keys" in res.reason


def test_gate_agrees_with_the_contract(tmp_path):
    """The gate's own reading of the contract accepts what bundle.py signs."""
    gate = pytest.importorskip("validation.gate")
    priv, pub, kid = B.generate_key(tmp_path / "keys", tmp_path / "trusted")
    signed = B.sign_bundle(make(), priv)
    assert gate.canonical_json(signed) == B.canonical_json(signed)
    status, got, _ = gate.verify_signature(signed, {pub.name: pub.read_bytes()})
    assert (status, got) == ("ok", kid)


# -- the validator's fingerprint ---------------------------------------------------------------

def _tree(root: Path) -> None:
    files = {"validation/numerics.py": "TOL = 1\n", "validation/tolerances.toml": "x = 1\n",
             "validation/race/rules.py": "R = 1\n", "validation/GATE.md": "docs\n",
             "validation/trusted_keys/k.pub": "key\n", "kernels/reference.py": "ref\n",
             "kernels/ops/gemv.py": "kernel under test\n", "rfc_templates/report.html.j2": "page\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_validator_fingerprint_counts_code_and_tolerances_not_docs_keys_or_the_kernel(tmp_path):
    _tree(tmp_path)
    (tmp_path / "validation/__pycache__").mkdir()
    (tmp_path / "validation/__pycache__/numerics.cpython-311.pyc").write_bytes(b"\0bytecode")
    digest, files = B.validator_fingerprint_of_tree(tmp_path)
    assert sorted(files) == ["kernels/reference.py", "validation/numerics.py", "validation/race/rules.py",
                             "validation/tolerances.toml"]
    # Reproducible with coreutils: the sha256 of sha256sum's listing, sorted by path.
    listing = subprocess.run(["sha256sum", *sorted(files)], cwd=tmp_path, capture_output=True, text=True,
                             check=True).stdout
    assert digest == hashlib.sha256(listing.encode()).hexdigest()
    for rel, changes in (("validation/GATE.md", False), ("rfc_templates/report.html.j2", False),
                         ("kernels/ops/gemv.py", False), ("validation/tolerances.toml", True),
                         ("validation/race/rules.py", True)):
        before = B.validator_fingerprint_of_tree(tmp_path)[0]
        with open(tmp_path / rel, "a") as f:
            f.write("# edited\n")
        assert (B.validator_fingerprint_of_tree(tmp_path)[0] != before) is changes, rel


def test_validator_fingerprint_of_a_checkout_equals_the_gates_reading_of_its_commit(tmp_path):
    # What `fasttrack validate` records from the tree it runs is what the gate computes from git.
    from validation.gate import validator_at
    from validation.scope import open_repo

    _tree(tmp_path)
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    repo = open_repo(tmp_path)
    assert validator_at(repo, "HEAD") == B.validator_fingerprint_of_tree(tmp_path)
    (tmp_path / "validation/extra.py").write_text("X = 1\n")  # untracked: it would run, so it counts
    assert validator_at(repo, None) == B.validator_fingerprint_of_tree(tmp_path) != validator_at(repo, "HEAD")


# -- `fasttrack sign`: what it refuses, and where keys go ---------------------------------------

def test_generate_key_keeps_the_private_key_outside_the_repository(tmp_path, capsys, monkeypatch):
    from validation.cli import main
    from validation import cmd_sign
    from kernels.manifest import REPO_ROOT

    monkeypatch.setattr(B, "TRUSTED_KEYS_DIR", tmp_path / "trusted")
    assert main(["sign", "--generate-key", "--key-dir", str(REPO_ROOT / ".fasttrack" / "keys")]) == 2
    assert "inside the repository" in capsys.readouterr().err
    assert main(["sign", "--generate-key", "--key-dir", str(tmp_path / "keys")]) == 0
    assert len(list((tmp_path / "keys").glob("*.pem"))) == 1
    assert not (tmp_path / "trusted").exists()  # trusted only when asked
    assert "--trust" in capsys.readouterr().out
    assert main(["sign", "--generate-key", "--key-dir", str(tmp_path / "keys2"), "--trust"]) == 0
    assert len(list((tmp_path / "trusted").glob("*.pub"))) == 1
    assert cmd_sign.USER_KEY_DIR.parts[0] == "~"  # the default is the user's, not the repository's


def test_sign_refuses_a_signed_bundle_and_one_that_does_not_match_its_plan(tmp_path, capsys, monkeypatch):
    from validation.cli import main

    monkeypatch.setattr(B, "TRUSTED_KEYS_DIR", tmp_path / "trusted")
    priv, _pub, _kid = B.generate_key(tmp_path / "keys", tmp_path / "trusted")
    p = tmp_path / "bundle.json"
    B.write_bundle_atomic(p, make())
    assert main(["sign", str(p), "--key", str(priv)]) == 0
    signed = p.read_bytes()
    assert main(["sign", str(p), "--key", str(priv)]) == 2  # verifies: never signed again
    assert "already signed by trusted key" in capsys.readouterr().err
    tampered = json.loads(signed)
    tampered["verdict"] = "pass"
    tampered["reasons"] = ["edited"]
    B.write_bundle_atomic(p, tampered)
    assert main(["sign", str(p), "--key", str(priv)]) == 2  # does not verify: not laundered
    assert "does not verify" in capsys.readouterr().err
    # Timed against a base revision: the bundle's binaries must be its plan's.
    b = make(change={"kernel": "gemv", "base": "a" * 40, "head": "b" * 40, "files": [], "title": "t", "summary": ""})
    B.write_bundle_atomic(p, b)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema": "fasttrack.validate-plan/1", "kernel": "gemv",
                                "base": {"sha": "a" * 40, "ref": "main"}, "head": {"sha": "b" * 40},
                                "variants": [{"variant": {"batch": 1}, "head": {"cubin_sha256": "1" * 64},
                                              "base": {"cubin_sha256": "2" * 64}}]}))
    assert main(["sign", str(p), "--key", str(priv), "--plan", str(plan)]) == 2
    assert "does not match its plan" in capsys.readouterr().err
    assert json.loads(p.read_text())["signature"] is None
