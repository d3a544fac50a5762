"""What the exploration scripts (block_explore, router_explore, experts_b1_explore,
experts_batch_explore) share (and `invocation`, the recorded command line, which gpu_proof,
block_proof and dense_b1 use too): build a list of kernel variants on the CPU host, audit each
statically against its manifest roles, and copy the few files a GPU call needs into a small
carry folder with a plan.json; on the GPU host, read that plan back.

Each variant is (ident, kernel, shape, tunables). The carry folder holds <ident>/kernel.cubin and
<ident>/meta.json per variant (what kernels.launch.CubinKernel.from_dir loads) and plan.json:
the commit, whether kernels/ or scripts/ had uncommitted changes, the command, and per variant
its cubin sha256, registers, spills, launch configuration and static-audit verdict.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    """git's output, or a RuntimeError naming the command (a plan must not record an empty commit)."""
    p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {p.stderr.strip()}")
    return p.stdout.strip()


def invocation(prefix: str = "python") -> str:
    """This process's command line as it was typed (script and arguments), for the record."""
    import shlex

    return " ".join([prefix, *(shlex.quote(a) for a in sys.argv)])


def build_and_carry(variants, *, build_root: Path, carry: Path, command: str, jobs: int = 2,
                    extra: dict | None = None) -> int:
    """Build every (ident, kernel, shape, tunables) under `build_root`, audit it (PTX and SASS,
    manifest roles), replace `carry` with each variant's cubin and meta.json plus plan.json (with
    `extra`'s fields), and print one line per variant. Returns 1 when any static audit is not
    clean, 2 (one line, nothing built) when git cannot say which commit this is, else 0."""
    from kernels.build import build_variant
    from kernels.manifest import load_manifest
    from validation.race.artifacts import audit_artifact

    try:  # asked first: a plan must record its commit, and a failure here should cost no build
        # dirty: anything that decides the cubins or the audit verdicts recorded here
        commit = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--", "kernels", "scripts", "validation", "tests/fixtures"))
    except (RuntimeError, OSError) as e:
        print(f"explore: cannot record the commit: {e}", file=sys.stderr)
        return 2
    man = load_manifest()
    # Build and audit before touching `carry`: a failed build leaves the previous carry whole.
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:  # each build compiles in a child process
        arts = list(pool.map(lambda v: build_variant(v[1], v[2], v[3], root=build_root), variants))
    staging = carry.with_name(carry.name + ".new")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    entries = []
    for (ident, kernel, shape, _), art in zip(variants, arts):
        rep = audit_artifact(art, man.kernel(kernel), kernel=ident)
        d = staging / ident
        d.mkdir()
        for f in ("kernel.cubin", "meta.json"):
            shutil.copy2(Path(art.dir) / f, d / f)
        r = art.meta["resources"]
        launch = art.meta["launch"]
        entries.append({"id": ident, "kernel": kernel, "shape": shape, "tunables": art.tunables,
                        "cubin_sha256": art.cubin_sha256, "registers": r["registers"],
                        "spill_bytes": r["spill_store_bytes"] + r["spill_load_bytes"],
                        "launch": launch, "grid": launch["grid"],
                        "static_audit": {"clean": rep.clean, "rules": sorted(rep.rules_hit())}})
        print(f"{ident:30s} regs {r['registers']:3d} grid {launch['grid'][0]:6d} block {launch['block'][0]:4d} "
              f"smem {launch['smem_bytes']:6d} audit {'clean' if rep.clean else sorted(rep.rules_hit())}",
              flush=True)
    doc = {"commit": commit, "dirty": dirty, "command": command, **(extra or {}), "entries": entries}
    (staging / "plan.json").write_text(json.dumps(doc, indent=1))
    if carry.exists():
        shutil.rmtree(carry)
    staging.rename(carry)
    bad = [e["id"] for e in entries if not e["static_audit"]["clean"]]
    where = carry.relative_to(ROOT) if carry.is_relative_to(ROOT) else carry
    print(f"{len(entries)} variants -> {where}; static audit not clean: {bad or 'none'}")
    return 1 if bad else 0


def read_plan(carry: Path) -> dict:
    """The plan.json `build_and_carry` wrote into `carry`."""
    return json.loads((carry / "plan.json").read_text())


def entries(carry: Path) -> dict:
    """The carried variants by ident."""
    return {e["id"]: e for e in read_plan(carry)["entries"]}


def run_sanitizers(res: dict, script: str, markers: list[str], out_dir: Path, *, timeout_s: int = 60) -> None:
    """GPU host: each compute-sanitizer tool (validation.race.dynamic.TOOLS) over `python
    <script> child`, judged on its explicit clean summary plus every expected run marker;
    records the sanitizer's path and version in res["sanitizer"] and each tool's verdict in
    res["sanitizers"], appends the tools' output to out_dir/sanitizers.log."""
    import sys

    from validation.race.dynamic import TOOLS, find_sanitizer, run_tool

    san = find_sanitizer()
    res["sanitizer"] = {"path": san, "version": subprocess.run([san, "--version"], capture_output=True, text=True)
                        .stdout.strip().splitlines()[-1:] if san else None}
    res["sanitizers"] = {}
    cmd = [sys.executable, script, "child"]
    for tool in TOOLS:
        r = run_tool(tool, cmd, markers, timeout_s=timeout_s, log_path=out_dir / "sanitizers.log", sanitizer=san)
        res["sanitizers"][tool] = r.to_dict()
        print(f"{tool:10s} clean={r.clean} ({r.reason}) {r.seconds:.1f}s", flush=True)


def measure(script: str, carry: Path, out_dir: Path, name: str, sweep, sanitize=None) -> int:
    """GPU host, the skeleton of a `gpu` step: the plan's facts and the host's, the read-only
    ceiling, then `sweep(res, path, read_tbps)` (an exception is recorded in res["error"] and
    what was measured is kept), then `sanitize(res, out_dir)` when given; out_dir/<name>.json is
    written after each step. Returns 1 when the sweep raised, else 0."""
    import time
    import traceback

    from benchmarks.common import gpu_environment, read_bandwidth

    out_dir.mkdir(parents=True, exist_ok=True)
    plan_doc = read_plan(carry)
    res = {"commit": plan_doc["commit"], "plan_dirty": plan_doc["dirty"], "env": gpu_environment(),
           "command": invocation("PYTHONPATH=. python3"), "variants": plan_doc["entries"]}
    path = out_dir / f"{name}.json"
    t0 = time.time()
    res["ceiling_read"] = read_bandwidth(reps=10)
    read_tbps = res["ceiling_read"]["tbps"]
    print(f"read-only {read_tbps:.3f} TB/s ({time.time() - t0:.0f} s)", flush=True)
    try:
        sweep(res, path, read_tbps)
    except Exception:  # noqa: BLE001 - keep what was measured
        res["error"] = traceback.format_exc()[-3000:]
        print(res["error"], flush=True)
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"k3 done ({time.time() - t0:.0f} s)", flush=True)
    if sanitize is not None:
        sanitize(res, out_dir)
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"done ({time.time() - t0:.0f} s) -> {path}")
    return 0 if "error" not in res else 1


def routing_inputs(shape: dict, pattern: str, g, dev="cuda"):
    """One routing of `pattern` (validation.numerics.routing_ids) at the shape's batch (1 when
    it names none): ids, z [T, latent] bf16, and weights renormalised per token."""
    import torch

    from validation.numerics import routing_ids

    T = shape.get("batch", 1)
    ids = routing_ids(T, shape["n_experts"], shape["top_k"], pattern, g, dev)
    z = torch.randn(T, shape["latent"], generator=g).to(torch.bfloat16).to(dev)
    wts = torch.rand(T, shape["top_k"], generator=g).to(dev) + 0.05
    return ids, z, wts / wts.sum(-1, keepdim=True)


class ExpertsPair:
    """GPU host: one carried (moe_w13, moe_w2) variant pair: its ops (for shapes and references),
    its loaded kernels, moe_w2's o scratch and zeroed counters, and the two launches."""

    def __init__(self, carry: Path, e13: dict, e2: dict):
        import torch

        from kernels.launch import CubinKernel
        from kernels.ops.moe_experts import ExpertsDownOp, ExpertsUpOp

        self.up = ExpertsUpOp(e13["shape"], **e13["tunables"])
        self.down = ExpertsDownOp(e2["shape"], **e2["tunables"])
        self.k13, self.k2 = CubinKernel.from_dir(carry / e13["id"]), CubinKernel.from_dir(carry / e2["id"])
        self.k13.load()
        self.k2.load()
        s = self.down.tensor_specs()
        self.o = torch.empty(s["o"].shape, device="cuda")
        self.counters = torch.zeros(s["counters"].shape, dtype=torch.int32, device="cuda")

    def w13(self, z, w13, m, act):
        self.k13(z, w13, m["n_groups"], m["group_expert"], m["group_start"], m["sorted_slots"], act)

    def w2(self, act, w2, wts, m, c):
        self.k2(act, w2, wts, m["n_groups"], m["group_expert"], m["group_start"], m["sorted_slots"], self.o,
                self.counters, c)

    def check_markers(self, w13_id: str, w2_id: str, cfg, ids, z, wts, w, want) -> None:
        """The sanitized children's check of this pair on one routing: act against moe_w13's
        reference, then c against `want` (the routed experts' reference) with the counters left
        zero; a run marker per kernel (validation/race/dynamic.py), outputs NaN-poisoned first."""
        import torch

        from block_explore import _meta_of, _rel
        from validation.race.dynamic import marker

        m = _meta_of(ids, cfg.n_experts, self.up.groups)
        act = torch.full((self.up.slots, cfg.expert_inter), float("nan"), dtype=torch.bfloat16, device="cuda")
        self.w13(z, w.w13, m, act)
        torch.cuda.synchronize()
        a_err = _rel(act, self.up.reference(z=z, w13=w.w13, ids=ids, **m)["act"])
        print(marker(w13_id, bool(torch.isfinite(act.float()).all()) and a_err < 1e-2, rel_err=f"{a_err:.2e}"),
              flush=True)
        c = torch.full((ids.shape[0], cfg.latent), float("nan"), dtype=torch.bfloat16, device="cuda")
        self.w2(act, w.w2, wts, m, c)
        torch.cuda.synchronize()
        c_err = _rel(c, want)
        ok = bool(torch.isfinite(c.float()).all()) and c_err < 1e-2 and int((self.counters != 0).sum().item()) == 0
        print(marker(w2_id, ok, rel_err=f"{c_err:.2e}"), flush=True)
