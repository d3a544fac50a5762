"""One GPU call's worth of exploration for the LatentMoE block's ops: tunable variants timed side by
side on k3 shapes, each checked against the current defaults; the dynamic race audit of the
cross-CTA kernels (router, moe_w2) under compute-sanitizer on the mini preset; a stress series.

  python scripts/block_explore.py plan                        # CPU host with the DSL: build, audit
  PYTHONPATH=. python3 scripts/block_explore.py gpu --out DIR # GPU host (no DSL), carrying
                                                              # build/explore_carry

`plan` builds every variant of VARIANTS into build/explore, audits each statically (PTX and SASS,
manifest roles) and copies its cubin and metadata to build/explore_carry/<id>/ (small enough to
carry), with plan.json. `gpu` runs, in order:
  * compute-sanitizer memcheck, racecheck, synccheck, initcheck (validation/race/dynamic.py) on a
    child that launches the mini variants (router; moe_w13 then moe_w2, per-item and pipelined
    paths) on fresh inputs, checks them against the references and prints run markers;
  * k3, per batch: every router variant on the same h (outputs compared bitwise with the first
    variant; selection and grouping checked against the reference rule), timed in a CUDA graph
    with dense weights rotated past the L2; the routed experts' variants on 8 routings made by
    the router from distinct inputs, outputs compared with the first variant's (bitwise when the
    k split is the same) and timed the same way;
  * stress: every router and moe_w2 variant launched repeatedly on the same inputs, half of the
    launches beside bf16 matmuls on another stream: outputs bitwise identical, counters left zero.
Results: DIR/explore.json and DIR/sanitizers.log.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BUILD = ROOT / "build" / "explore"
CARRY = ROOT / "build" / "explore_carry"
K3_ROUTER = {"n_experts": 896, "hidden": 7168, "top_k": 16, "latent": 3584}
K3_EXPERTS = {"n_experts": 896, "latent": 3584, "expert_inter": 3072, "top_k": 16}
MINI_ROUTER = {"n_experts": 64, "hidden": 1024, "top_k": 8, "latent": 512}
MINI_EXPERTS = {"n_experts": 64, "latent": 512, "expert_inter": 384, "top_k": 8}
MINI_BATCH = 3


def _variants() -> list[tuple[str, str, dict, dict]]:
    v = []
    for T, kus in ((1, (8, 4, 2)), (8, (8, 2)), (64, (8,))):
        for ku in kus:
            v.append((f"router_b{T}_ku{ku}", "router", {"batch": T, **K3_ROUTER}, {"k_unroll": ku}))
    for T in (1, 8):
        s = {"batch": T, **K3_EXPERTS}
        v.append((f"moe_w13_b{T}_base", "moe_w13", s, {}))
        for rt, w in ((2, 8), (4, 8), (4, 4)):
            for ku in (2, 4):
                for c in (2, 3):
                    v.append((f"moe_w13_b{T}_p_rt{rt}w{w}ku{ku}c{c}", "moe_w13", s,
                              {"pipeline": 1, "row_tiles": rt, "warps_per_cta": w, "k_unroll": ku, "ctas_per_sm": c}))
        v.append((f"moe_w2_b{T}_base", "moe_w2", s, {}))
        for rt, w in ((2, 8), (4, 8), (4, 4), (1, 8)):
            for ku in (2, 4):
                for c in (2, 3, 4):
                    v.append((f"moe_w2_b{T}_p_rt{rt}w{w}ku{ku}c{c}", "moe_w2", s,
                              {"pipeline": 1, "row_tiles": rt, "warps_per_cta": w, "k_unroll": ku, "ctas_per_sm": c}))
    ms = {"batch": MINI_BATCH, **MINI_EXPERTS}
    v.append(("mini_router", "router", {"batch": MINI_BATCH, **MINI_ROUTER}, {"warps_per_cta": 4}))
    for p in (0, 1):
        v.append((f"mini_moe_w13_p{p}", "moe_w13", ms, {"warps_per_cta": 8, "pipeline": p}))
        v.append((f"mini_moe_w2_p{p}", "moe_w2", ms, {"warps_per_cta": 4, "row_tiles": 2, "pipeline": p}))
    return v


# -- CPU: build, audit, copy ----------------------------------------------------------------------


def plan(jobs: int, mini_only: bool = False) -> int:
    from explore_common import build_and_carry, invocation

    variants = [v for v in _variants() if v[0].startswith("mini_") or not mini_only]
    return build_and_carry(variants, build_root=BUILD, carry=CARRY, jobs=jobs,
                           command=invocation())


# -- GPU helpers -----------------------------------------------------------------------------------


def _entries() -> dict:
    from explore_common import entries

    return entries(CARRY)


def _op(e):
    from kernels.ops.moe_experts import ExpertsDownOp, ExpertsUpOp
    from kernels.ops.router import RouterOp

    cls = {"router": RouterOp, "moe_w13": ExpertsUpOp, "moe_w2": ExpertsDownOp}[e["kernel"]]
    return cls(e["shape"], **e["tunables"])


def _kernel(e):
    from kernels.launch import CubinKernel

    k = CubinKernel.from_dir(CARRY / e["id"])
    k.load()
    return k


def _router_buffers(op, T, dev):
    import torch

    s = op.tensor_specs()
    b = {n: torch.empty(sp.shape, dtype=getattr(torch, sp.dtype), device=dev) for n, sp in s.items()
         if n not in ("h", "w_gate", "bias", "w_down")}
    b["counter"].zero_()
    return b


def _launch_router(k, op, h, w_gate, bias, w_down, b):
    k(h, w_gate, bias, b["logits"], b["ids"], b["weights"], b["n_groups"], b["group_expert"], b["group_start"],
      b["sorted_slots"], b["counter"], w_down, b["z"])


def _launch_w13(k, z, w13, m, act):
    k(z, w13, m["n_groups"], m["group_expert"], m["group_start"], m["sorted_slots"], act)


def _launch_w2(k, act, w2, weights, m, o, counters, c):
    k(act, w2, weights, m["n_groups"], m["group_expert"], m["group_start"], m["sorted_slots"], o, counters, c)


def _meta_of(ids, n_experts, G):
    """The router's grouping as the kernels take it (buffers of the kernel's sizes)."""
    from kernels.ops.router import routing_groups_ref

    m = routing_groups_ref(ids, n_experts)
    return {"n_groups": m["n_groups"], "group_expert": m["group_expert"][:G].contiguous(),
            "group_start": m["group_start"][: G + 1].contiguous(), "sorted_slots": m["sorted_slots"]}


def _rel(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    n = torch.linalg.vector_norm(b).item()
    return torch.linalg.vector_norm(a - b).item() / n if n else float("inf")


def _same_bits(a, b) -> bool:
    import torch

    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


# -- sanitized child (mini) ------------------------------------------------------------------------


def child() -> int:
    """Launch the mini variants on fresh inputs, check them against the references, print markers."""
    import torch

    from kernels import reference as R
    from kernels.config import get_config
    from validation.numerics import routing_ids
    from validation.race.dynamic import marker

    sys.path.insert(0, str(ROOT / "scripts"))
    from block_proof import check_grouping, check_selection

    cfg = get_config("mini")
    ents = _entries()
    T = MINI_BATCH
    g = torch.Generator(device="cpu").manual_seed(5)
    w = R.make_weights(cfg, "cuda", seed=3)
    # router: logits vs the fp32 reference, selection by the reference rule, grouping exactly
    e = ents["mini_router"]
    op, k = _op(e), _kernel(e)
    h = R.rmsnorm(torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16).cuda(), w.gamma_pre)
    b = _router_buffers(op, T, "cuda")
    for n in ("logits", "weights"):
        b[n].fill_(float("nan"))
    _launch_router(k, op, h, w.w_gate, w.bias, w.w_down, b)
    torch.cuda.synchronize()
    ref_logits = R.linear(h, w.w_gate, out_dtype=torch.float32)
    sel = check_selection(b["logits"], w.bias, b["ids"], b["weights"], cfg.top_k, cfg.routed_scale)
    grp = check_grouping(b, cfg.n_experts)
    z_err = _rel(b["z"], R.linear(h, w.w_down))
    ok = (_rel(b["logits"], ref_logits) < 1e-5 and sel["passed"] and grp["passed"] and z_err < 1e-2
          and int(torch.count_nonzero(b["counter"]).item()) == 0)
    print(marker("mini_router", ok, logits_err=f"{_rel(b['logits'], ref_logits):.2e}", z_err=f"{z_err:.2e}",
                 selection=sel["passed"], grouping=grp["passed"]), flush=True)
    # experts, both paths, on a routing whose groups differ in size
    ids = routing_ids(T, cfg.n_experts, cfg.top_k, "hot", g, "cuda")
    z = torch.randn(T, cfg.latent, generator=g).to(torch.bfloat16).cuda()
    wts = torch.rand(T, cfg.top_k, generator=g).cuda() + 0.05
    wts = wts / wts.sum(-1, keepdim=True)
    kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
    want = R.routed_experts(z, ids, wts, w.w13, w.w2, **kw)
    for p in (0, 1):
        e13, e2 = ents[f"mini_moe_w13_p{p}"], ents[f"mini_moe_w2_p{p}"]
        up, down = _op(e13), _op(e2)
        m = _meta_of(ids, cfg.n_experts, up.groups)
        act = torch.full((up.slots, cfg.expert_inter), float("nan"), dtype=torch.bfloat16, device="cuda")
        _launch_w13(_kernel(e13), z, w.w13, m, act)
        torch.cuda.synchronize()
        act_ref = up.reference(z=z, w13=w.w13, ids=ids, **m)["act"]
        a_err = _rel(act, act_ref)
        print(marker(f"mini_moe_w13_p{p}", bool(torch.isfinite(act.float()).all()) and a_err < 1e-2,
                     rel_err=f"{a_err:.2e}"), flush=True)
        o = torch.full((down.slots, cfg.latent), float("nan"), device="cuda")
        counters = torch.zeros(down.row_blocks, dtype=torch.int32, device="cuda")
        c = torch.full((T, cfg.latent), float("nan"), dtype=torch.bfloat16, device="cuda")
        _launch_w2(_kernel(e2), act, w.w2, wts, m, o, counters, c)
        torch.cuda.synchronize()
        c_err = _rel(c, want)
        ok = (bool(torch.isfinite(c.float()).all()) and c_err < 1e-2 and int((counters != 0).sum().item()) == 0)
        print(marker(f"mini_moe_w2_p{p}", ok, rel_err=f"{c_err:.2e}"), flush=True)
    return 0


# -- GPU: k3 timing, stress ------------------------------------------------------------------------


def graph_us(launch, n: int, replays: int = 10) -> float:
    """Median us per launch of a graph of `n` launches (launch(i) for i < n)."""
    from benchmarks.common import time_graph

    return time_graph(launch, launches=n, replays=replays, warmup=1).median_us


def k3(res: dict, batches, read_tbps: float, calls: int = 8) -> None:
    import torch

    from benchmarks.common import l2_bytes, rotation_count
    from kernels import reference as R
    from kernels.config import get_config

    sys.path.insert(0, str(ROOT / "scripts"))
    from block_proof import check_grouping, check_selection, op_bytes

    cfg = get_config("k3")
    ents = _entries()
    w = R.make_weights(cfg, "cuda", seed=0)
    torch.cuda.synchronize()
    l2 = l2_bytes()
    nr = min(8, rotation_count((cfg.n_experts + cfg.latent) * cfg.hidden * 2, l2))
    wg = [w.w_gate] + [w.w_gate.clone() for _ in range(nr - 1)]
    wd = [w.w_down] + [w.w_down.clone() for _ in range(nr - 1)]
    res["k3"] = {}
    for T in batches:
        row = res["k3"][str(T)] = {"router": {}, "moe_w13": {}, "moe_w2": {}}
        g = torch.Generator(device="cpu").manual_seed(100 + T)
        hs = [R.rmsnorm(torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16).cuda(), w.gamma_pre)
              for _ in range(calls)]
        # router variants
        first = None
        snaps = []
        for ident in [i for i in ents if i.startswith(f"router_b{T}_")]:
            e = ents[ident]
            op, k = _op(e), _kernel(e)
            b = _router_buffers(op, T, "cuda")
            _launch_router(k, op, hs[0], w.w_gate, w.bias, w.w_down, b)
            torch.cuda.synchronize()
            out = {n: b[n].clone() for n in ("logits", "ids", "weights", "n_groups", "group_expert", "group_start",
                                             "sorted_slots", "z")}
            sel = check_selection(b["logits"], w.bias, b["ids"], b["weights"], cfg.top_k, cfg.routed_scale)
            grp = check_grouping(b, cfg.n_experts)
            n = int(b["n_groups"][0].item())
            same = None if first is None else all(
                _same_bits(out[x][: n + 1] if x == "group_start" else out[x][:n] if x == "group_expert" else out[x],
                           first[x][: n + 1] if x == "group_start" else first[x][:n] if x == "group_expert" else first[x])
                for x in out)
            first = first or out
            logits_err = _rel(b["logits"], R.linear(hs[0], w.w_gate, compute_dtype=torch.float64))
            us = graph_us(lambda i: _launch_router(k, op, hs[i % calls], wg[i % nr], w.bias, wd[i % nr], b),
                          max(calls, nr))
            nb = op_bytes(cfg, T, n)["router+down"]
            row["router"][ident] = {"us": us, "fraction_of_read": nb / us / 1e6 / read_tbps, "selection": sel,
                                    "grouping": grp, "logits_rel_err_vs_f64": logits_err,
                                    "bitwise_same_as_first": same, "regs": e["registers"],
                                    "counter_zero": int(torch.count_nonzero(b["counter"]).item()) == 0}
            print(f"b{T} {ident:34s} {us:8.2f} us {row['router'][ident]['fraction_of_read']:6.1%} sel {sel['passed']} "
                  f"grp {grp['passed']} same {same}", flush=True)
            if not snaps:
                for i in range(calls):
                    _launch_router(k, op, hs[i], w.w_gate, w.bias, w.w_down, b)
                    torch.cuda.synchronize()
                    snaps.append({x: b[x].clone() for x in ("ids", "weights", "n_groups", "group_expert",
                                                            "group_start", "sorted_slots", "z")})
        if T not in (1, 8):
            continue
        n_unique = sum(int(s["n_groups"][0].item()) for s in snaps) / calls
        ob = op_bytes(cfg, T, n_unique)
        # moe_w13 variants: act per snapshot from the first (baseline) variant feeds moe_w2
        acts, base13 = None, None
        for ident in [i for i in ents if i.startswith(f"moe_w13_b{T}_")]:
            e = ents[ident]
            op, k = _op(e), _kernel(e)
            act = torch.empty(op.slots, cfg.expert_inter, dtype=torch.bfloat16, device="cuda")
            act.fill_(float("nan"))
            _launch_w13(k, snaps[0]["z"], w.w13, snaps[0], act)
            torch.cuda.synchronize()
            if base13 is None:
                base13, base_w = act.clone(), e["tunables"]["warps_per_cta"]
                acts = []
                for s in snaps:
                    _launch_w13(k, s["z"], w.w13, s, act)
                    torch.cuda.synchronize()
                    acts.append(act.clone())
            us = graph_us(lambda i: _launch_w13(k, snaps[i]["z"], w.w13, snaps[i], act), calls)
            r = {"us": us, "fraction_of_read": ob["moe_w13"] / us / 1e6 / read_tbps,
                 "bitwise_same_as_base": _same_bits(act, acts[calls - 1]) if True else None,
                 "rel_diff_vs_base": _rel(act, acts[calls - 1]), "regs": e["registers"], "grid": e["grid"][0],
                 "tunables": e["tunables"]}
            row["moe_w13"][ident] = r
            print(f"b{T} {ident:34s} {us:8.2f} us {r['fraction_of_read']:6.1%} same {r['bitwise_same_as_base']} "
                  f"diff {r['rel_diff_vs_base']:.1e} regs {r['regs']}", flush=True)
        base2 = None
        for ident in [i for i in ents if i.startswith(f"moe_w2_b{T}_")]:
            e = ents[ident]
            op, k = _op(e), _kernel(e)
            o = torch.empty(op.slots, cfg.latent, device="cuda")
            counters = torch.zeros(op.row_blocks, dtype=torch.int32, device="cuda")
            c = torch.empty(T, cfg.latent, dtype=torch.bfloat16, device="cuda")
            cs = []
            for i, s in enumerate(snaps):
                c.fill_(float("nan"))
                _launch_w2(k, acts[i], w.w2, s["weights"], s, o, counters, c)
                torch.cuda.synchronize()
                cs.append(c.clone())
            if base2 is None:
                base2 = cs
            us = graph_us(lambda i: _launch_w2(k, acts[i], w.w2, snaps[i]["weights"], snaps[i], o, counters, c), calls)
            r = {"us": us, "fraction_of_read": ob["moe_w2"] / us / 1e6 / read_tbps,
                 "bitwise_same_as_base": all(_same_bits(a, b_) for a, b_ in zip(cs, base2)),
                 "rel_diff_vs_base": max(_rel(a, b_) for a, b_ in zip(cs, base2)),
                 "finite": all(bool(torch.isfinite(x.float()).all()) for x in cs),
                 "counters_zero": int((counters != 0).sum().item()) == 0, "regs": e["registers"],
                 "grid": e["grid"][0], "tunables": e["tunables"]}
            row["moe_w2"][ident] = r
            print(f"b{T} {ident:34s} {us:8.2f} us {r['fraction_of_read']:6.1%} same {r['bitwise_same_as_base']} "
                  f"diff {r['rel_diff_vs_base']:.1e} regs {r['regs']}", flush=True)
        # the oracle once per batch, for the baseline pair (kernel error vs the bf16 torch path's)
        kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit)
        s0 = snaps[0]
        oracle = R.routed_experts(s0["z"], s0["ids"], s0["weights"].double(), w.w13, w.w2, compute_dtype=torch.float64,
                                  **kw)
        path = R.routed_experts(s0["z"], s0["ids"], s0["weights"], w.w13, w.w2, **kw)
        row["experts_base_vs_oracle"] = {"kernel_rel_err": _rel(base2[0], oracle), "torch_path_rel_err": _rel(path, oracle)}
        row["stress"] = stress_k3(ents, T, w, hs[0], snaps[0], acts[0])
        torch.cuda.synchronize()


class Occupier:
    """bf16 matmuls on another stream, occupying SMs while the kernels under test launch."""

    def __init__(self):
        import torch

        self.stream = torch.cuda.Stream()
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def start(self, n: int = 4) -> None:
        import torch

        with torch.cuda.stream(self.stream):
            for _ in range(n):
                self.a @ self.a


def stress_k3(ents, T, w, h, snap, act, runs: int = 16) -> dict:
    """Every router and moe_w2 variant of batch T, `runs` launches on the same inputs (the second
    half beside an occupier): bitwise identical outputs, counters zero after each."""
    import torch

    occ = Occupier()
    out = {}
    for ident in [i for i in ents if i.startswith((f"router_b{T}_", f"moe_w2_b{T}_"))]:
        e = ents[ident]
        op, k = _op(e), _kernel(e)
        firsts, mism, nonzero = None, 0, 0
        if e["kernel"] == "router":
            b = _router_buffers(op, T, "cuda")
            for r in range(runs):
                if r >= runs // 2:
                    occ.start()
                _launch_router(k, op, h, w.w_gate, w.bias, w.w_down, b)
                torch.cuda.synchronize()
                cur = [b[n].clone() for n in ("logits", "ids", "weights", "sorted_slots", "z")]
                nonzero += int(torch.count_nonzero(b["counter"]).item() != 0)
                if firsts is None:
                    firsts = cur
                elif not all(_same_bits(a, c) for a, c in zip(cur, firsts)):
                    mism += 1
        else:
            o = torch.empty(op.slots, w.w2.shape[1], device="cuda")
            counters = torch.zeros(op.row_blocks, dtype=torch.int32, device="cuda")
            c = torch.empty(T, w.w2.shape[1], dtype=torch.bfloat16, device="cuda")
            for r in range(runs):
                c.fill_(float("nan"))
                if r >= runs // 2:
                    occ.start()
                _launch_w2(k, act, w.w2, snap["weights"], snap, o, counters, c)
                torch.cuda.synchronize()
                nonzero += int((counters != 0).sum().item() != 0)
                if firsts is None:
                    firsts = c.clone()
                elif not _same_bits(c, firsts):
                    mism += 1
        out[ident] = {"runs": runs, "with_concurrent_matmul": runs - runs // 2, "not_bitwise_identical": mism,
                      "counters_left_nonzero": nonzero}
    bad = {i: r for i, r in out.items() if r["not_bitwise_identical"] or r["counters_left_nonzero"]}
    print(f"b{T} stress: {len(out)} variants x {runs} runs; not identical / counters left: {bad or 'none'}", flush=True)
    return out


def mini_stress(runs: int = 24) -> dict:
    """The mini router and moe_w2 (both paths), `runs` launches each on the same inputs, the second
    half beside an occupier: bitwise identical outputs, counters left zero."""
    import torch

    from kernels import reference as R
    from kernels.config import get_config
    from validation.numerics import routing_ids

    cfg = get_config("mini")
    ents = _entries()
    T = MINI_BATCH
    g = torch.Generator(device="cpu").manual_seed(9)
    w = R.make_weights(cfg, "cuda", seed=4)
    h = R.rmsnorm(torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16).cuda(), w.gamma_pre)
    ids = routing_ids(T, cfg.n_experts, cfg.top_k, "hot", g, "cuda")
    act = torch.randn(T * cfg.top_k, cfg.expert_inter, generator=g).to(torch.bfloat16).cuda()
    wts = torch.rand(T, cfg.top_k, generator=g).cuda() + 0.05
    occ = Occupier()
    out = {}
    for ident in ("mini_router", "mini_moe_w2_p0", "mini_moe_w2_p1"):
        e = ents[ident]
        op, k = _op(e), _kernel(e)
        first, mism, nonzero = None, 0, 0
        if e["kernel"] == "router":
            b = _router_buffers(op, T, "cuda")
        else:
            m = _meta_of(ids, cfg.n_experts, op.groups)
            o = torch.empty(op.slots, cfg.latent, device="cuda")
            counters = torch.zeros(op.row_blocks, dtype=torch.int32, device="cuda")
            c = torch.empty(T, cfg.latent, dtype=torch.bfloat16, device="cuda")
        for r in range(runs):
            if r >= runs // 2:
                occ.start()
            if e["kernel"] == "router":
                _launch_router(k, op, h, w.w_gate, w.bias, w.w_down, b)
                torch.cuda.synchronize()
                cur = [b[n].clone() for n in ("logits", "ids", "weights", "sorted_slots", "group_start", "z")]
                nonzero += int(torch.count_nonzero(b["counter"]).item() != 0)
            else:
                c.fill_(float("nan"))
                _launch_w2(k, act, w.w2, wts, m, o, counters, c)
                torch.cuda.synchronize()
                cur = [c.clone()]
                nonzero += int((counters != 0).sum().item() != 0)
            if first is None:
                first = cur
            elif not all(_same_bits(a, b_) for a, b_ in zip(cur, first)):
                mism += 1
        out[ident] = {"runs": runs, "with_concurrent_matmul": runs - runs // 2, "not_bitwise_identical": mism,
                      "counters_left_nonzero": nonzero}
        print(f"stress {ident:18s} {json.dumps(out[ident])}", flush=True)
    return out


def sanitize(out_dir: Path) -> int:
    """The four sanitizers over the mini child, then the mini stress; DIR/sanitize.json."""
    from benchmarks.common import gpu_environment
    from explore_common import read_plan, run_sanitizers

    out_dir.mkdir(parents=True, exist_ok=True)
    plan_doc = read_plan(CARRY)
    res = {"commit": plan_doc["commit"], "env": gpu_environment(), "variants": plan_doc["entries"]}
    mini = ["mini_router", "mini_moe_w13_p0", "mini_moe_w2_p0", "mini_moe_w13_p1", "mini_moe_w2_p1"]
    run_sanitizers(res, "scripts/block_explore.py", mini, out_dir, timeout_s=45)
    res["stress"] = mini_stress()
    (out_dir / "sanitize.json").write_text(json.dumps(res, indent=1, default=str))
    ok = all(r["clean"] for r in res["sanitizers"].values()) and not any(
        r["not_bitwise_identical"] or r["counters_left_nonzero"] for r in res["stress"].values())
    print(f"sanitizers and stress: {'CLEAN' if ok else 'NOT CLEAN'}")
    return 0 if ok else 1


def gpu(out_dir: Path, batches) -> int:
    import torch

    from benchmarks.common import gpu_environment, read_bandwidth
    from explore_common import read_plan, run_sanitizers

    out_dir.mkdir(parents=True, exist_ok=True)
    plan_doc = read_plan(CARRY)
    res = {"commit": plan_doc["commit"], "env": gpu_environment(), "variants": plan_doc["entries"]}
    path = out_dir / "explore.json"
    t0 = time.time()
    res["ceiling_read"] = read_bandwidth(reps=10)
    read_tbps = res["ceiling_read"]["tbps"]
    print(f"read-only {read_tbps:.3f} TB/s ({time.time() - t0:.0f} s)", flush=True)
    try:
        k3(res, batches, read_tbps)
    except Exception as e:  # keep what was measured
        import traceback

        res["error"] = traceback.format_exc()[-3000:]
        print(res["error"], flush=True)
    path.write_text(json.dumps(res, indent=1, default=str))
    mini = ["mini_router", "mini_moe_w13_p0", "mini_moe_w2_p0", "mini_moe_w13_p1", "mini_moe_w2_p1"]
    run_sanitizers(res, "scripts/block_explore.py", mini, out_dir, timeout_s=45)
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"done ({time.time() - t0:.0f} s) -> {path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--mini-only", action="store_true", help="only the mini variants (sanitizers, stress)")
    g = sub.add_parser("gpu")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    sub.add_parser("child")
    z = sub.add_parser("sanitize", help="only the sanitizers and a mini stress (after plan --mini-only)")
    z.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        return plan(a.jobs, a.mini_only)
    if a.cmd == "sanitize":
        return sanitize(a.out)
    if a.cmd == "child":
        return child()
    return gpu(a.out, a.batches)


if __name__ == "__main__":
    sys.exit(main())
