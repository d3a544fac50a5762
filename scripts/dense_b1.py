"""The block's dense output-side ops, variant by variant, on a GPU host: shared_gate_up
(a_s = SiTU(h @ W_sgu.T), 7168 -> 2 x 6144) and latent_out (out = x + n @ W_up.T + a_s @ W_sd.T).
Up to the stream design's largest batch (STREAM_MAX_BATCH), each as the mma design
(stream_max_batch 0, round 2's) and as stream variants (kernels/ops/latent_out.py); past it, the
mma design's tunables (MMA_SWEEP). Side by side with the read-only streaming ceiling of the same
run. A variant the build refuses (say, more shared memory than a CTA may have) or the GPU host
cannot load is recorded as such and the others go on.

  python scripts/dense_b1.py plan [--root .devcarry/dense]       # CPU host with the DSL: build
  PYTHONPATH=. python3 scripts/dense_b1.py run --out DIR          # GPU host (no DSL), carrying ROOT
  PYTHONPATH=. python3 scripts/dense_b1.py block --out DIR        # the same, the whole block

Per variant (k3 widths, batch 1 unless --batches says more): outputs poisoned with NaN, checked
finite, relative Frobenius error against the float64 oracle within block_proof's policy
(max(2 x the bf16 torch path's error, 2^-9)), run twice bitwise identical, bitwise compared with
the default variant; then timed the way block_proof times one op: a CUDA graph of back-to-back
launches, each on its own weight copy rotated past the L2. Bytes: block_proof.op_bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from scripts.explore_common import invocation  # noqa: E402

SGU = {"hidden": 7168, "shared_inter": 6144}
LO = {"hidden": 7168, "latent": 3584, "shared_inter": 6144}


def variants(batches) -> list[tuple[str, str, dict, dict]]:
    """(id, kernel, shape, tunables): the defaults, the mma design, and stream alternatives."""
    v = []
    for T in batches:
        if T > STREAM_MAX_BATCH:
            v += _mma_variants(T)
            continue
        s = {"batch": T, **SGU}
        sm = {"stream_max_batch": max(1, T)}
        v.append((f"sgu_b{T}_default", "shared_gate_up", s, {}))
        v.append((f"sgu_b{T}_mma", "shared_gate_up", s, {"stream_max_batch": 0}))
        for rows, thr in ((1, 64), (1, 256), (2, 64), (2, 128)):
            v.append((f"sgu_b{T}_r{rows}t{thr}", "shared_gate_up", s, {**sm, "stream_rows": rows, "stream_threads": thr}))
        s = {"batch": T, **LO}
        v.append((f"lo_b{T}_default", "latent_out", s, {}))
        v.append((f"lo_b{T}_mma", "latent_out", s, {"stream_max_batch": 0}))
        for rows, up, down in ((1, 32, 64), (1, 64, 96), (1, 64, 192), (2, 64, 128), (2, 32, 64)):
            v.append((f"lo_b{T}_r{rows}u{up}d{down}", "latent_out", s,
                      {**sm, "stream_rows": rows, "stream_up_threads": up, "stream_down_threads": down}))
    return v


# The stream design's largest batch (the manifest's stream_max_batch choices end at 4); past it
# the mma design's tunables: w = warps per CTA, rt = row tiles per warp, ku = k unroll (defaults
# w8 rt2 ku8).
STREAM_MAX_BATCH = 4
MMA_SWEEP = {"w4": {"warps_per_cta": 4}, "w16": {"warps_per_cta": 16}, "rt4": {"row_tiles": 4},
             "w4rt4": {"warps_per_cta": 4, "row_tiles": 4}, "w16rt4": {"warps_per_cta": 16, "row_tiles": 4},
             "ku4": {"k_unroll": 4}}


def _mma_variants(T: int) -> list[tuple[str, str, dict, dict]]:
    v = []
    for tag, name, shape in (("sgu", "shared_gate_up", SGU), ("lo", "latent_out", LO)):
        s = {"batch": T, **shape}
        v.append((f"{tag}_b{T}_default", name, s, {}))
        v += [(f"{tag}_b{T}_{k}", name, s, tun) for k, tun in MMA_SWEEP.items()]
    return v


def _git(*args: str) -> str | None:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def plan(args) -> int:
    from kernels.build import BuildError, build_variant

    root = Path(args.root).resolve()
    cases, refused = [], []
    for vid, name, shape, tun in variants(args.batches):
        try:
            a = build_variant(name, shape, tun, root=root)
        except BuildError as e:  # e.g. more shared memory than a CTA may have: not a variant
            refused.append({"id": vid, "kernel": name, "shape": shape, "tunables": tun, "error": str(e)})
            print(f"  {vid:28s} refused by the build: {e}", flush=True)
            continue
        r = a.meta["resources"]
        cases.append({"id": vid, "kernel": name, "shape": shape, "tunables": a.tunables,
                      "dir": str(Path(a.dir).resolve().relative_to(REPO)), "cubin_sha256": a.cubin_sha256,
                      "registers": r["registers"], "launch": a.meta["launch"]})
        print(f"  {vid:28s} regs {r['registers']:3d} {a.meta['launch']['grid'][0]:5d} x {a.meta['launch']['block'][0]:4d}"
              f" smem {a.meta['launch']['smem_bytes']}", flush=True)
    doc = {"commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--", "kernels", "scripts")),
           "command": invocation("python"), "cases": cases, "refused": refused}
    out = root / "dense_plan.json"
    out.write_text(json.dumps(doc, indent=1))
    print(f"plan: {len(cases)} variants -> {out.relative_to(REPO)}")
    return 0


def run(args) -> int:
    import torch

    from benchmarks.common import gpu_environment, l2_bytes, read_bandwidth, rotation_count, time_graph
    from block_proof import judge, op_bytes
    from kernels import reference as R
    from kernels.config import get_config
    from kernels.launch import CubinKernel

    cfg = get_config("k3")
    plan_doc = json.loads((Path(args.root) / "dense_plan.json").read_text())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": invocation("PYTHONPATH=. python3"),
           "plan_command": plan_doc["command"], "commit": plan_doc["commit"], "sources_dirty": plan_doc["dirty"],
           "environment": gpu_environment(), "cases": []}
    doc["read_ceiling"] = read_bandwidth(reps=20)
    tb = doc["read_ceiling"]["tbps"]
    print(f"read ceiling {tb:.3f} TB/s", flush=True)
    H, L, S = cfg.hidden, cfg.latent, cfg.shared_inter
    torch.manual_seed(0)

    def mat(rows, cols):
        return (torch.randn(rows, cols, device="cuda") * cols ** -0.5).to(torch.bfloat16)

    l2 = l2_bytes()
    ns = min(8, rotation_count(2 * S * H * 2, l2))
    nl = min(8, rotation_count((H * L + H * S) * 2, l2))
    w_sgu = [mat(2 * S, H) for _ in range(ns)]
    w_up = [mat(H, L) for _ in range(nl)]
    w_sd = [mat(H, S) for _ in range(nl)]
    kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
    first = {}
    for case in plan_doc["cases"]:
        k = CubinKernel.from_dir(REPO / case["dir"])
        if k.sha256 != case["cubin_sha256"]:
            raise SystemExit(f"{case['dir']}: cubin sha256 differs from the plan's")
        T = case["shape"]["batch"]
        torch.manual_seed(100 + T)  # the same inputs for every variant of a batch
        h = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        n = torch.randn(T, L, device="cuda").to(torch.bfloat16)
        gu = h.float() @ w_sgu[0].float().T
        a_in = R.situ(gu[:, :S], gu[:, S:], **kw).to(torch.bfloat16)
        nbytes = op_bytes(cfg, T, 0)[case["kernel"]]
        if case["kernel"] == "shared_gate_up":
            outs = [torch.empty(T, S, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            launch_once = lambda o: k(h, w_sgu[0], o)  # noqa: E731
            gu64 = h.double() @ w_sgu[0].double().T
            oracle = R.situ(gu64[:, :S], gu64[:, S:], **kw)
            torch_path = a_in
            rot = ns
            timed = lambda i, o=torch.empty(T, S, device="cuda", dtype=torch.bfloat16): k(h, w_sgu[i % ns], o)  # noqa: E731
        else:
            outs = [torch.empty(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            launch_once = lambda o: k(x, n, w_up[0], a_in, w_sd[0], o)  # noqa: E731
            oracle = R.residual(x, R.linear(n, w_up[0], compute_dtype=torch.float64),
                                a_in.double() @ w_sd[0].double().T, compute_dtype=torch.float64)
            torch_path = R.residual(x, R.linear(n, w_up[0]), (a_in.float() @ w_sd[0].float().T).to(torch.bfloat16))
            rot = nl
            timed = lambda i, o=torch.empty(T, H, device="cuda", dtype=torch.bfloat16): k(  # noqa: E731
                x, n, w_up[i % nl], a_in, w_sd[i % nl], o)
        row = {"id": case["id"], "kernel": case["kernel"], "batch": T, "tunables": case["tunables"],
               "cubin_sha256": case["cubin_sha256"], "launch": case["launch"], "registers": case["registers"]}
        try:
            k.load()  # a variant the host cannot load (LaunchError) is recorded below like any other failure
            for o in outs:
                o.fill_(float("nan"))
                launch_once(o)
            torch.cuda.synchronize()
            row["numerics"] = judge(case["id"], outs[0], oracle, torch_path)
            row["deterministic"] = bool(torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)))
            key = (case["kernel"], T)
            if key not in first:
                first[key] = (case["id"], outs[0].clone())
            row["bitwise_same_as"] = [first[key][0], bool(torch.equal(outs[0].view(torch.int16),
                                                                      first[key][1].view(torch.int16)))]
            t = time_graph(timed, launches=max(20, rot), replays=args.replays)
            us = t.median_us
            row.update(timing=t.summary(), us=us, bytes=nbytes, tbps=nbytes / us / 1e6, of_read=nbytes / us / 1e6 / tb)
            ok = row["numerics"]["passed"] and row["deterministic"]
            print(f"{case['id']:28s} {us:7.2f} us {row['tbps']:.3f} TB/s {100 * row['of_read']:5.1f}%  "
                  f"err {row['numerics']['kernel']['rel_fro']:.2e} ratio {row['numerics']['ratio']:.3f} "
                  f"{'ok' if ok else 'FAIL'} same-as-{first[key][0]} {row['bitwise_same_as'][1]}", flush=True)
        except Exception as e:  # one failing variant must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"{case['id']}: ERROR {row['error']}", flush=True)
            torch.cuda.synchronize()
        doc["cases"].append(row)
        (out_dir / "dense_b1.json").write_text(json.dumps(doc, indent=1))
    doc["passed_numerics"] = all(r.get("numerics", {}).get("passed") and r.get("deterministic")
                                 for r in doc["cases"])
    (out_dir / "dense_b1.json").write_text(json.dumps(doc, indent=1))
    return 0 if doc["passed_numerics"] else 1


BLOCK_CONFIGS = {  # name: (shared_gate_up variant, latent_out variant, concurrent)
    "mma concurrent": ("sgu_b1_mma", "lo_b1_mma", True),
    "stream concurrent": ("sgu_b1_default", "lo_b1_default", True),
    "mma sequential": ("sgu_b1_mma", "lo_b1_mma", False),
    "stream sequential": ("sgu_b1_default", "lo_b1_default", False),
    "stream sgu r2t128 concurrent": ("sgu_b1_r2t128", "lo_b1_default", True),
}


def block(args) -> int:
    """The whole block at batch 1 (kernels.block.MoEBlock, the other kernels as the block builds
    them under `build`) with each dense design, shared_gate_up on its side stream or not: one
    CUDA graph of `calls` steps on distinct inputs each, configurations interleaved, `rounds`
    rounds, min of the rounds' medians (block_proof's measure)."""
    import torch

    from benchmarks.common import gpu_environment, read_bandwidth
    from block_proof import block_bytes, graph_time, judge
    from kernels import reference as R
    from kernels.block import BlockKernels, MoEBlock, load_block_kernels
    from kernels.config import get_config
    from kernels.launch import CubinKernel

    cfg = get_config("k3")
    T = 1
    plan_doc = json.loads((Path(args.root) / "dense_plan.json").read_text())
    dirs = {c["id"]: c for c in plan_doc["cases"]}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": invocation("PYTHONPATH=. python3"),
           "commit": plan_doc["commit"], "environment": gpu_environment(), "configs": {}}
    doc["read_ceiling"] = read_bandwidth(reps=20)
    tb = doc["read_ceiling"]["tbps"]
    w = R.make_weights(cfg, "cuda", seed=0)
    base = load_block_kernels(cfg, T, root=REPO / "build")
    doc["other_cubins"] = base.hashes()

    def dense(vid):
        k = CubinKernel.from_dir(REPO / dirs[vid]["dir"])
        k.load()
        return k

    torch.manual_seed(7)
    xs = [torch.randn(T, cfg.hidden, device="cuda").to(torch.bfloat16) for _ in range(args.calls)]
    blocks = {}
    for name, (sgu, lo, conc) in BLOCK_CONFIGS.items():
        kern = BlockKernels(**{**vars(base), "shared_gate_up": dense(sgu), "latent_out": dense(lo)})
        blk = MoEBlock(cfg, T, w, kernels=kern, concurrent=conc)
        outs = [torch.full_like(x, float("nan")) for x in xs]
        uniq = []
        for x, o in zip(xs, outs):
            blk.launch(x, o)
            torch.cuda.synchronize()
            uniq.append(int(blk.buf["n_groups"][0].item()))
        ids = blk.buf["ids"].clone()
        row = judge(name, outs[-1], R.moe_block(xs[-1], w, cfg, compute_dtype=torch.float64, ids=ids),
                    R.moe_block(xs[-1], w, cfg, ids=ids))
        doc["configs"][name] = {"shared_gate_up": sgu, "latent_out": lo, "concurrent": conc,
                                "cubins": {"shared_gate_up": dirs[sgu]["cubin_sha256"],
                                           "latent_out": dirs[lo]["cubin_sha256"]},
                                "numerics_last_step": row, "rounds": [],
                                "bytes_per_step": block_bytes(cfg, T, sum(uniq) / len(uniq))}
        blocks[name] = (blk, outs)
    for _ in range(args.rounds):  # interleaved
        for name, (blk, outs) in blocks.items():
            def steps(blk=blk, outs=outs):
                for x, o in zip(xs, outs):
                    blk.launch(x, o)
            doc["configs"][name]["rounds"].append(graph_time(steps))
    for name, c in doc["configs"].items():
        us = min(r["median_us"] for r in c["rounds"]) / args.calls
        c.update(us=us, fraction_of_read=c["bytes_per_step"] / us / 1e6 / tb)
        print(f"{name:32s} {us:7.1f} us {100 * c['fraction_of_read']:5.1f}% of read  rounds "
              f"{[round(r['median_us'] / args.calls, 1) for r in c['rounds']]}  numerics "
              f"{'ok' if c['numerics_last_step']['passed'] else 'FAIL'}", flush=True)
    (out_dir / "dense_block_b1.json").write_text(json.dumps(doc, indent=1))
    return 0 if all(c["numerics_last_step"]["passed"] for c in doc["configs"].values()) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    pp = sub.add_parser("plan", help="build the variants (CPU host, needs the DSL)")
    pp.add_argument("--root", default=".devcarry/dense")
    pp.add_argument("--batches", nargs="+", type=int, default=[1])
    pr = sub.add_parser("run", help="check and time the variants (GPU host)")
    pr.add_argument("--root", default=".devcarry/dense")
    pr.add_argument("--out", required=True)
    pr.add_argument("--replays", type=int, default=30)
    pb = sub.add_parser("block", help="the whole block at batch 1 with each dense design (GPU host)")
    pb.add_argument("--root", default=".devcarry/dense")
    pb.add_argument("--out", required=True)
    pb.add_argument("--calls", type=int, default=8)
    pb.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    return {"plan": plan, "run": run, "block": block}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
