"""`validate --all` on the CPU: prepare (fakes for the builds), the carry (cubin + meta.json only,
deduplicated, packed), unpacking, the run's order, budget and progress, the sanitizer stage's
per-kernel verdicts, the block bundle from a recorded run, and the CLI wiring."""

from __future__ import annotations

import json
import tarfile

import pytest

from validation.policy import OWN_STAGES

from validation import plan as P
from validation import sanitize as S
from validation.race.dynamic import ToolResult


def _folder(root, rel, cubin=b"CUBIN", extra=True):
    d = root / rel
    d.mkdir(parents=True)
    (d / "kernel.cubin").write_bytes(cubin)
    (d / "meta.json").write_text(json.dumps({"kernel": rel.split("/")[0]}))
    if extra:
        (d / "kernel.ptx").write_text("ptx " * 1000)
        (d / "kernel.sass").write_text("sass " * 1000)
    return rel


def _kplan(kernel, head, base):
    return {"schema": "fasttrack.validate-plan/1", "kernel": kernel,
            "variants": [{"variant": {"batch": 1}, "head": {"dir": head}, "base": {"dir": base}}]}


def _prepare(tmp_path, fail=()):
    from validation.validate import ValidateError

    build = tmp_path / "build"
    _folder(build, "gemv/h1", b"A")
    _folder(build, "gemv/b1", b"A")  # an identical cubin in another folder: stored once
    _folder(build, "rmsnorm/h1", b"B")
    _folder(build, "router_select/m1", b"C")
    _folder(build, "router/h1", b"D")

    def prepare_kernel(k, path):
        if k in fail:
            raise ValidateError(f"{k} does not build")
        plan = {"gemv": _kplan("gemv", "gemv/h1", "gemv/b1"), "rmsnorm": _kplan("rmsnorm", "rmsnorm/h1", "rmsnorm/h1")}[k]
        path.write_text(json.dumps(plan))
        return plan

    def prepare_block(path):
        plan = {"schema": "fasttrack.block-plan/1", "batches": [
            {"batch": 1, "head": {"cases": [{"dir": "router/h1"}]}, "base": {"cases": [{"dir": "router/h1"}]}}]}
        path.write_text(json.dumps(plan))
        return plan

    def build_minis(kernels):
        return [{"id": "sel", "kernel": "router_select", "dir": "router_select/m1", "cubin_sha256": "x"}], \
            ["mm (moe_w2 {}): does not build: boom"]

    root = tmp_path / "carry"
    doc = P.prepare_all("HEAD", root, kernels=["gemv", "rmsnorm"], build_root=build, prepare_kernel=prepare_kernel,
                        prepare_block=prepare_block, build_minis=build_minis, log=lambda m: None)
    return root, doc


def test_prepare_all_writes_plans_and_a_deduplicated_cubin_only_carry(tmp_path):
    root, doc = _prepare(tmp_path)
    assert doc["prepared"] == ["gemv", "rmsnorm", "sanitize", "block"] and not doc["failed"]
    assert sorted(p.name for p in (root / "plans").iterdir()) == ["block.json", "gemv.json", "rmsnorm.json",
                                                                "sanitize.json"]
    assert doc["carry"]["folders"] == 5 and doc["carry"]["distinct_cubins"] == 4
    assert not (root / "builds").exists()
    with tarfile.open(root / P.ARCHIVE) as tf:
        names = tf.getnames()
        assert not any(n.endswith((".ptx", ".sass")) for n in names)
        assert "builds/gemv/b1/kernel.cubin" in names
        assert tf.getmember("builds/gemv/b1/kernel.cubin").islnk() or tf.getmember("builds/gemv/h1/kernel.cubin").islnk()
    assert json.loads((root / "prepare.json").read_text())["carry"]["archive_bytes"] > 0


def test_prepare_all_refuses_a_root_with_plans_and_records_a_failing_kernel(tmp_path):
    root, doc = _prepare(tmp_path, fail=("rmsnorm",))
    assert doc["failed"] == {"rmsnorm": "rmsnorm does not build"}
    assert (root / "plans" / "gemv.json").exists()
    with pytest.raises(P.PlanError, match="fresh"):
        P.prepare_all("HEAD", root, kernels=["gemv"], build_root=tmp_path / "build", log=lambda m: None)


def test_unpack_restores_every_folder_and_links(tmp_path):
    root, _ = _prepare(tmp_path)
    builds = P.unpack(root)
    assert (builds / "gemv" / "b1" / "kernel.cubin").read_bytes() == b"A"
    assert (builds / "gemv" / "h1" / "meta.json").exists()
    assert P.unpack(root) == builds  # already there: not unpacked again


def test_unpack_refuses_members_outside(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    evil = tmp_path / "evil.txt"
    evil.write_text("x")
    with tarfile.open(root / P.ARCHIVE, "w:xz") as tf:
        tf.add(evil, arcname="../evil.txt")
    with pytest.raises(P.PlanError, match="outside"):
        P.unpack(root)


def test_run_all_order_budget_and_summary(tmp_path):
    root, _ = _prepare(tmp_path)
    now = [0.0]
    calls = []

    def clock():
        return now[0]

    def sanitize(path, builds, out, left):
        calls.append(("sanitize", left))
        now[0] += 100
        return {"passed": True, "per_kernel": {"router_select": {"passed": True}}}

    def kernel(name, path, builds, out, left, dynamic, seeds):
        calls.append((name, dynamic["per_kernel"]))
        now[0] += 350 if name == "rmsnorm" else 50
        return {"verdict": "pass", "reasons": []}

    def block(path, builds, out, left, seeds):
        calls.append(("block", left))
        return {"verdict": "pass", "reasons": []}

    lines = []
    s = P.run_all(root, tmp_path / "out", budget_s=500, runners={"sanitize": sanitize, "kernel": kernel, "block": block},
                  clock=clock, log=lines.append)
    assert [c[0] for c in calls] == ["sanitize", "rmsnorm"]  # 50 s left: gemv needs 60, the block 240
    assert s["results"]["gemv"]["skipped"] and s["results"]["block"]["skipped"]
    assert any("--only gemv" in x for x in s["not_covered"])
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["results"]["rmsnorm"]["verdict"] == "pass"
    assert any("rmsnorm: pass (350 s)" in x for x in lines)
    only = P.run_all(root, tmp_path / "out2", budget_s=500, only=["block"], runners={"block": block},
                     clock=clock, log=lines.append)
    assert list(only["results"]) == ["block"]
    with pytest.raises(P.PlanError, match="no plan"):
        P.run_all(root, tmp_path / "out3", only=["nope"], log=lines.append)


def test_run_all_keeps_going_after_an_error(tmp_path):
    root, _ = _prepare(tmp_path)

    def kernel(name, *a):
        if name == "gemv":
            raise RuntimeError("device lost")
        return {"verdict": "pass", "reasons": []}

    s = P.run_all(root, tmp_path / "out", runners={"sanitize": lambda *a: {"passed": True}, "kernel": kernel,
                                                   "block": lambda *a: {"verdict": "pass"}}, log=lambda m: None)
    assert "device lost" in s["results"]["gemv"]["error"]
    assert s["results"]["rmsnorm"]["verdict"] == "pass"


def test_sanitize_stage_attributes_a_dirty_tool_to_its_kernel(tmp_path):
    import hashlib

    build = tmp_path / "b"
    ents = []
    for i, k in (("a", "router"), ("b", "moe_w2")):
        _folder(build, f"{k}/x", i.encode())
        ents.append({"id": i, "kernel": k, "variant": {}, "tunables": {}, "dir": f"{k}/x",
                     "cubin_sha256": hashlib.sha256(i.encode()).hexdigest()})
    seen = []

    def run_tool(tool, cmd, expected, **kw):
        seen.append((tool, tuple(expected)))
        dirty = tool == "racecheck" and "b" in expected
        return ToolResult(tool, not dirty, "1 hazard" if dirty else "clean", 1 if dirty else 0)

    res = S.stage(ents, build, tmp_path / "e.json", log_path=tmp_path / "l.log", sanitizer="cs", run_tool=run_tool)
    assert res["per_kernel"]["router"]["passed"] and not res["per_kernel"]["moe_w2"]["passed"]
    assert ("racecheck", ("b",)) in seen and ("memcheck", ("a", "b")) in seen
    d = S.dynamic_section(res, "moe_w2")
    assert d["passed"] is False and d["tools"]["racecheck"]["clean"] is False
    assert S.dynamic_section(res, "router")["passed"]
    assert S.dynamic_section(res, "router", ["r1 (router {}): does not build"])["passed"] is False
    assert S.dynamic_section({"stage_failure": "timed out"}, "router")["passed"] is False
    partial = {"stage_failure": "timed out", "per_kernel": {"router": {"passed": True, "tools": {
        "memcheck": {"clean": True}}}}}
    d = S.dynamic_section(partial, "router")
    assert d["passed"] is False and "racecheck" in d["reason"]
    assert S.dynamic_section(None, "router") is None


def test_sanitize_stage_refuses_a_changed_cubin(tmp_path):
    _folder(tmp_path, "router/x", b"new")
    ents = [{"id": "a", "kernel": "router", "variant": {}, "tunables": {}, "dir": "router/x", "cubin_sha256": "0" * 64}]
    res = S.stage(ents, tmp_path, tmp_path / "e.json", log_path=tmp_path / "l", sanitizer="cs",
                  run_tool=lambda *a, **k: pytest.fail("must not run"))
    assert not res["per_kernel"]["router"]["passed"] and "hash" in res["error"]


def test_fake_sanitizer_end_to_end_summary_parsing(tmp_path):
    """A stand-in compute-sanitizer that runs the child and prints the tool's summary line."""
    import stat
    import sys

    from validation.race.dynamic import run_tool

    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!{sys.executable}\n"
                    "import subprocess, sys\n"
                    "a = sys.argv[1:]\n"
                    "tool = a[a.index('--tool') + 1]\n"
                    "child = a[a.index('--print-limit') + 2:]\n"
                    "if child and child[0] == '--racecheck-report': child = child[2:]\n"
                    "r = subprocess.run(child)\n"
                    "print('========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)' if tool == 'racecheck'"
                    " else '========= ERROR SUMMARY: 0 errors')\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    child = [sys.executable, "-c", "from validation.race.dynamic import marker; print(marker('k', True))"]
    for tool in ("memcheck", "racecheck"):
        r = run_tool(tool, child, ["k"], timeout_s=60, sanitizer=str(fake))
        assert r.clean, r.reason
    r = run_tool("memcheck", child, ["k", "missing"], timeout_s=60, sanitizer=str(fake))
    assert not r.clean and "missing" in r.reason


def _block_plan():
    return {"schema": "fasttrack.block-plan/1", "kernel": "block", "base": {"ref": "main", "sha": "b" * 40},
            "head": {"sha": "h" * 40}, "batches": [
                {"batch": T, "head": {"cases": [{"role": "router", "kernel": "router", "shape": {"batch": T},
                                                 "tunables": {}, "build_key": "k", "dir": "router/h",
                                                 "cubin_sha256": "1" * 64}]},
                 "base": {"cases": [{"role": "router", "kernel": "router", "shape": {"batch": T}, "tunables": {},
                                     "build_key": "k", "dir": "router/b", "cubin_sha256": "2" * 64}]}}
                for T in (1, 2)]}


def test_block_bundle_from_a_recorded_run():
    from validation.block_stage import block_bundle

    num = {"passed": True, "ops": [{"what": "router logits", "passed": True}], "patterns": [],
           "block": {"what": "block out", "passed": True, "deterministic": True}}
    head = [100.0, 101, 100.5, 99.8, 100.2, 100.1]
    result = {"ceilings": {"read": {"tbps": 4.6}, "copy": {"tbps": 3.0}}, "environment": {"gpu": "H200"},
              "batches": {"1": {"numerics": num, "speed": {
                  "calls": 8, "bytes_per_step": 1.5e8, "samples_us": {"head": head, "base": [x * 1.2 for x in head]},
                  "torch": {"us": 200.0}, "speedup_vs_torch": 2.0}}}}
    b = block_bundle(_block_plan(), result, {"name": "block", "ok": True}, validator=("v" * 64, {}))
    assert b["change"]["kernel"] == "block"
    assert {(x["side"], x["cubin_sha256"][0]) for x in b["binaries"]} == {("head", "1"), ("base", "2")}
    assert b["benchmark"]["cases"][0]["verdict"] == "FAST"
    assert any("batch 2: not measured" in x for x in b["not_covered"])
    assert b["correctness"]["passed"]
    result["batches"]["1"]["speed"]["bytes_per_step"] = 1.5e9  # 15 TB/s: beyond the read ceiling
    assert block_bundle(_block_plan(), result, {"ok": True}, validator=("v" * 64, {}))["benchmark"]["cases"][0][
        "verdict"] == "IMPOSSIBLE"


def test_block_plan_is_checked_against_its_cubins(tmp_path):
    from validation.block_stage import BlockError, load_block_plan

    p = tmp_path / "plan.json"
    p.write_text(json.dumps(_block_plan()))
    with pytest.raises(BlockError, match="missing"):
        load_block_plan(p, tmp_path)
    p.write_text("{}")
    with pytest.raises(BlockError, match="not a block plan"):
        load_block_plan(p, tmp_path)


def test_cli_wiring(tmp_path, capsys):
    from validation.cli import main

    assert main(["validate", "--all"]) == 2
    assert "--root" in capsys.readouterr().err
    assert main(["validate", "--all", "--root", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "carry" in capsys.readouterr().err
    assert main(["validate", "rmsnorm", "--tunables", "threads"]) == 2
    assert main(["validate", "block"]) == 2
    assert "plan" in capsys.readouterr().err


def test_block_bundle_renders_its_report():
    from validation.block_stage import block_bundle
    from validation.report import render_report

    num = {"passed": False, "ops": [{"what": "router logits", "passed": False}], "patterns": [],
           "block": {"what": "block out", "passed": True, "deterministic": True}}
    head = [100.0, 101, 100.5, 99.8, 100.2, 100.1]
    result = {"ceilings": {"read": {"tbps": 4.6}, "copy": {"tbps": 3.0}}, "batches": {
        "1": {"numerics": num, "speed": {"calls": 8, "bytes_per_step": 1.5e8,
                                         "samples_us": {"head": head, "base": head}}},
        "2": {"error": "RuntimeError: boom"}}}
    b = block_bundle(_block_plan(), result, {"name": "block", "ok": True}, validator=("v" * 64, {}))
    assert b["verdict"] == "fail" and not b["correctness"]["passed"]
    assert "block" in render_report(b)


def test_gpu_host_modules_import_without_dsl_git_or_cryptography():
    import subprocess
    import sys

    from kernels.manifest import REPO_ROOT

    code = ("import sys\n"
            "for m in ('cutlass', 'git', 'cryptography', 'anthropic'): sys.modules[m] = None\n"
            "import validation.plan, validation.sanitize, validation.block_stage, validation.kernel_checks\n"
            "import validation.gpu_stages, validation.validate, kernels.block\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_prepare_only_the_block(tmp_path):
    build = tmp_path / "build"
    _folder(build, "router/h1", b"D")

    def prepare_block(path):
        plan = {"schema": "fasttrack.block-plan/1", "batches": [
            {"batch": 1, "head": {"cases": [{"dir": "router/h1"}]}, "base": {"cases": [{"dir": "router/h1"}]}}]}
        path.write_text(json.dumps(plan))
        return plan

    doc = P.prepare_all("HEAD", tmp_path / "r", kernels=[], with_sanitize=False, build_root=build,
                        prepare_kernel=lambda k, p: pytest.fail("prepared a kernel"), prepare_block=prepare_block,
                        log=lambda m: None)
    assert doc["prepared"] == ["block"] and doc["carry"]["folders"] == 1


def test_prepare_all_leaves_a_task_table_kernel_without_its_own_stage_out_and_says_so(tmp_path, monkeypatch):
    monkeypatch.delitem(OWN_STAGES, "megakernel")  # as if the megakernel had no stage of its own
    seen, logs = [], []

    _folder(tmp_path / "b", "rmsnorm/h1", b"B")

    def prepare_kernel(k, path):
        seen.append(k)
        plan = _kplan(k, "rmsnorm/h1", "rmsnorm/h1")
        path.write_text(json.dumps(plan))
        return plan

    doc = P.prepare_all("HEAD", tmp_path / "r", with_sanitize=False, with_block=False, build_root=tmp_path / "b",
                        prepare_kernel=prepare_kernel, log=logs.append)
    assert "megakernel" not in seen and "rmsnorm" in seen
    assert "task table" in doc["not_covered"]["megakernel"]
    assert any(m.startswith("prepare megakernel: not covered") for m in logs)


def test_validate_refuses_a_task_table_kernel_without_its_own_stage_with_one_clear_message(monkeypatch):
    from validation.validate import ValidateError, _kernel_variants

    monkeypatch.delitem(OWN_STAGES, "megakernel")

    with pytest.raises(ValidateError, match="megakernel reads a task table .*its own validation stage"):
        _kernel_variants("megakernel", None)


def _mega_plan(build):
    _folder(build, "megakernel/h1", b"H")
    _folder(build, "megakernel/b1", b"B")
    _folder(build, "megakernel/m1", b"M")
    _folder(build, "rmsnorm/c1", b"C")
    _folder(build, "gemv/unrelated", b"U")  # in the cache, not in the plan: not carried
    return {"schema": "fasttrack.megakernel-plan/1", "kernel": "megakernel",
            "variants": [{"variant": {"batch": 1}, "head": {"dir": "megakernel/h1"}, "base": {"dir": "megakernel/b1"}}],
            "sanitize": {"entries": [{"dir": "megakernel/m1"}]},
            "chain": [{"batch": 1, "cases": [{"dir": "rmsnorm/c1"}]}]}


def test_one_plan_is_carried_beside_it_and_unpacked_afresh_from_there(tmp_path):
    """`validate K --prepare` carries what its plan names (not the whole build cache, which
    does not fit a device call); the GPU host unpacks it beside the plan, afresh each time."""
    build = tmp_path / "build"
    plan = _mega_plan(build)
    path = build / "validate" / "megakernel" / "plan.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(plan))
    carry = P.carry_plan(path, build, plan)
    assert carry["folders"] == 4 and (path.parent / P.ARCHIVE).is_file()
    assert not (path.parent / "builds").exists()  # only the archive is left to carry
    assert P.plan_build_root(tmp_path / "other" / "plan.json") is None  # no carry beside that one
    builds = P.plan_build_root(path)
    assert builds == path.parent / "builds"
    got = sorted(str(f.relative_to(builds)) for f in builds.rglob("*") if f.is_file())
    assert got == sorted(f"{d}/{f}" for d in ("megakernel/h1", "megakernel/b1", "megakernel/m1", "rmsnorm/c1")
                         for f in ("kernel.cubin", "meta.json"))
    (builds / "megakernel" / "h1" / "kernel.cubin").write_bytes(b"STALE")  # a machine's older unpacking
    assert (P.plan_build_root(path) / "megakernel" / "h1" / "kernel.cubin").read_bytes() == b"H"
    assert "OVER" not in P.carry_note(carry) and "OVER" in P.carry_note({"archive_bytes": P.CARRY_LIMIT + 1})


def test_the_cli_prepares_a_carry_and_the_gpu_command_runs_from_it(tmp_path, monkeypatch, capsys):
    import validation.cmd_validate as C
    import validation.mega_stage as M
    from validation.cli import main

    build = tmp_path / "build"
    plan = _mega_plan(build)

    def prepare(base, *, build_root, plan_path, **kw):
        plan_path.write_text(json.dumps(plan))
        return {**plan, "base": {"sha": "b" * 40}}

    seen = {}

    def validate(plan_path, *, build_root, out_dir, **kw):
        seen.update(plan=plan_path, build_root=build_root)
        return {"verdict": "pass", "reasons": []}

    monkeypatch.setattr(M, "prepare", prepare)
    monkeypatch.setattr(M, "validate", validate)
    monkeypatch.setattr(C, "cuda_available", lambda: True)
    assert main(["validate", "megakernel", "--base", "HEAD", "--prepare", "--build-root", str(build)]) == 0
    out = capsys.readouterr().out
    assert "4 build folders" in out and "--build-root" not in out
    path = build / "validate" / "megakernel" / "plan.json"
    assert main(["validate", "megakernel", "--plan", str(path), "--out", str(tmp_path / "out")]) == 0
    assert seen["build_root"] == path.parent / "builds"
    assert (seen["build_root"] / "rmsnorm" / "c1" / "kernel.cubin").read_bytes() == b"C"
    # an explicit --build-root still wins
    assert main(["validate", "megakernel", "--plan", str(path), "--build-root", str(build),
                 "--out", str(tmp_path / "out2")]) == 0
    assert seen["build_root"] == build


def test_the_gpu_hosts_form_of_the_cli_ends_a_users_error_in_one_line(tmp_path):
    """`python -m validation.cli` runs the module as __main__, a second copy whose UserError is
    not the subcommands'; a user's error must still be one line and exit 2, not a traceback."""
    import subprocess
    import sys

    from kernels.manifest import REPO_ROOT

    r = subprocess.run([sys.executable, "-m", "validation.cli", "validate", "megakernel"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "fasttrack validate: validate megakernel runs from a plan: `fasttrack validate megakernel --base REV "
        "--prepare` here, then --plan P on the GPU host"]


def test_a_broken_carry_is_one_clear_error_and_leaves_no_half_unpacked_builds(tmp_path):
    path = tmp_path / "validate" / "megakernel" / "plan.json"
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    (path.parent / P.ARCHIVE).write_bytes(b"not an xz archive")
    with pytest.raises(P.PlanError, match="cannot be unpacked"):
        P.plan_build_root(path)
    assert not (path.parent / "builds").exists()
