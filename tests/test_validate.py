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


def test_validate_without_gpu_refuses_and_writes_nothing(no_gpu_fake_builds, tmp_path, capsys):
    for argv in (["validate", "gemv", "--batch", "1"], ["validate", "gemv", "--require-gpu"]):
        assert main(argv + ["--out", str(tmp_path)]) == 2
        assert "no CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "bundle.json").exists()


def test_validate_never_overwrites_a_signed_bundle(tmp_path, capsys):
    signed = {"schema": "fasttrack.evidence/1", "signature": {"alg": "ed25519", "key_id": "k", "value": "v"}}
    (tmp_path / "bundle.json").write_text(json.dumps(signed))
    assert main(["validate", "gemv", "--out", str(tmp_path)]) == 2
    assert "nothing overwrites a signed bundle" in capsys.readouterr().err
    assert json.loads((tmp_path / "bundle.json").read_text()) == signed


def test_validate_kernel_without_gpu_records_what_did_not_run(no_gpu_fake_builds, tmp_path):
    """The library call (the CLI refuses before it) still writes a bundle that says what was not run."""
    b = V.validate_kernel("gemv", batches=[1], out_dir=tmp_path, log=lambda m: None)
    assert b["verdict"] == "fail" and b["correctness"] is None and b["benchmark"] is None
    assert any("no CUDA device" in n for n in b["not_covered"])
    assert len(b["binaries"]) == 5 and all(x["variant"]["batch"] == 1 for x in b["binaries"])
    # The validator that produced it, from the tree it ran: what the gate compares with its merge base.
    from validation.bundle import validator_fingerprint_of_tree

    digest, files = validator_fingerprint_of_tree(REPO)
    assert b["environment"]["validator_sha256"] == digest
    assert b["environment"]["validator_sources_sha256"] == files
    assert {"validation/validate.py", "validation/tolerances.toml", "kernels/reference.py"} <= set(files)


@pytest.mark.parametrize("argv, msg", [
    (["validate", "nokernel"], "unknown kernel"),
    (["validate", "gemv", "--batch", "3"], "declares no variant with batch [3]"),
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


class _FakeSplitK:
    """Stands in for a split-K GEMV cubin with scratch partials and a sync counter, honest or not:
    'stale' reduces partials it never wrote, 'leak' leaves its counter set (no last-CTA reset)."""

    behaviour = "honest"
    scratch_poisoned_at_entry: list[bool] = []

    def __init__(self, meta):
        self.meta = meta
        self.sha256 = "f" * 64

    def __call__(self, x, w, y, partials, counters):
        type(self).scratch_poisoned_at_entry.append(bool(torch.isnan(partials).all()))
        half = x.shape[1] // 2
        if self.behaviour != "stale":
            partials[0] = x[:, :half].float() @ w[:, :half].float().T
            partials[1] = x[:, half:].float() @ w[:, half:].float().T
        counters[0] += 2  # both splits arrive
        y.copy_(partials.sum(0).to(y.dtype))
        if self.behaviour != "leak":
            counters[0] = 0  # the last arrival resets the counter for the next launch


def _splitk_build_dirs(tmp_path, batches=(1, 3)):
    dirs = []
    for b in batches:
        d = tmp_path / f"g{b}"
        d.mkdir(parents=True)
        t = lambda shape, dtype: {"kind": "tensor", "shape": shape, "dtype": dtype}  # noqa: E731
        params = [{"name": "x", "role": "activation", "direction": "in", "spec": t([b, 32], "bfloat16")},
                  {"name": "w", "role": "static", "direction": "in", "spec": t([16, 32], "bfloat16")},
                  {"name": "y", "role": "activation", "direction": "out", "spec": t([b, 16], "bfloat16")},
                  {"name": "partials", "role": "scratch", "direction": "inout", "spec": t([2, b, 16], "float32")},
                  {"name": "counters", "role": "sync", "direction": "inout", "spec": t([4], "int32")}]
        (d / "meta.json").write_text(json.dumps({"kernel": "gemv", "params": params, "tunables": {}, "key": "k",
                                                 "variant": {"batch": b, "n": 16, "k": 32,
                                                             "out_dtype": "bfloat16"}}))
        dirs.append(str(d))
    return dirs


@pytest.fixture
def fake_splitk(monkeypatch):
    from kernels import launch

    monkeypatch.setattr(launch.CubinKernel, "from_dir",
                        classmethod(lambda cls, d: _FakeSplitK(json.loads((Path(d) / "meta.json").read_text()))))
    _FakeSplitK.scratch_poisoned_at_entry = []
    yield _FakeSplitK
    _FakeSplitK.behaviour = "honest"


def test_scratch_and_sync_parameters_are_allocated_by_role(tmp_path, fake_splitk):
    """A kernel with parameters the reference op lacks (gemv's partials and counters) is judged:
    scratch poisoned before every launch, counters zeroed once and found back at zero."""
    from validation.gpu_stages import numerics_stage

    res = numerics_stage(_splitk_build_dirs(tmp_path), quick=True, device="cpu")
    assert [v["passed"] for v in res["variants"]] == [True, True], res["variants"][0].get("error")
    assert len(fake_splitk.scratch_poisoned_at_entry) > 10 and all(fake_splitk.scratch_poisoned_at_entry)


def test_a_counter_left_set_or_stale_scratch_fails_with_the_reason(tmp_path, fake_splitk):
    from validation.gpu_stages import KernelAdapter, StageError, numerics_stage

    fake_splitk.behaviour = "leak"
    res = numerics_stage(_splitk_build_dirs(tmp_path / "leak", (2,)), quick=True, device="cpu")
    (v,) = res["variants"]
    reasons = " ".join(r for c in v["cases"] for r in c["reasons"])
    assert not v["passed"] and "'counters': 1 of 4 counter(s) left non-zero" in reasons

    fake_splitk.behaviour = "stale"
    res = numerics_stage(_splitk_build_dirs(tmp_path / "stale", (2,)), quick=True, device="cpu")
    assert not res["variants"][0]["passed"]  # the poisoned partials reach the output

    a = KernelAdapter(_splitk_build_dirs(tmp_path / "direct", (1,))[0], "cpu")
    assert a.owned["counters"].dtype == torch.int32 and not a.owned["counters"].any()
    a.owned["counters"][3] = 7
    with pytest.raises(StageError, match="left non-zero"):
        a.check_sync()
    assert not a.owned["counters"].any()  # re-zeroed: the next case is judged on its own
    a.check_sync()


def test_a_parameter_without_an_input_or_an_owned_role_is_refused(tmp_path, fake_splitk):
    from validation.gpu_stages import KernelAdapter, StageError

    (d,) = _splitk_build_dirs(tmp_path, (1,))
    meta = json.loads((Path(d) / "meta.json").read_text())
    meta["params"][3]["role"] = "activation"  # partials, no longer the kernel's own scratch
    (Path(d) / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(StageError, match="exactly one 'out' parameter"):
        KernelAdapter(d, "cpu")
    meta["params"][3]["direction"] = "in"
    (Path(d) / "meta.json").write_text(json.dumps(meta))
    a = KernelAdapter(d, "cpu")
    with pytest.raises(StageError, match="'partials' has no input of that name"):
        a.args({"x": torch.zeros(1, 32), "w": torch.zeros(16, 32)}, torch.zeros(1, 16))


# -- --base REV: prepare on the CPU host (a real temporary git repository), load on the GPU host --

SCALE_MANIFEST = """\
[kernels.scale]
op = "kernels.ops.scale:ScaleOp"
reference = "kernels.reference:scale"
sources = ["kernels/ops/scale.py"]
params = [
  { name = "x", role = "activation" },
  { name = "alpha", role = "scalar" },
  { name = "n", role = "scalar" },
  { name = "y", role = "activation", direction = "out" },
]
[kernels.scale.tunables]
threads = { choices = [32, 64], default = 64 }
[kernels.scale.shapes]
rows = [4]
cols = [64]
"""

# The build code the base worktree runs (its own copy, committed in the temporary repository).
BUILD_CODE = ("kernels/__init__.py", "kernels/build.py", "kernels/compile_worker.py", "kernels/manifest.py",
              "kernels/ptx.py", "kernels/ops/__init__.py", "kernels/ops/base.py")


def _git(root: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def base_head_repo(tmp_path_factory):
    """A repository with the fixture scale kernel: base, then head (n subtracted instead of added,
    so the sources and the cubins differ). Both sides prepared once."""
    pytest.importorskip("cutlass")
    root = tmp_path_factory.mktemp("vrepo") / "repo"
    root.mkdir()
    _git(root, "init", "-q", "-b", "main")
    _git(root, "config", "user.email", "v@test")
    _git(root, "config", "user.name", "validate test")
    for rel in BUILD_CODE:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text((REPO / rel).read_text())
    (root / "kernels/manifest.toml").write_text(SCALE_MANIFEST)
    src = (REPO / "tests/fixtures/scale_op.py").read_text()
    (root / "kernels/ops/scale.py").write_text(src)
    (root / ".gitignore").write_text("build/\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "base")
    base = _git(root, "rev-parse", "HEAD")
    (root / "kernels/ops/scale.py").write_text(src.replace("mX[r, c] * alpha + n.to(cutlass.Float32)",
                                                           "mX[r, c] * alpha - n.to(cutlass.Float32)"))
    _git(root, "commit", "-q", "-am", "head: subtract n")
    head = _git(root, "rev-parse", "HEAD")
    build = root / "build"
    plan = V.prepare_base_plan("scale", base, build_root=build, repo_root=root, log=lambda m: None)
    return {"root": root, "base": base, "head": head, "build": build, "plan": plan,
            "plan_path": V.default_plan_path("scale", build), "src": src}


@pytest.mark.slow
def test_prepare_builds_head_here_and_base_from_its_own_worktree(base_head_repo):
    r = base_head_repo
    plan = json.loads(r["plan_path"].read_text())
    assert plan == r["plan"] and plan["schema"] == V.PLAN_SCHEMA
    assert plan["base"] == {"ref": r["base"], "sha": r["base"], "sources_sha256": plan["base"]["sources_sha256"]}
    assert plan["head"]["sha"] == r["head"] and plan["head"]["dirty"] is False
    want = hashlib.sha256(r["src"].encode()).hexdigest()
    assert plan["base"]["sources_sha256"]["kernels/ops/scale.py"] == want  # the base's bytes, not head's
    (entry,) = plan["variants"]
    assert entry["variant"] == {"rows": 4, "cols": 64}
    assert entry["head"]["cubin_sha256"] != entry["base"]["cubin_sha256"]
    for side in ("head", "base"):
        d = r["build"] / entry[side]["dir"]
        assert not Path(entry[side]["dir"]).is_absolute()  # the plan travels with build/
        assert hashlib.sha256((d / "kernel.cubin").read_bytes()).hexdigest() == entry[side]["cubin_sha256"]
    assert _git(r["root"], "worktree", "list").count("\n") == 0  # the temporary worktree is gone


@pytest.mark.slow
def test_identical_sources_share_one_build(base_head_repo, tmp_path):
    """A base whose kernel equals head's (a docs-only commit in between) builds nothing new: the
    content-addressed folder is shared, and both sides name the same cubin."""
    r = base_head_repo
    (r["root"] / "README.md").write_text("docs\n")
    _git(r["root"], "add", "README.md")
    _git(r["root"], "commit", "-q", "-m", "docs")
    try:
        plan = V.prepare_base_plan("scale", "HEAD~1", build_root=r["build"], repo_root=r["root"],
                                   plan_path=tmp_path / "p.json", log=lambda m: None)
    finally:
        _git(r["root"], "reset", "-q", "--hard", r["head"])
    (entry,) = plan["variants"]
    assert plan["base"]["ref"] == "HEAD~1" and plan["base"]["sha"] == r["head"]
    assert entry["head"]["dir"] == entry["base"]["dir"]


@pytest.mark.slow
def test_plan_run_without_gpu_records_both_sides(base_head_repo, tmp_path, monkeypatch):
    """The GPU host's half, here on CPU: the plan's builds are used (no git, no build), and the
    bundle names base and head binaries, the base commit and its kernel source hashes."""
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    r = base_head_repo
    b = V.validate_kernel("scale", plan_path=r["plan_path"], build_root=r["build"], repo_root=r["root"],
                          out_dir=tmp_path, log=lambda m: None)
    sides = {x["side"]: x["cubin_sha256"] for x in b["binaries"]}
    (entry,) = r["plan"]["variants"]
    assert sides == {"head": entry["head"]["cubin_sha256"], "base": entry["base"]["cubin_sha256"]}
    assert b["change"]["base"] == r["base"] and b["change"]["head"] == r["head"]
    assert b["change"]["base_sources_sha256"] == r["plan"]["base"]["sources_sha256"]
    assert b["race"]["static"]["passed"]
    assert (tmp_path / "bundle.json").is_file()


@pytest.mark.slow
def test_plan_refuses_a_changed_cubin_and_another_kernel(base_head_repo, tmp_path):
    r = base_head_repo
    with pytest.raises(V.ValidateError, match="is for kernel 'scale', not 'gemv'"):
        V.load_base_plan(r["plan_path"], "gemv", r["build"])
    # A carried build folder whose cubin is not the one prepared (stale or swapped) is refused.
    import shutil

    build = tmp_path / "build"
    shutil.copytree(r["build"], build)
    (entry,) = r["plan"]["variants"]
    cubin = build / entry["base"]["dir"] / "kernel.cubin"
    cubin.write_bytes(cubin.read_bytes() + b"\0")
    with pytest.raises(V.ValidateError, match="no longer hashes to the plan's"):
        V.load_base_plan(r["plan_path"], "scale", build)
    with pytest.raises(V.ValidateError, match="cannot read it"):
        V.load_base_plan(r["plan_path"], "scale", tmp_path / "nothing")


@pytest.mark.slow
def test_prepare_a_kernel_missing_at_the_base_says_so(base_head_repo, tmp_path):
    r = base_head_repo
    (r["root"] / "kernels/manifest.toml").write_text(SCALE_MANIFEST.replace("[kernels.scale", "[kernels.other"))
    _git(r["root"], "commit", "-q", "-am", "the kernel is called other here")
    without = _git(r["root"], "rev-parse", "HEAD")
    (r["root"] / "kernels/manifest.toml").write_text(SCALE_MANIFEST)
    _git(r["root"], "commit", "-q", "-am", "and scale again")
    try:
        with pytest.raises(V.ValidateError, match=f"kernel scale at base {without[:12]}: unknown kernel 'scale'"):
            V.prepare_base_plan("scale", without, build_root=r["build"], repo_root=r["root"],
                                plan_path=tmp_path / "p.json", log=lambda m: None)
    finally:
        _git(r["root"], "reset", "-q", "--hard", r["head"])
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("argv, msg", [
    (["validate", "gemv", "--prepare"], "--prepare needs --base REV"),
    (["validate", "rmsnorm", "--base", "no-such-revision", "--prepare"], "does not name a commit"),
    (["validate", "rmsnorm", "--plan", "no/such/plan.json"], "cannot read plan"),
])
def test_base_revision_bad_input_exits_2(tmp_path, capsys, argv, msg):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "bundle.json").exists()


def test_a_plan_for_another_base_is_refused(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema": V.PLAN_SCHEMA, "kernel": "rmsnorm", "variants": [],
                                "base": {"ref": "main", "sha": "a" * 40}, "head": {"sha": "b" * 40}}))
    assert main(["validate", "rmsnorm", "--plan", str(plan), "--out", str(tmp_path)]) == 2
    assert "holds no variant" in capsys.readouterr().err


def test_bench_stage_times_the_base_revisions_cubin_beside_heads(tmp_path, fake_launcher, monkeypatch):
    """The bench stage's --base revision path, on CPU with stand-ins for the launcher and the
    timer: each head variant is paired with its base build, both launch into the same output
    buffers on the same inputs (placement must not differ between the sides of an A/B), the
    verdict compares the two sample sets, and the base binary is named."""
    import benchmarks.common as common
    from validation import bench, gpu_stages

    (tmp_path / "h").mkdir()
    (tmp_path / "b").mkdir()
    head_dirs = _rmsnorm_build_dirs(tmp_path / "h", (1, 2))
    base_dirs = _rmsnorm_build_dirs(tmp_path / "b", (1, 2))
    launched = []

    class Cubin(_FakeCubin):
        def __init__(self, meta, d):
            super().__init__(meta)
            self.sha256 = hashlib.sha256(str(d).encode()).hexdigest()
            self.side = "base" if "/b/" in str(d) else "head"

        def __call__(self, x, gamma, y):
            launched.append((self.side, y.data_ptr()))
            super().__call__(x, gamma, y)

    from kernels import launch

    monkeypatch.setattr(launch.CubinKernel, "from_dir", classmethod(
        lambda cls, d: Cubin(json.loads((Path(d) / "meta.json").read_text()), d)))
    real_adapter = gpu_stages.KernelAdapter
    monkeypatch.setattr(gpu_stages, "KernelAdapter", lambda d, device="cpu": real_adapter(d, "cpu"))
    monkeypatch.setattr(bench, "rotation_copies", lambda nbytes: (2, True))

    def fake_measure(base_fn, head_fn):
        for i in range(2):
            base_fn(i), head_fn(i)
        return {"base": [10.0 + 0.01 * i for i in range(12)], "head": [8.0 + 0.01 * i for i in range(12)],
                "graph": True}

    monkeypatch.setattr(bench, "measure_interleaved", fake_measure)
    monkeypatch.setattr(common, "gpu_environment", lambda: {"gpu": "stand-in"})
    monkeypatch.setattr(common, "read_bandwidth", lambda: {"tbps": 4.5, "kernel": "r", "readers": {
        "r": {"p90_us": 1.0, "p10_us": 1.0, "median_us": 1.0}}})
    monkeypatch.setattr(common, "copy_bandwidth", lambda: {"tbps": 4.2, "kernel": "c", "p90_us": 1.0,
                                                           "p10_us": 1.0, "median_us": 1.0})
    res = gpu_stages.bench_stage(head_dirs, base="revision", base_dirs=base_dirs)
    assert [c["verdict"] for c in res["cases"]] == ["FAST", "FAST"], res["cases"]
    for c, hd, bd in zip(res["cases"], head_dirs, base_dirs):
        assert c["base_binary"]["side"] == "base"
        assert c["base_binary"]["cubin_sha256"] == hashlib.sha256(bd.encode()).hexdigest()
        assert c["binary"]["cubin_sha256"] == hashlib.sha256(hd.encode()).hexdigest()
    base_ptrs = {p for s, p in launched if s == "base"}
    head_ptrs = {p for s, p in launched if s == "head"}
    assert base_ptrs and base_ptrs == head_ptrs  # the same output buffers, at the same addresses
    with pytest.raises(gpu_stages.StageError, match="one --base-build-dir per --build-dir"):
        gpu_stages.bench_stage(head_dirs, base="revision", base_dirs=base_dirs[:1])


def test_bench_stage_times_a_kernel_with_scratch_and_checks_its_counters(tmp_path, fake_splitk, monkeypatch):
    """gemv-like parameters through the bench stage (stand-in timer): the op's bytes exclude the
    scratch, the timing runs, and a counter left set by the timed launches fails the case."""
    import benchmarks.common as common
    from validation import bench, gpu_stages

    real_adapter = gpu_stages.KernelAdapter
    monkeypatch.setattr(gpu_stages, "KernelAdapter", lambda d, device="cpu": real_adapter(d, "cpu"))
    monkeypatch.setattr(bench, "rotation_copies", lambda nbytes: (2, True))

    def fake_measure(base_fn, head_fn):
        for i in range(4):
            head_fn(i)
        return {"base": None, "head": [8.0 + 0.01 * i for i in range(12)], "graph": True}

    monkeypatch.setattr(bench, "measure_interleaved", fake_measure)
    monkeypatch.setattr(common, "gpu_environment", lambda: {"gpu": "stand-in"})
    monkeypatch.setattr(common, "read_bandwidth", lambda: {"tbps": 4.5, "kernel": "r", "readers": {
        "r": {"p90_us": 1.0, "p10_us": 1.0, "median_us": 1.0}}})
    monkeypatch.setattr(common, "copy_bandwidth", lambda: {"tbps": 4.2, "kernel": "c", "p90_us": 1.0,
                                                           "p10_us": 1.0, "median_us": 1.0})
    (case,) = gpu_stages.bench_stage(_splitk_build_dirs(tmp_path / "ok", (2,)), base=None)["cases"]
    assert "error" not in case and case["head"]["median"] > 0
    assert case["bytes"] == (2 * 32 + 16 * 32 + 2 * 16) * 2  # x, w and y in bf16; no scratch, no counters
    fake_splitk.behaviour = "leak"
    (case,) = gpu_stages.bench_stage(_splitk_build_dirs(tmp_path / "leak", (2,)), base=None)["cases"]
    assert "left non-zero" in case["error"] and case["verdict"] == "AMBIGUOUS"


# -- before signing: the sign job's checks ------------------------------------------------------

def _signable(tmp_path):
    """A repository (base, head), a plan of alpha's two variants and the unsigned bundle a GPU job
    would write from it with the merge base's validator."""
    from gate_fixtures import commit, edit_lines, fake_builder, make_bundle, make_repo, validator_of

    root = tmp_path / "repo"
    base = make_repo(root)
    edit_lines(root, "kernels/ops/alpha.py", 2)
    head = commit(root, "alpha")
    built = fake_builder(root)("alpha")
    bundle = make_bundle("alpha", built, base=base, validator=validator_of(root))
    by_side = {(b["side"], json.dumps(b["variant"], sort_keys=True)): b["cubin_sha256"] for b in bundle["binaries"]}
    plan = {"schema": V.PLAN_SCHEMA, "kernel": "alpha", "base": {"ref": base, "sha": base, "sources_sha256": {}},
            "head": {"sha": head, "dirty": False, "sources_sha256": {}},
            "variants": [{"variant": v.variant, **{side: {"dir": f"alpha/{side}{i}", "tunables": v.tunables,
                                                           "build_key": "k", "cubin_sha256": by_side[(side, json.dumps(v.variant, sort_keys=True))]}
                                                    for side in ("head", "base")}}
                         for i, v in enumerate(built)]}
    return root, base, head, plan, bundle


def test_presign_accepts_the_plans_bundle_from_the_merge_bases_validator(tmp_path):
    from gate_fixtures import validator_of

    root, base, head, plan, bundle = _signable(tmp_path)
    assert V.presign_problems(bundle, plan, merge_base=base, validator=validator_of(root)) == []


@pytest.mark.parametrize("damage, message", [
    (lambda b, p: b["binaries"][0].update(cubin_sha256="f" * 64),
     'head binary {"batch": 1, "kernel": "alpha", "n": 64} ffffffffffffffff of the bundle is not the plan\'s'),
    (lambda b, p: b["binaries"][0].update(kernel="beta"),
     'head binary {"batch": 1, "kernel": "beta", "n": 64}'),
    (lambda b, p: b["binaries"].pop(), "of the plan is not in the bundle"),
    (lambda b, p: b["change"].update(base="torch"), "the bundle was timed against torch, not the plan's base"),
    (lambda b, p: p["base"].update(sha="e" * 40), "the plan was prepared against eeeeeeeeeeee, not the merge base"),
    (lambda b, p: b["change"].update(kernel="beta"), "the bundle is for kernel 'beta', the plan for 'alpha'"),
    (lambda b, p: b["environment"].update(validator_sha256="0" * 64), "validated by a different validator"),
    (lambda b, p: b["environment"].pop("validator_sha256"), "does not record the validator that produced it"),
    (lambda b, p: b.update(signature={"alg": "ed25519", "key_id": "x", "value": "y"}), "already signed"),
    (lambda b, p: p.pop("variants"), "the plan is malformed"),
])
def test_presign_refuses_a_bundle_that_is_not_the_plans(tmp_path, damage, message):
    from gate_fixtures import validator_of

    root, base, head, plan, bundle = _signable(tmp_path)
    damage(bundle, plan)
    problems = V.presign_problems(bundle, plan, merge_base=base, validator=validator_of(root))
    assert any(message in p for p in problems), problems


def test_presign_command_reads_the_validator_at_the_merge_base(tmp_path, capsys):
    from validation import bundle as B
    from gate_fixtures import commit, write

    root, base, head, plan, bundle = _signable(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    B.write_bundle_atomic(tmp_path / "bundle.json", bundle)
    def presign(base=base, plan=tmp_path / "plan.json"):
        return V.presign_main(["presign", str(tmp_path / "bundle.json"), "--plan", str(plan),
                               "--base", base, "--head", head, "--repo", str(root)])

    assert presign() == 0, capsys.readouterr().err
    # The base branch moved on with a validator fix after the PR forked: the merge base is still
    # `base`, whose validator produced the bundle, so it may be signed.
    write(root, "validation/numerics.py", "TOLERANCE = 1e-4\n")
    import subprocess

    subprocess.run(["git", "checkout", "-q", "-b", "later", base], cwd=root, check=True)
    later = commit(root, "numerics fix on the base branch")
    assert presign(base=later) == 0, capsys.readouterr().err
    # A bundle produced by that later validator is not the merge base's.
    bundle["environment"]["validator_sha256"] = B.validator_fingerprint_of_tree(root)[0]
    B.write_bundle_atomic(tmp_path / "bundle.json", bundle)
    capsys.readouterr()
    assert presign() == 1
    assert "refusing to sign" in capsys.readouterr().err
    assert presign(plan=tmp_path / "none.json") == 2
    assert "cannot read plan" in capsys.readouterr().err
    assert presign(base="no-such-rev") == 2
    assert "no merge base" in capsys.readouterr().err


def _block_signable(tmp_path):
    """The composite: a block plan of alpha's variants as the block's cases at two batches, and
    the bundle a GPU job would write from it."""
    root, base, head, plan, bundle = _signable(tmp_path)
    cases = {side: [{"role": "alpha", "kernel": "alpha", "shape": v["variant"], "tunables": {},
                     "cubin_sha256": v[side]["cubin_sha256"]} for v in plan["variants"]]
             for side in ("head", "base")}
    block_plan = {"schema": V.BLOCK_PLAN_SCHEMA, "kernel": "block", "base": {"ref": base, "sha": base},
                  "head": {"sha": head},
                  "batches": [{"batch": c["shape"]["batch"], "head": {"cases": [c]}, "base": {"cases": [cb]}}
                              for c, cb in zip(cases["head"], cases["base"])]}
    bundle["change"]["kernel"] = "block"
    return root, base, block_plan, bundle


def test_presign_accepts_the_block_plans_bundle(tmp_path):
    from gate_fixtures import validator_of

    root, base, plan, bundle = _block_signable(tmp_path)
    assert V.presign_problems(bundle, plan, merge_base=base, validator=validator_of(root)) == []


def test_presign_refuses_a_block_bundle_with_a_cubin_the_plan_does_not_name(tmp_path):
    from gate_fixtures import validator_of

    root, base, plan, bundle = _block_signable(tmp_path)
    bundle["binaries"][0]["cubin_sha256"] = "f" * 64
    problems = V.presign_problems(bundle, plan, merge_base=base, validator=validator_of(root))
    assert any("ffffffffffffffff of the bundle is not the plan's" in p for p in problems), problems
    assert any("of the plan is not in the bundle" in p for p in problems), problems
