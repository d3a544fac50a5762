"""`fasttrack validate` without a GPU, prebuilt-folder selection, and stage isolation."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from validation import validate as V
from validation.cli import main
from validation.isolate import run_stage

REPO = Path(__file__).resolve().parent.parent


# -- isolation ----------------------------------------------------------------------------------


def _stage(tmp_path, code, timeout=20):
    script = tmp_path / "child.py"
    script.write_text(code)
    return run_stage("t", [str(script), str(tmp_path / "r.json")], result_path=tmp_path / "r.json",
                     log_path=tmp_path / "t.log", timeout_s=timeout)


def test_stage_result_comes_back(tmp_path):
    st = _stage(tmp_path, "import json, sys; print('hello'); json.dump({'x': 1}, open(sys.argv[1], 'w'))")
    assert st.ok and st.result == {"x": 1} and "hello" in st.log_tail


def test_hung_stage_is_killed_and_becomes_a_failure(tmp_path):
    st = _stage(tmp_path, "import time, subprocess, sys\n"
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                          "print('spinning', flush=True); time.sleep(60)", timeout=2)
    assert not st.ok and st.timed_out and "timed out" in st.reason
    assert st.seconds < 20 and "spinning" in st.log_tail


def test_crashed_stage_keeps_its_log(tmp_path):
    st = _stage(tmp_path, "raise RuntimeError('CUDA error: an illegal memory access was encountered')")
    assert not st.ok and st.returncode == 1 and "illegal memory access" in st.reason


def test_stage_that_writes_nothing_is_a_failure(tmp_path):
    st = _stage(tmp_path, "pass")
    assert not st.ok and "wrote no result" in st.reason


# -- prebuilt folders ---------------------------------------------------------------------------


def _fake_build(root: Path, repo: Path, kernel: str, variant: dict, tunables: dict, name: str, src_text: str):
    src = repo / "kernels" / "ops" / f"{kernel}.py"
    src.parent.mkdir(parents=True, exist_ok=True)
    d = root / kernel / name
    d.mkdir(parents=True)
    meta = {"kernel": kernel, "variant": variant, "tunables": tunables, "key": name * 4,
            "hashes": {"cubin_sha256": hashlib.sha256(name.encode()).hexdigest()},
            "sources": {f"kernels/ops/{kernel}.py": hashlib.sha256(src_text.encode()).hexdigest()},
            "dsl_version": "4.8.1"}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def test_find_prebuilt_picks_the_build_of_the_current_sources(tmp_path):
    from kernels.manifest import load_manifest

    spec = load_manifest().kernel("rmsnorm")
    tun = spec.tunable_defaults()
    repo, root = tmp_path / "repo", tmp_path / "build"
    v = dict(spec.shapes[0])
    _fake_build(root, repo, "rmsnorm", v, tun, "aaaa", "old source")
    fresh = _fake_build(root, repo, "rmsnorm", v, tun, "bbbb", "new source")
    (repo / "kernels" / "ops" / "rmsnorm.py").write_text("new source")
    assert V.find_prebuilt(spec, v, root, repo) == fresh
    (repo / "kernels" / "ops" / "rmsnorm.py").write_text("edited since")
    assert V.find_prebuilt(spec, v, root, repo) is None  # a stale build is never judged


# -- validate without a GPU ---------------------------------------------------------------------


@pytest.fixture
def no_gpu_fake_builds(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")

    def fake_resolve(spec, variants, build_root, repo_root, log):
        return [V.Prebuilt(v, Path("build") / spec.name / "x",
                           {"key": "k" * 64, "tunables": spec.tunable_defaults(), "dsl_version": "4.8.1",
                            "hashes": {"cubin_sha256": "c" * 64}}, "prebuilt") for v in variants]

    monkeypatch.setattr(V, "resolve_builds", fake_resolve)
    monkeypatch.setattr(V, "static_race_audit", lambda spec, builds: {"passed": True, "variants": len(builds), "findings": []})


def test_validate_without_gpu_says_so_writes_the_bundle_and_exits_0(no_gpu_fake_builds, tmp_path, capsys):
    assert main(["validate", "gemv", "--batch", "1", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "no CUDA device" in err
    b = json.loads((tmp_path / "bundle.json").read_text())
    assert b["verdict"] == "fail" and b["correctness"] is None and b["benchmark"] is None
    assert any("no CUDA device" in n for n in b["not_covered"])
    assert len(b["binaries"]) == 5 and all(x["variant"]["batch"] == 1 for x in b["binaries"])
    assert (tmp_path / "report.html").is_file()


def test_validate_require_gpu_without_gpu_exits_3(no_gpu_fake_builds, tmp_path, capsys):
    assert main(["validate", "gemv", "--require-gpu", "--out", str(tmp_path)]) == 3
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "bundle.json").exists()


@pytest.mark.parametrize("argv, msg", [
    (["validate", "nokernel"], "unknown kernel"),
    (["validate", "gemv", "--batch", "3"], "declares no variant with batch [3]"),
    (["validate", "gemv", "--base", "HEAD~1"], "only 'torch'"),
])
def test_validate_bad_input_exits_2(tmp_path, capsys, argv, msg):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    assert msg in capsys.readouterr().err


def test_gpu_side_imports_without_the_dsl_gitpython_or_cryptography():
    code = ("import sys\n"
            "for m in ('cutlass', 'git', 'cryptography', 'anthropic'): sys.modules[m] = None\n"
            "import validation.gpu_stages, validation.validate, validation.report, validation.cli\n"
            "from validation.cli import main\n"
            "raise SystemExit(main(['check', '--list']))\n")
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# -- the cubin adapter, on CPU with a stand-in for the launcher --------------------------------


class _FakeCubin:
    """Stands in for kernels.launch.CubinKernel: computes rmsnorm with torch into the output."""

    behaviour = "honest"

    def __init__(self, meta):
        self.meta = meta
        self.sha256 = "e" * 64

    def __call__(self, x, gamma, y):
        from kernels import reference as R

        if self.behaviour == "raise" and x.shape[0] == 2:
            raise RuntimeError("cuLaunchKernel failed: CUDA_ERROR_ILLEGAL_ADDRESS")
        full = R.rmsnorm(x, gamma, 1e-5)
        rows = x.shape[0] // 2 if self.behaviour == "half" else x.shape[0]
        y[:rows].copy_(full[:rows])


def _rmsnorm_build_dirs(tmp_path, batches=(1, 2)):
    from kernels.manifest import load_manifest

    spec = load_manifest().kernel("rmsnorm")
    dirs = []
    for b in batches:
        v = {"batch": b, "width": 64}
        d = tmp_path / f"b{b}"
        d.mkdir()
        params = [{"name": "x", "role": "activation", "direction": "in",
                   "spec": {"kind": "tensor", "shape": [b, 64], "dtype": "bfloat16"}},
                  {"name": "gamma", "role": "static", "direction": "in",
                   "spec": {"kind": "tensor", "shape": [64], "dtype": "bfloat16"}},
                  {"name": "y", "role": "activation", "direction": "out",
                   "spec": {"kind": "tensor", "shape": [b, 64], "dtype": "bfloat16"}}]
        (d / "meta.json").write_text(json.dumps({"kernel": "rmsnorm", "variant": v, "params": params,
                                                 "tunables": spec.tunable_defaults(), "key": "k"}))
        dirs.append(str(d))
    return dirs


@pytest.fixture
def fake_launcher(monkeypatch):
    from kernels import launch

    monkeypatch.setattr(launch.CubinKernel, "from_dir",
                        classmethod(lambda cls, d: _FakeCubin(json.loads((Path(d) / "meta.json").read_text()))))
    yield _FakeCubin
    _FakeCubin.behaviour = "honest"


def test_numerics_stage_judges_a_cubin_like_any_candidate(tmp_path, fake_launcher):
    from validation.gpu_stages import numerics_stage

    res = numerics_stage(_rmsnorm_build_dirs(tmp_path), quick=True, device="cpu")
    assert [v["passed"] for v in res["variants"]] == [True, True]
    names = {c["name"]: c for c in res["variants"][1]["checks"]}
    assert not names["unseen_shapes"]["applicable"] and names["poisoned_outputs"]["passed"]
    assert res["variants"][0]["stress"]["passed"]
    assert all(c["variant"]["width"] == 64 for v in res["variants"] for c in v["cases"])


def test_numerics_stage_catches_unwritten_rows_and_survives_a_crashing_variant(tmp_path, fake_launcher):
    from validation.gpu_stages import numerics_stage
    from validation.validate import merge_checks

    fake_launcher.behaviour = "half"
    res = numerics_stage(_rmsnorm_build_dirs(tmp_path, (4,)), quick=True, device="cpu")
    checks = {c["name"]: c for c in merge_checks(res["variants"])}
    assert not checks["poisoned_outputs"]["passed"] and "never written" in checks["poisoned_outputs"]["detail"]

    fake_launcher.behaviour = "raise"
    res = numerics_stage(_rmsnorm_build_dirs(tmp_path / "r", (1, 2)) if (tmp_path / "r").mkdir() is None else [],
                         quick=True, device="cpu")
    assert res["variants"][0]["passed"] and not res["variants"][1]["passed"]
    assert "ILLEGAL_ADDRESS" in " ".join(c["reasons"][0] for c in res["variants"][1]["cases"] if c["reasons"])
