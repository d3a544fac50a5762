"""The routed experts at batch 1 (moe_w13, moe_w2): stream-design variants against the block's
previous (pipelined) variant, in one GPU call; the dynamic race audit of the stream path.

  python scripts/experts_b1_explore.py plan                  # CPU host with the DSL: build, audit
  PYTHONPATH=. python3 scripts/experts_b1_explore.py gpu --out DIR
                                                             # GPU host (no DSL), carrying .devcarry/experts_x

`plan` builds every variant of `variants()` into build/experts_x, audits each statically (PTX and
SASS against the manifest roles) and copies its cubin and metadata to .devcarry/experts_x/<id>/
with plan.json. `gpu`, in order:
  * the read-only ceiling;
  * k3, batch 1, on 8 routings (uniform pattern, distinct inputs): every moe_w13 variant (act
    compared with the base variant's: relative difference, bitwise), then every moe_w2 variant on
    the base's act (c compared the same way, counters left zero), each timed as a CUDA graph of
    the 8 launches (each launch reads 0.35-0.7 GB: past the L2);
  * numerics against the float64 oracle over the routing patterns (uniform, hot, same, distinct):
    every moe_w13 variant followed by the default stream moe_w2, every moe_w2 variant on the
    default stream moe_w13's act; the error beside the bf16 torch path's (policy: at most 2x it);
  * stress: every moe_w2 variant launched 16 times on the same inputs, the second half beside
    bf16 matmuls on another stream: bitwise identical, counters zero after each launch;
  * compute-sanitizer memcheck, racecheck, synccheck, initcheck (validation/race/dynamic.py) over
    a child that launches the small stream variants (64 experts, latent 512, intermediate 512,
    top 8, batch 1; the mini preset's intermediate 384 has 48 vectors per row, which no whole
    number of warps divides) with and without pdl and checks them against the references.
Results: DIR/experts_b1.json and DIR/sanitizers.log (the JSON is rewritten after every stage).
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

BUILD = ROOT / "build" / "experts_x"
CARRY = ROOT / ".devcarry" / "experts_x"
K3 = {"batch": 1, "n_experts": 896, "latent": 3584, "expert_inter": 3072, "top_k": 16}
SMALL = {"batch": 1, "n_experts": 64, "latent": 512, "expert_inter": 512, "top_k": 8}
PIPELINED = {"pipeline": 1, "row_tiles": 4, "warps_per_cta": 4, "k_unroll": 2, "ctas_per_sm": 3, "stream": 0}
PATTERNS = ("uniform", "hot", "same", "distinct")
CALLS = 8


def variants() -> list[tuple[str, str, dict, dict]]:
    """(id, kernel, shape, tunables); the first of each kernel is the base the others are
    compared with, `*_s128_8_p*` the candidates for the default."""
    v = [("w13_base", "moe_w13", K3, PIPELINED)]
    for threads, kib in ((64, 8), (128, 8), (128, 32), (256, 32)):  # 1 or 2 (gate, up) row pairs
        for pdl in (0, 1):
            v.append((f"w13_s{threads}_{kib}_p{pdl}", "moe_w13", K3,
                      {"stream": 1, "stream_threads": threads, "stream_cta_kib": kib, "pdl": pdl}))
    v.append(("w2_base", "moe_w2", K3, PIPELINED))
    for threads, kib in ((64, 8), (128, 8), (256, 8), (128, 16), (256, 16), (128, 32)):  # 1, 2 or 4 rows
        for pdl in (0, 1):
            v.append((f"w2_s{threads}_{kib}_p{pdl}", "moe_w2", K3,
                      {"stream": 1, "stream_threads": threads, "stream_cta_kib": kib, "pdl": pdl}))
    for threads, kib in ((64, 16), (256, 32)):  # 2 rows of 32 threads, 4 rows of 64
        v.append((f"w2_s{threads}_{kib}_p1", "moe_w2", K3,
                  {"stream": 1, "stream_threads": threads, "stream_cta_kib": kib, "pdl": 1}))
    for pdl in (0, 1):
        v.append((f"small_w13_p{pdl}", "moe_w13", SMALL, {"stream": 1, "pdl": pdl}))
        v.append((f"small_w2_p{pdl}", "moe_w2", SMALL, {"stream": 1, "pdl": pdl}))
    return v


DEFAULT_W13 = "w13_s128_32_p1"  # the manifest's defaults: feeds every moe_w2 variant's oracle check
DEFAULT_W2 = "w2_s128_32_p1"


# -- CPU: build, audit, copy ----------------------------------------------------------------------


def plan(jobs: int) -> int:
    from explore_common import build_and_carry, invocation

    return build_and_carry(variants(), build_root=BUILD, carry=CARRY, jobs=jobs,
                           command=invocation())


# -- GPU ---------------------------------------------------------------------------------------------


def _entries() -> dict:
    from explore_common import entries

    return entries(CARRY)


def k3_sweep(res: dict, path: Path, read_tbps: float) -> None:
    import torch

    from block_explore import _meta_of, _rel, _same_bits, graph_us
    from block_proof import judge, op_bytes
    from kernels import reference as R
    from kernels.config import get_config

    cfg = get_config("k3")
    ents = _entries()
    w = R.make_weights(cfg, "cuda", seed=0)
    torch.cuda.synchronize()
    kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
    G = min(cfg.top_k, cfg.n_experts)
    g = torch.Generator(device="cpu").manual_seed(101)
    steps = []
    for _ in range(CALLS):
        ids, z, wts = routing_inputs(K3, "uniform", g)
        steps.append({"ids": ids, "z": z, "weights": wts, "m": _meta_of(ids, cfg.n_experts, G)})
    ob = op_bytes(cfg, 1, float(cfg.top_k))
    act = torch.empty(cfg.top_k, cfg.expert_inter, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(1, cfg.latent, dtype=torch.bfloat16, device="cuda")
    base13 = [i for i in ents if i.startswith("w13_")]
    base2 = [i for i in ents if i.startswith("w2_")]
    sweep = res["k3"] = {"moe_w13": {}, "moe_w2": {}}
    # moe_w13: every variant on every step; the base's act per step feeds moe_w2
    acts = None
    for ident in base13:
        x = ExpertsPair(CARRY, ents[ident], ents[DEFAULT_W2])
        outs = []
        for s in steps:
            act.fill_(float("nan"))
            x.w13(s["z"], w.w13, s["m"], act)
            torch.cuda.synchronize()
            outs.append(act.clone())
        acts = acts or outs
        us = graph_us(lambda i: x.w13(steps[i]["z"], w.w13, steps[i]["m"], act), CALLS)
        r = {"us": us, "fraction_of_read": ob["moe_w13"] / us / 1e6 / read_tbps,
             "bitwise_same_as_base": all(_same_bits(a, b) for a, b in zip(outs, acts)),
             "rel_diff_vs_base": max(_rel(a, b) for a, b in zip(outs, acts)),
             "finite": all(bool(torch.isfinite(a.float()).all()) for a in outs),
             "regs": ents[ident]["registers"], "launch": ents[ident]["launch"], "tunables": ents[ident]["tunables"]}
        sweep["moe_w13"][ident] = r
        print(f"{ident:22s} {us:8.2f} us {r['fraction_of_read']:6.1%} same {r['bitwise_same_as_base']} "
              f"diff {r['rel_diff_vs_base']:.1e} finite {r['finite']}", flush=True)
    cs_base = None
    for ident in base2:
        x = ExpertsPair(CARRY, ents[DEFAULT_W13], ents[ident])
        outs = []
        for i, s in enumerate(steps):
            c.fill_(float("nan"))
            x.w2(acts[i], w.w2, s["weights"], s["m"], c)
            torch.cuda.synchronize()
            outs.append(c.clone())
        cs_base = cs_base or outs
        us = graph_us(lambda i: x.w2(acts[i], w.w2, steps[i]["weights"], steps[i]["m"], c), CALLS)
        r = {"us": us, "fraction_of_read": ob["moe_w2"] / us / 1e6 / read_tbps,
             "bitwise_same_as_base": all(_same_bits(a, b) for a, b in zip(outs, cs_base)),
             "rel_diff_vs_base": max(_rel(a, b) for a, b in zip(outs, cs_base)),
             "finite": all(bool(torch.isfinite(a.float()).all()) for a in outs),
             "counters_zero": int((x.counters != 0).sum().item()) == 0,
             "regs": ents[ident]["registers"], "launch": ents[ident]["launch"], "tunables": ents[ident]["tunables"]}
        sweep["moe_w2"][ident] = r
        print(f"{ident:22s} {us:8.2f} us {r['fraction_of_read']:6.1%} same {r['bitwise_same_as_base']} "
              f"diff {r['rel_diff_vs_base']:.1e} counters zero {r['counters_zero']}", flush=True)
    path.write_text(json.dumps(res, indent=1, default=str))

    # numerics against the float64 oracle, every routing pattern
    res["numerics"] = {}
    gp = torch.Generator(device="cpu").manual_seed(1001)
    for pat in PATTERNS:
        ids, z, wts = routing_inputs(K3, pat, gp)
        m = _meta_of(ids, cfg.n_experts, G)
        oracle = R.routed_experts(z, ids, wts.double(), w.w13, w.w2, compute_dtype=torch.float64, **kw)
        path32 = R.routed_experts(z, ids, wts, w.w13, w.w2, **kw)
        rows = res["numerics"][pat] = {}
        pairs = [(i, DEFAULT_W2) for i in base13] + [(DEFAULT_W13, i) for i in base2 if i != DEFAULT_W2]
        for a, b in pairs:
            x = ExpertsPair(CARRY, ents[a], ents[b])
            act.fill_(float("nan"))
            c.fill_(float("nan"))
            x.w13(z, w.w13, m, act)
            x.w2(act, w.w2, wts, m, c)
            torch.cuda.synchronize()
            j = judge(f"{a}+{b} {pat}", c, oracle, path32)
            j["counters_zero"] = int((x.counters != 0).sum().item()) == 0
            j["passed"] = j["passed"] and j["counters_zero"]
            rows[f"{a}+{b}"] = j
        bad = [k for k, j in rows.items() if not j["passed"]]
        worst = max(j["ratio"] for j in rows.values())
        print(f"oracle {pat:8s}: {len(rows)} pairs, worst ratio to the torch path {worst:.3f}, failed: {bad or 'none'}",
              flush=True)
    path.write_text(json.dumps(res, indent=1, default=str))
    res["stress"] = stress(ents, w, steps[0], acts[0])
    path.write_text(json.dumps(res, indent=1, default=str))
    del w
    torch.cuda.empty_cache()


def stress(ents, w, step, act, runs: int = 16) -> dict:
    """Every moe_w2 variant, `runs` launches on the same inputs (the second half beside matmuls on
    another stream): bitwise identical, counters zero after each."""
    import torch

    from block_explore import Occupier, _same_bits

    occ = Occupier()
    out = {}
    c = torch.empty(1, w.w2.shape[1], dtype=torch.bfloat16, device="cuda")
    for ident in [i for i in ents if i.startswith("w2_")]:
        x = ExpertsPair(CARRY, ents[DEFAULT_W13], ents[ident])
        first, mism, nonzero = None, 0, 0
        for r in range(runs):
            c.fill_(float("nan"))
            if r >= runs // 2:
                occ.start()
            x.w2(act, w.w2, step["weights"], step["m"], c)
            torch.cuda.synchronize()
            nonzero += int((x.counters != 0).sum().item() != 0)
            if first is None:
                first = c.clone()
            elif not _same_bits(c, first):
                mism += 1
        out[ident] = {"runs": runs, "with_concurrent_matmul": runs - runs // 2, "not_bitwise_identical": mism,
                      "counters_left_nonzero": nonzero}
    bad = {i: r for i, r in out.items() if r["not_bitwise_identical"] or r["counters_left_nonzero"]}
    print(f"stress: {len(out)} moe_w2 variants x {runs} runs; not identical / counters left: {bad or 'none'}",
          flush=True)
    return out


SMALL_KERNELS = ["small_w13_p0", "small_w2_p0", "small_w13_p1", "small_w2_p1"]


def child() -> int:
    """The sanitized child: each small stream variant on a "hot" routing, checked against the
    reference (act, then c), with a run marker per kernel."""
    import dataclasses

    import torch

    from kernels import reference as R
    from kernels.config import get_config

    s = SMALL
    cfg = dataclasses.replace(get_config("mini"), name="mini_i512", expert_inter=s["expert_inter"])
    ents = _entries()
    w = R.make_weights(cfg, "cuda", seed=3)
    g = torch.Generator(device="cpu").manual_seed(5)
    ids, z, wts = routing_inputs(s, "hot", g)
    kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
    want = R.routed_experts(z, ids, wts, w.w13, w.w2, **kw)
    for p in (0, 1):
        x = ExpertsPair(CARRY, ents[f"small_w13_p{p}"], ents[f"small_w2_p{p}"])
        x.check_markers(f"small_w13_p{p}", f"small_w2_p{p}", cfg, ids, z, wts, w, want)
    return 0


def sanitize(res: dict, out_dir: Path) -> None:
    from explore_common import run_sanitizers

    run_sanitizers(res, "scripts/experts_b1_explore.py", SMALL_KERNELS, out_dir)


def gpu(out_dir: Path, skip_sanitizers: bool) -> int:
    from explore_common import measure

    return measure("scripts/experts_b1_explore.py", CARRY, out_dir, "experts_b1", k3_sweep,
                   None if skip_sanitizers else sanitize)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--jobs", type=int, default=2)
    g = sub.add_parser("gpu")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--skip-sanitizers", action="store_true")
    sub.add_parser("child")
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        return plan(a.jobs)
    if a.cmd == "child":
        return child()
    return gpu(a.out, a.skip_sanitizers)


if __name__ == "__main__":
    sys.exit(main())
