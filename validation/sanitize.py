"""The dynamic race audit as a stage of `fasttrack validate`: the four compute-sanitizer tools over
small (`mini`-config) variants of the same kernel code.

    python -m validation.sanitize child --build-root R --entries E.json [--ids ID,...]
    python -m validation.sanitize stage --build-root R --entries E.json --out R.json [--timeout-s N]

`child` launches each mini variant once on fresh inputs (validation.kernel_checks: outputs
poisoned, sync words checked back at zero, outputs against the op's reference) and prints a run
marker per variant (validation/race/dynamic.py). `stage` runs `child` under memcheck, racecheck,
synccheck and initcheck in turn, each as `compute-sanitizer --tool T --report-api-errors no` with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 and a timeout, each judged by its explicit summary line
("ERROR SUMMARY: 0 errors", racecheck's "RACECHECK SUMMARY: 0 hazards ...") and every marker. All
variants share one child per tool; a tool that is not clean is run again per kernel, so each
kernel's bundle gets its own verdict (`per_kernel`).

The entries (`mini_entries`) are written by `validation.plan` on the CPU host: per variant an id,
the kernel, its build folder (relative to the build root) and cubin sha256. Runs on the GPU host
(no DSL, no git).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

# The mini variants: (id, kernel, shape, tunables). Small, so that racecheck instruments every
# shared-memory access in seconds; the same code paths as the k3 variants (stream and mma
# designs of the router, the persistent experts, split-K, the cluster reduction of gemv).
MINI_ROUTER = {"n_experts": 64, "hidden": 1024, "top_k": 8, "latent": 512}
MINI_EXPERTS = {"n_experts": 64, "latent": 512, "expert_inter": 512, "top_k": 8}
MINI_VARIANTS: tuple[tuple[str, str, dict, dict], ...] = (
    ("rmsnorm_b3", "rmsnorm", {"batch": 3, "width": 1024}, {}),
    ("gemv_b1", "gemv", {"batch": 1, "n": 256, "k": 1024, "out_dtype": "bfloat16"}, {}),
    ("gemv_b8", "gemv", {"batch": 8, "n": 256, "k": 1024, "out_dtype": "bfloat16"}, {}),
    ("router_b1", "router", {"batch": 1, **MINI_ROUTER}, {}),
    ("router_b2", "router", {"batch": 2, **MINI_ROUTER}, {}),
    ("router_select_b3", "router_select", {"batch": 3, "n_experts": 64, "top_k": 8}, {}),
    ("router_select_b21", "router_select", {"batch": 21, "n_experts": 64, "top_k": 8}, {}),
    ("moe_w13_b3", "moe_w13", {"batch": 3, **MINI_EXPERTS}, {}),
    ("moe_w2_b3", "moe_w2", {"batch": 3, **MINI_EXPERTS}, {}),
    ("shared_gate_up_b2", "shared_gate_up", {"batch": 2, "hidden": 1024, "shared_inter": 512}, {}),
    ("latent_out_b2", "latent_out", {"batch": 2, "hidden": 1024, "latent": 512, "shared_inter": 512}, {}),
    ("gated_situ_b5", "gated_situ", {"batch": 5, "width": 1032}, {}),
    ("residual_b5", "residual", {"batch": 5, "width": 1032}, {}),
    ("prodcons_p2c4", "prodcons", {"steps": 8, "width": 1024, "rows": 64, "producers": 2, "consumers": 4}, {}),
    ("splitk_gemv_b1", "splitk_gemv", {"batch": 1, "n": 896, "k": 7168}, {}),
    # the megakernel on 8 workers, every stage at mini widths (its own launcher: mega_check)
    ("megakernel_b2", "megakernel", {"batch": 2, "hidden": 1024, "latent": 512, "n_experts": 64, "top_k": 8,
                                     "expert_inter": 512, "shared_inter": 512, "workers": 8}, {}),
)
TOOL_TIMEOUT_S = 180.0


def mini_variants(kernels: list[str] | None = None) -> list[tuple[str, str, dict, dict]]:
    return [v for v in MINI_VARIANTS if kernels is None or v[1] in kernels]


def build_minis(kernels: list[str] | None, build_root: Path, repo_root: Path, log=print) -> tuple[list[dict], list[str]]:
    """CPU host (the DSL): build the mini variants into `build_root`; (entries, build failures).
    A mini that does not build is a failure recorded for its kernel, not a lost plan."""
    from kernels.build import BuildError, build_variant

    entries, failures = [], []
    for ident, kernel, shape, tun in mini_variants(kernels):
        try:
            a = build_variant(kernel, shape, tun or None, root=build_root, repo_root=repo_root)
        except BuildError as e:
            failures.append(f"{ident} ({kernel} {shape}): does not build: {str(e)[-300:]}")
            log(f"  mini {ident}: BUILD FAILED")
            continue
        entries.append({"id": ident, "kernel": kernel, "variant": dict(shape), "tunables": a.tunables,
                        "dir": Path(a.dir).resolve().relative_to(Path(build_root).resolve()).as_posix(),
                        "cubin_sha256": a.cubin_sha256})
        log(f"  mini {ident}: {'cached' if a.cache_hit else 'built'}")
    return entries, failures


def _check_entries(entries: list[dict], build_root: Path) -> list[str]:
    bad = []
    for e in entries:
        f = Path(build_root) / e["dir"] / "kernel.cubin"
        if not f.is_file():
            bad.append(f"{e['id']}: {e['dir']}/kernel.cubin is missing")
        elif hashlib.sha256(f.read_bytes()).hexdigest() != e["cubin_sha256"]:
            bad.append(f"{e['id']}: cubin does not hash to the plan's")
    return bad


def child(entries: list[dict], build_root: Path, ids: list[str] | None = None) -> int:
    """Launch every (chosen) mini variant once, checked, a run marker each."""
    from validation.kernel_checks import MultiKernel, kernel_cases
    from validation.numerics import load_policy
    from validation.race.dynamic import marker

    policy = load_policy()
    for e in entries:
        if ids and e["id"] not in ids:
            continue
        try:
            if e["kernel"] == "megakernel":  # a task table and counters: its own launcher
                ok, why = mega_check(Path(build_root) / e["dir"])
            else:
                mk = MultiKernel(Path(build_root) / e["dir"])
                r = mk.judge_case(kernel_cases(mk.name, mk.variant, (0,))[0], policy)
                ok, why = r["passed"], (r["reasons"][0] if r["reasons"] else "")
        except Exception as ex:  # noqa: BLE001 - the marker says it failed
            ok, why = False, f"{type(ex).__name__}: {ex}"
        print(marker(e["id"], ok, why=json.dumps(why[:200])), flush=True)
    return 0


def mega_check(build_dir: Path) -> tuple[bool, str]:
    """One launch of a megakernel build (kernels/megablock.py) on fresh weights: the output against
    the float64 oracle (its own selection pinned, validation/block_stage.py judge), every counter
    back at zero."""
    import torch

    from kernels import reference as R
    from kernels.megablock import MegaBlock
    from kernels.ops.megakernel import shape_config
    from validation.block_stage import judge

    variant = json.loads((Path(build_dir) / "meta.json").read_text())["variant"]
    cfg, T = shape_config(variant), int(variant["batch"])
    w = R.make_weights(cfg, "cuda", seed=0)
    blk = MegaBlock(cfg, T, w, build_dir=build_dir)
    x = R.make_hidden(cfg, T, "cuda")
    out = torch.full_like(x, float("nan"))
    blk.launch(x, out)
    torch.cuda.synchronize()
    ids = blk.buf["ids"]
    row = judge("megakernel", out, R.moe_block(x, w, cfg, compute_dtype=torch.float64, ids=ids),
                R.moe_block(x, w, cfg, ids=ids))
    clean = blk.counters_clean()
    ok = bool(row["passed"] and clean)
    return ok, "" if ok else f"rel_fro {row['kernel']['rel_fro']:.3g} (limit {row['rel_fro_limit']:.3g}), counters clean {clean}"


def sanitizer_version(san: str | None) -> str | None:
    import subprocess

    if not san:
        return None
    try:
        out = subprocess.run([san, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.strip().splitlines()
    return lines[-1] if lines else None


def stage(entries: list[dict], build_root: Path, entries_path: Path, *, log_path: Path,
          timeout_s: float = TOOL_TIMEOUT_S, sanitizer: str | None = None, run_tool=None, write=None) -> dict:
    """Every tool over one child of all entries; a tool not clean again per kernel. Returns
    {"sanitizer", "tools": {tool: result}, "per_kernel": {kernel: {"passed", "tools"}}};
    `write(result)` after each tool (a stage killed at its timeout keeps the tools it ran)."""
    from validation.race import dynamic

    run_tool = run_tool or dynamic.run_tool
    san = sanitizer or dynamic.find_sanitizer()
    res = {"sanitizer": {"path": san, "version": sanitizer_version(san)}, "tools": {}, "per_kernel": {},
           "variants": [{k: e[k] for k in ("id", "kernel", "variant", "tunables", "cubin_sha256")} for e in entries],
           "command": "compute-sanitizer --tool T --report-api-errors no (PYTORCH_NO_CUDA_MEMORY_CACHING=1)"}
    bad = _check_entries(entries, build_root)
    kernels = sorted({e["kernel"] for e in entries})
    if bad:
        res["error"] = "; ".join(bad)
        for k in kernels:
            res["per_kernel"][k] = {"passed": False, "tools": {}, "reason": res["error"]}
        return res
    base = [sys.executable, "-m", "validation.sanitize", "child", "--build-root", str(build_root),
            "--entries", str(entries_path)]
    per = {k: {"passed": True, "tools": {}} for k in kernels}
    for tool in dynamic.TOOLS:
        t0 = time.time()
        r = run_tool(tool, base, [e["id"] for e in entries], timeout_s=timeout_s, log_path=log_path, sanitizer=san)
        res["tools"][tool] = r.to_dict()
        print(f"sanitize {tool}: {'clean' if r.clean else 'NOT CLEAN'} ({r.reason}) {time.time() - t0:.1f} s", flush=True)
        for k in kernels:
            mine = [e["id"] for e in entries if e["kernel"] == k]
            if r.clean or r.errors is None and not r.kernels_ran:
                # clean, or it never ran (no sanitizer, a timeout before any marker): the same for each kernel
                per[k]["tools"][tool] = {"clean": r.clean, "reason": r.reason, "ids": mine}
                per[k]["passed"] = per[k]["passed"] and r.clean
                continue
            rk = run_tool(tool, base + ["--ids", ",".join(mine)], mine, timeout_s=timeout_s, log_path=log_path,
                          sanitizer=san)
            per[k]["tools"][tool] = {"clean": rk.clean, "reason": rk.reason, "ids": mine, "errors": rk.errors}
            per[k]["passed"] = per[k]["passed"] and rk.clean
            print(f"sanitize {tool} {k}: {'clean' if rk.clean else 'NOT CLEAN'} ({rk.reason})", flush=True)
        res["per_kernel"] = per
        if write is not None:
            write(res)
    res["per_kernel"] = per
    res["passed"] = all(p["passed"] for p in per.values())
    return res


def run_isolated(entries: list[dict], failures: list[str], build_root: Path, out_dir: Path,
                 budget_s: float = 8 * TOOL_TIMEOUT_S) -> dict:
    """The sanitize stage in a child process (validation.isolate) with a timeout: a hang or a
    crash is a failed stage with its log (`stage_failure`), never a lost bundle."""
    from .isolate import run_stage

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ep = out_dir / "entries.json"
    ep.write_text(json.dumps(entries))
    per_tool = max(30.0, min(TOOL_TIMEOUT_S, (budget_s - 30) / 5))  # four tools, and some re-runs
    st = run_stage("sanitize", ["-m", "validation.sanitize", "stage", "--build-root", str(build_root),
                                "--entries", str(ep), "--out", str(out_dir / "sanitize.json"),
                                "--timeout-s", str(per_tool)],
                   result_path=out_dir / "sanitize.json", log_path=out_dir / "stage.log",
                   timeout_s=max(60.0, budget_s - 20))
    try:  # each tool's verdict and wall time, for the caller's log
        for line in (out_dir / "stage.log").read_text(errors="replace").splitlines():
            if line.startswith("sanitize"):
                print(f"  {line}", file=sys.stderr, flush=True)
    except OSError:
        pass
    if not st.ok:
        res = {"passed": False, "per_kernel": {}}
        part = out_dir / "sanitize.partial.json"
        if part.is_file():  # the tools that finished before the timeout still judge their kernels
            try:
                res = json.loads(part.read_text())
            except ValueError:
                pass
        res.update({"stage_failure": st.reason, "passed": False, "build_failures": list(failures),
                    "stage": st.to_dict()})
        return res
    res = st.result
    res["build_failures"] = list(failures)
    res["stage"] = st.to_dict()
    return res


def dynamic_section(stage_result: dict | None, kernel: str, failures: list[str] | None = None) -> dict | None:
    """The bundle's race.dynamic for `kernel` from a sanitize stage result (None: not run)."""
    if stage_result is None:
        return None
    from validation.race.dynamic import TOOLS

    mine = stage_result.get("per_kernel", {}).get(kernel)
    if stage_result.get("stage_failure") and mine is None:
        return {"passed": False, "tools": {}, "variants": [], "reason": stage_result["stage_failure"]}
    variants = [v for v in stage_result.get("variants", []) if v["kernel"] == kernel]
    if mine is None and not failures:
        return None
    ran = set((mine or {}).get("tools", {}))
    missing = [t for t in TOOLS if t not in ran]
    passed = bool(mine and mine["passed"]) and not failures and not missing
    reason = "; ".join(failures or []) or (mine or {}).get("reason", "")
    if missing and mine is not None:
        reason = (reason + "; " if reason else "") + f"not run: {', '.join(missing)} ({stage_result.get('stage_failure', '')})"
    return {"passed": passed, "tools": (mine or {}).get("tools", {}), "variants": variants,
            "sanitizer": stage_result.get("sanitizer"), "command": stage_result.get("command"),
            "build_failures": list(failures or []), "reason": reason}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m validation.sanitize")
    ap.add_argument("step", choices=("child", "stage"))
    ap.add_argument("--build-root", type=Path, required=True)
    ap.add_argument("--entries", type=Path, required=True, help="a JSON list of mini entries")
    ap.add_argument("--ids", default="")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--timeout-s", type=float, default=TOOL_TIMEOUT_S)
    a = ap.parse_args(argv)
    entries = json.loads(a.entries.read_text())
    if a.step == "child":
        return child(entries, a.build_root, [i for i in a.ids.split(",") if i])
    if a.out is None:
        print("stage needs --out", file=sys.stderr)
        return 2
    partial = a.out.with_suffix(".partial.json")
    res = stage(entries, a.build_root, a.entries, log_path=a.out.with_suffix(".log"), timeout_s=a.timeout_s,
                write=lambda r: partial.write_text(json.dumps(r, indent=1, default=str)))
    a.out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
