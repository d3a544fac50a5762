"""The routed experts (moe_w13, moe_w2): at batches 2..16 the stream path with several tokens per
group (kernels/ops/moe_experts.py, `stream_max_batch`, `stream_slots`) against the block's
pipelined path; at batches 32 and 64 the persistent path's tunables (PERSISTENT_SWEEP) against
its defaults. One GPU call: numerics over the routing patterns; stress; the dynamic race audit of
the multi-token stream path (its token loop and the moe_w2 counters) and of the persistent path.

  python scripts/experts_batch_explore.py plan [--stream-sweep | --wg-sweep] [--batches 16 32 64]
                                                             # CPU host with the DSL: build, audit
  PYTHONPATH=. python3 scripts/experts_batch_explore.py gpu --out DIR
                                                             # GPU host (no DSL), carrying .devcarry/experts_bx

`plan` builds every variant of `variants()` into build/experts_bx, audits each statically (PTX and
SASS against the manifest roles) and copies cubin and metadata to .devcarry/experts_bx/<id>/ with
plan.json. `gpu`, in order:
  * the read-only ceiling;
  * k3, per batch, on 8 "uniform" routings (distinct inputs): every moe_w13 variant (act against
    the base's: relative difference), then every moe_w2 variant on the base's act (c the same
    way, counters left zero), each timed as a CUDA graph of the 8 launches (past the L2);
  * numerics against the float64 oracle over the routing patterns (uniform, hot, same, distinct;
    "same" puts every token of the batch in each group: the token loop's longest run), every
    (moe_w13, moe_w2) pair of one design; the error beside the bf16 torch path's (at most 2x);
  * stress: every moe_w2 variant but the base, of the batches from 8, launched 16 times on the
    same "hot" inputs, the second half beside bf16 matmuls on another stream: bitwise
    identical, counters zero after each launch;
  * compute-sanitizer memcheck, racecheck, synccheck, initcheck (validation/race/dynamic.py) over
    a child that launches, on a small model (64 experts, latent 512, intermediate 512, top 8),
    the stream variants at batch 3 with 1 and 2 slots, with and without pdl ("hot" routing:
    groups of 3 tokens run the token loop), and with the persistent stream grid (4 CTAs per
    SM striding over the items), and the persistent path at batch 20 (SMALL_PERSISTENT)
    and checks them against the references.
Results: DIR/experts_bx.json and DIR/sanitizers.log (the JSON is rewritten after every stage).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from explore_common import ExpertsPair, routing_inputs  # noqa: E402

BUILD = ROOT / "build" / "experts_bx"
CARRY = ROOT / ".devcarry" / "experts_bx"
K3 = {"n_experts": 896, "latent": 3584, "expert_inter": 3072, "top_k": 16}
SMALL = {"batch": 3, "n_experts": 64, "latent": 512, "expert_inter": 512, "top_k": 8}
BATCHES = (2, 4, 8, 16)
PIPELINED = {"pipeline": 1, "row_tiles": 4, "warps_per_cta": 4, "k_unroll": 2, "ctas_per_sm": 3, "stream": 0}
PATTERNS = ("uniform", "hot", "same", "distinct")
STREAM_MAX = 16  # past it, batches sweep the persistent path (`plan --stream-sweep`: the stream path)
# Batches 32 and 64 (the manifest's persistent path, `_pers`): rt = row tiles, w = warps per CTA,
# c = CTAs per SM, ku = k unroll (moe_w13 needs an even row_tiles).
PERSISTENT_SWEEP = {
    "rt4": {"row_tiles": 4},
    "c3": {"ctas_per_sm": 3},
    "rt4c3": {"row_tiles": 4, "ctas_per_sm": 3},
    "rt4w4c3": {"row_tiles": 4, "warps_per_cta": 4, "ctas_per_sm": 3},
    "w4c4": {"warps_per_cta": 4, "ctas_per_sm": 4},
    "ku4": {"k_unroll": 4},
}
CALLS = 8


def stream_tunables(slots: int, kib: int = 32, batch: int = 16, threads: int = 128, persist: int = 0) -> dict:
    return {"stream": 1, "stream_max_batch": max(16, batch), "stream_slots": slots, "stream_threads": threads,
            "stream_cta_kib": kib, "pdl": 1, "stream_ctas_per_sm": persist}


# `plan --stream-sweep` (batches 16-64): the block's choice (`blk`, kernels/block.py) against the
# stream path with one slot, a CTA per possible item (`s1`) or a persistent grid of N CTAs per SM
# striding over the routing's items (`spN`), and with 64 KiB CTAs of 256 threads (half the CTAs).
def stream_sweep(T: int) -> dict:
    # (7 per SM, measured in round 5, no longer builds for moe_w13: only 6 of its CTAs fit)
    return {"s1": stream_tunables(1, batch=T), "sp5": stream_tunables(1, batch=T, persist=5),
            "sp6": stream_tunables(1, batch=T, persist=6), "s1_64k": stream_tunables(1, 64, batch=T, threads=256)}


# `plan --wg-sweep` (batches 8-64): the block's choice (`blk`) against moe_w2 on the TMA-fed
# warpgroup path (`wg`: 4 stages of 128 k, 8-token tiles; `wgs3`/`wgs6`: 3/6 stages; `wgk64`: 8
# stages of 64 k; `wgn16`: 16-token tiles), moe_w13 the block's choice beside each.
# (`stream` 0 everywhere: to batch 16 the block's moe_w2 took the stream path, which wg yields to;
# past 16 the stream path does not apply, so it changes nothing there)
WG_SWEEP = {"wg": {"wg": 1, "stream": 0}, "wgs3": {"wg": 1, "stream": 0, "wg_stages": 3},
            "wgs6": {"wg": 1, "stream": 0, "wg_stages": 6},
            "wgk64": {"wg": 1, "stream": 0, "wg_k": 64, "wg_stages": 8},
            "wgn16": {"wg": 1, "stream": 0, "wg_n": 16}}
# `plan --wg13-sweep`: moe_w13 on its warpgroup path (`w13wg`, cp.async-fed: its tokens are
# gathered rows) against the block's choice, moe_w2 the block's choice beside each.
WG13_SWEEP = {"w13wg": {"wg": 1, "stream": 0}, "w13wgs3": {"wg": 1, "stream": 0, "wg_stages": 3}}


def variants(batches=BATCHES, stream_sweep_: bool = False, wg_sweep_: bool = False,
             wg13_sweep_: bool = False) -> list[tuple[str, str, dict, dict]]:
    """(id, kernel, shape, tunables): per batch and kernel the pipelined base (the block's
    choice before), then the stream candidates; then the small sanitized variants. With
    `stream_sweep_`, the block's choice and `stream_sweep` instead; with `wg_sweep_` or
    `wg13_sweep_`, the block's choice and it again with WG_SWEEP's tunables on moe_w2 or
    WG13_SWEEP's on moe_w13 (the other kernel the block's choice in every pair)."""
    from kernels.block import block_tunables

    swept = ("moe_w2", WG_SWEEP) if wg_sweep_ else ("moe_w13", WG13_SWEEP) if wg13_sweep_ else None
    v = []
    for T in batches:
        shape = {"batch": T, **K3}
        for kern, tag in (("moe_w13", "w13"), ("moe_w2", "w2")):
            if swept:
                blk = block_tunables(kern, T)
                v.append((f"b{T}_{tag}_blk", kern, shape, blk))
                for name, tun in swept[1].items():
                    v.append((f"b{T}_{tag}_{name}", kern, shape, {**blk, **(tun if kern == swept[0] else {})}))
                continue
            if stream_sweep_:
                v.append((f"b{T}_{tag}_blk", kern, shape, block_tunables(kern, T)))
                for name, tun in stream_sweep(T).items():
                    v.append((f"b{T}_{tag}_{name}", kern, shape, tun))
                continue
            if T > STREAM_MAX:  # past the stream path: the persistent path's tunables
                v.append((f"b{T}_{tag}_pers", kern, shape, {}))
                for name, tun in PERSISTENT_SWEEP.items():
                    v.append((f"b{T}_{tag}_{name}", kern, shape, tun))
                continue
            v.append((f"b{T}_{tag}_pipe", kern, shape, PIPELINED))
            for slots in (1, 2, 4):
                if slots <= T:
                    v.append((f"b{T}_{tag}_s{slots}", kern, shape, stream_tunables(slots)))
            v.append((f"b{T}_{tag}_s2_16k", kern, shape, stream_tunables(2, 16)))
    return v + small_variants()


# The sanitized variants: batch 3 on a small shape, each stream_slots (1: the block's choice; 2)
# with and without pdl. A "hot" routing gives groups of 3 tokens, so the token loop runs.
SMALL_SLOTS = (1, 2)


# The persistent path on the same small model at batch 20 (past the stream path and past one
# 16-row mma tile: a "hot" routing gives groups on both the one-tile and the full path), with
# the defaults and the tunable sets the block took there before its warpgroup paths (rt4: both
# kernels at batch 32; w4c4: moe_w2 at batch 64, moe_w13 built alongside to make a pair).
SMALL_PERSISTENT = {**SMALL, "batch": 20}
# wg: the warpgroup paths (moe_w2 TMA-fed, moe_w13 cp.async-fed); a "hot" routing gives them
# groups of more than their 8-token tiles, so their chunk loops run.
SMALL_PERSISTENT_TUNABLES = {"pers": {}, "rt4": {"row_tiles": 4}, "w4c4": {"warps_per_cta": 4, "ctas_per_sm": 4},
                             "wg": {"wg": 1}}



def small_variants() -> list[tuple[str, str, dict, dict]]:
    v = []
    for slots in SMALL_SLOTS:
        for pdl in (0, 1):
            tun = {"stream": 1, "stream_max_batch": 4, "stream_slots": slots, "pdl": pdl}
            v.append((f"small_w13_s{slots}_p{pdl}", "moe_w13", SMALL, tun))
            v.append((f"small_w2_s{slots}_p{pdl}", "moe_w2", SMALL, tun))
    # the persistent stream grid (4 CTAs per SM: 528 CTAs striding over 24 groups x 256 column
    # blocks of moe_w13, x 128 row blocks of moe_w2)
    tun = {"stream": 1, "stream_max_batch": 4, "stream_slots": 1, "pdl": 1, "stream_ctas_per_sm": 4}
    v.append(("small_w13_sp4_p1", "moe_w13", SMALL, tun))
    v.append(("small_w2_sp4_p1", "moe_w2", SMALL, tun))
    for tag, tun in SMALL_PERSISTENT_TUNABLES.items():
        v.append((f"small_w13_{tag}", "moe_w13", SMALL_PERSISTENT, tun))
        v.append((f"small_w2_{tag}", "moe_w2", SMALL_PERSISTENT, tun))
    return v


# -- CPU: build, audit, copy ----------------------------------------------------------------------


def plan(jobs: int, batches, stream_sweep_: bool = False, wg_sweep_: bool = False, wg13_sweep_: bool = False) -> int:
    from explore_common import build_and_carry, invocation

    return build_and_carry(variants(batches, stream_sweep_, wg_sweep_, wg13_sweep_), build_root=BUILD, carry=CARRY, jobs=jobs,
                           command=invocation(), extra={"batches": list(batches)})


# -- GPU ---------------------------------------------------------------------------------------------


def _entries() -> dict:
    from explore_common import entries

    return entries(CARRY)


def _pair_ids(ents, T):
    """(w13 id, w2 id) of each design at batch T, base first."""
    tags = sorted({i.split("_", 2)[2] for i in ents if i.startswith(f"b{T}_w13_")},
                  key=lambda t: t not in ("pipe", "pers", "blk"))
    return [(f"b{T}_w13_{t}", f"b{T}_w2_{t}") for t in tags]


def k3_sweep(res: dict, path: Path, read_tbps: float, batches) -> None:
    import torch

    from block_explore import _meta_of, _rel, graph_us
    from block_proof import judge, op_bytes
    from kernels import reference as R
    from kernels.config import get_config

    cfg = get_config("k3")
    ents = _entries()
    w = R.make_weights(cfg, "cuda", seed=0)
    torch.cuda.synchronize()
    kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
    res["k3"], res["numerics"] = {}, {}
    for T in batches:
        shape = {"batch": T, **K3}
        G = min(T * cfg.top_k, cfg.n_experts)
        g = torch.Generator(device="cpu").manual_seed(200 + T)
        steps = []
        for _ in range(CALLS):
            ids, z, wts = routing_inputs(shape, "uniform", g)
            steps.append({"ids": ids, "z": z, "weights": wts, "m": _meta_of(ids, cfg.n_experts, G)})
        n_unique = sum(int(s["m"]["n_groups"].item()) for s in steps) / CALLS
        ob = op_bytes(cfg, T, n_unique)
        act = torch.empty(T * cfg.top_k, cfg.expert_inter, dtype=torch.bfloat16, device="cuda")
        c = torch.empty(T, cfg.latent, dtype=torch.bfloat16, device="cuda")
        row = res["k3"][str(T)] = {"experts_per_step": n_unique, "moe_w13": {}, "moe_w2": {}}
        pairs = _pair_ids(ents, T)
        acts = cs = None
        for a_id, b_id in pairs:
            x = ExpertsPair(CARRY, ents[a_id], ents[b_id])
            outs_a, outs_c = [], []
            for i, s in enumerate(steps):
                act.fill_(float("nan"))
                x.w13(s["z"], w.w13, s["m"], act)
                torch.cuda.synchronize()
                outs_a.append(act.clone())
            acts = acts or outs_a
            for i, s in enumerate(steps):
                c.fill_(float("nan"))
                x.w2(acts[i], w.w2, s["weights"], s["m"], c)  # every moe_w2 on the base's act
                torch.cuda.synchronize()
                outs_c.append(c.clone())
            cs = cs or outs_c
            us13 = graph_us(lambda i: x.w13(steps[i]["z"], w.w13, steps[i]["m"], act), CALLS)
            us2 = graph_us(lambda i: x.w2(acts[i], w.w2, steps[i]["weights"], steps[i]["m"], c), CALLS)
            for kern, ident, us, outs, base in (("moe_w13", a_id, us13, outs_a, acts), ("moe_w2", b_id, us2, outs_c, cs)):
                r = {"us": us, "fraction_of_read": ob[kern] / us / 1e6 / read_tbps,
                     "rel_diff_vs_base": max(_rel(p, q) for p, q in zip(outs, base)),
                     "finite": all(bool(torch.isfinite(p.float()).all()) for p in outs),
                     "regs": ents[ident]["registers"], "launch": ents[ident]["launch"],
                     "tunables": ents[ident]["tunables"]}
                if kern == "moe_w2":
                    r["counters_zero"] = int((x.counters != 0).sum().item()) == 0
                row[kern][ident] = r
                print(f"b{T:<2d} {ident:16s} {us:8.2f} us {r['fraction_of_read']:6.1%} "
                      f"diff {r['rel_diff_vs_base']:.1e} finite {r['finite']}"
                      + (f" counters zero {r['counters_zero']}" if kern == "moe_w2" else ""), flush=True)
            row.setdefault("experts", {})[f"{a_id}+{b_id}"] = {
                "us": us13 + us2, "fraction_of_read": (ob["moe_w13"] + ob["moe_w2"]) / (us13 + us2) / 1e6 / read_tbps}
        path.write_text(json.dumps(res, indent=1, default=str))

        # numerics against the float64 oracle, every routing pattern, every design's pair
        gp = torch.Generator(device="cpu").manual_seed(1000 + T)
        nrow = res["numerics"][str(T)] = {}
        for pat in PATTERNS:
            ids, z, wts = routing_inputs(shape, pat, gp)
            m = _meta_of(ids, cfg.n_experts, G)
            oracle = R.routed_experts(z, ids, wts.double(), w.w13, w.w2, compute_dtype=torch.float64, **kw)
            path32 = R.routed_experts(z, ids, wts, w.w13, w.w2, **kw)
            rows = nrow[pat] = {}
            for a_id, b_id in pairs:
                x = ExpertsPair(CARRY, ents[a_id], ents[b_id])
                act.fill_(float("nan"))
                c.fill_(float("nan"))
                x.w13(z, w.w13, m, act)
                x.w2(act, w.w2, wts, m, c)
                torch.cuda.synchronize()
                j = judge(f"{a_id}+{b_id} {pat}", c, oracle, path32)
                j["counters_zero"] = int((x.counters != 0).sum().item()) == 0
                j["passed"] = j["passed"] and j["counters_zero"]
                rows[f"{a_id}+{b_id}"] = j
            bad = [k for k, j in rows.items() if not j["passed"]]
            worst = max(j["ratio"] for j in rows.values())
            print(f"b{T} oracle {pat:8s}: {len(rows)} pairs, worst ratio {worst:.3f}, failed: {bad or 'none'}",
                  flush=True)
        path.write_text(json.dumps(res, indent=1, default=str))
    res["stress"] = stress(ents, w, cfg, [T for T in batches if T >= 8])
    path.write_text(json.dumps(res, indent=1, default=str))
    del w
    torch.cuda.empty_cache()


def stress(ents, w, cfg, batches, runs: int = 16) -> dict:
    """Every pair of `batches` but the base (stream variants to batch 16, persistent
    tunables past it), `runs` launches each on the same "hot" inputs (the second half beside
    matmuls on another stream): moe_w13's act and moe_w2's c bitwise identical, moe_w2's counters
    zero after each."""
    import torch

    from block_explore import Occupier, _meta_of, _same_bits

    occ = Occupier()
    out = {}
    for T in batches:
        shape = {"batch": T, **K3}
        g = torch.Generator(device="cpu").manual_seed(300 + T)
        ids, z, wts = routing_inputs(shape, "hot", g)
        m = _meta_of(ids, cfg.n_experts, min(T * cfg.top_k, cfg.n_experts))
        act = torch.empty(T * cfg.top_k, cfg.expert_inter, dtype=torch.bfloat16, device="cuda")
        c = torch.empty(T, cfg.latent, dtype=torch.bfloat16, device="cuda")
        for a_id, b_id in _pair_ids(ents, T)[1:]:
            x = ExpertsPair(CARRY, ents[a_id], ents[b_id])
            first_a, mism_a = None, 0
            for r in range(runs):
                act.fill_(float("nan"))
                if r >= runs // 2:
                    occ.start()
                x.w13(z, w.w13, m, act)
                torch.cuda.synchronize()
                if first_a is None:
                    first_a = act.clone()
                elif not _same_bits(act, first_a):
                    mism_a += 1
            out[a_id] = {"runs": runs, "with_concurrent_matmul": runs - runs // 2, "not_bitwise_identical": mism_a}
            act.copy_(first_a)
            first, mism, nonzero = None, 0, 0
            for r in range(runs):
                c.fill_(float("nan"))
                if r >= runs // 2:
                    occ.start()
                x.w2(act, w.w2, wts, m, c)
                torch.cuda.synchronize()
                nonzero += int((x.counters != 0).sum().item() != 0)
                if first is None:
                    first = c.clone()
                elif not _same_bits(c, first):
                    mism += 1
            out[b_id] = {"runs": runs, "with_concurrent_matmul": runs - runs // 2, "not_bitwise_identical": mism,
                         "counters_left_nonzero": nonzero}
    bad = {i: r for i, r in out.items() if r["not_bitwise_identical"] or r.get("counters_left_nonzero")}
    print(f"stress: {len(out)} variants (moe_w13 and moe_w2) x {runs} runs; not identical / counters left: "
          f"{bad or 'none'}", flush=True)
    return out


SMALL_KERNELS = [ident for ident, *_ in small_variants()]


def child() -> int:
    """The sanitized child: each small stream variant on a "hot" routing at batch 3 (groups of
    3 tokens through 1 or 2 slots), then each small persistent variant on a "hot" routing at
    batch 20, checked against the reference (act, then c), a marker per kernel."""
    import dataclasses

    import torch

    from kernels import reference as R
    from kernels.config import get_config

    cfg = dataclasses.replace(get_config("mini"), name="mini_i512", expert_inter=SMALL["expert_inter"])
    ents = _entries()
    w = R.make_weights(cfg, "cuda", seed=3)
    g = torch.Generator(device="cpu").manual_seed(5)
    kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
    stream_tags = [f"s{slots}_p{p}" for slots in SMALL_SLOTS for p in (0, 1)] + ["sp4_p1"]
    for s, tags in ((SMALL, stream_tags), (SMALL_PERSISTENT, list(SMALL_PERSISTENT_TUNABLES))):
        ids, z, wts = routing_inputs(s, "hot", g)
        want = R.routed_experts(z, ids, wts, w.w13, w.w2, **kw)
        for tag in tags:
            x = ExpertsPair(CARRY, ents[f"small_w13_{tag}"], ents[f"small_w2_{tag}"])
            x.check_markers(f"small_w13_{tag}", f"small_w2_{tag}", cfg, ids, z, wts, w, want)
    return 0


def sanitize(res: dict, out_dir: Path) -> None:
    from explore_common import run_sanitizers

    # racecheck over the persistent variants (batch 20, every shared-memory access instrumented)
    # needs more than explore_common's default minute
    run_sanitizers(res, "scripts/experts_batch_explore.py", SMALL_KERNELS, out_dir, timeout_s=300)


def sanitize_only(out_dir: Path) -> int:
    """GPU host: the four sanitizers over the small variants; DIR/sanitize.json. 0 when every
    tool is clean (its summary and every marker)."""
    from benchmarks.common import gpu_environment
    from explore_common import read_plan

    out_dir.mkdir(parents=True, exist_ok=True)
    plan_doc = read_plan(CARRY)
    res = {"commit": plan_doc["commit"], "plan_dirty": plan_doc["dirty"], "env": gpu_environment(),
           "variants": [e for e in plan_doc["entries"] if e["id"] in SMALL_KERNELS]}
    sanitize(res, out_dir)
    (out_dir / "sanitize.json").write_text(json.dumps(res, indent=1, default=str))
    clean = all(r["clean"] for r in res["sanitizers"].values())
    print(f"sanitizers over {len(SMALL_KERNELS)} variants: {'CLEAN' if clean else 'NOT CLEAN'}")
    return 0 if clean else 1


def gpu(out_dir: Path, skip_sanitizers: bool, batches) -> int:
    from explore_common import measure

    return measure("scripts/experts_batch_explore.py", CARRY, out_dir, "experts_bx",
                   lambda res, path, read_tbps: k3_sweep(res, path, read_tbps, batches),
                   None if skip_sanitizers else sanitize)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--small-only", action="store_true", help="only the sanitized small variants")
    p.add_argument("--stream-sweep", action="store_true",
                   help="the block's choice against the stream path's grids (batches 16-64)")
    p.add_argument("--wg13-sweep", action="store_true",
                   help="the block's choice against moe_w13's warpgroup path (batches 2-64)")
    p.add_argument("--wg-sweep", action="store_true",
                   help="the block's choice against moe_w2's TMA-fed warpgroup path (batches 8-64)")
    g = sub.add_parser("gpu")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--skip-sanitizers", action="store_true")
    g.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    sub.add_parser("child")
    z = sub.add_parser("sanitize", help="only the four sanitizers over the small variants")
    z.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        return plan(a.jobs, [] if a.small_only else a.batches, a.stream_sweep, a.wg_sweep, a.wg13_sweep)
    if a.cmd == "child":
        return child()
    if a.cmd == "sanitize":
        return sanitize_only(a.out)
    return gpu(a.out, a.skip_sanitizers, a.batches)


if __name__ == "__main__":
    sys.exit(main())
