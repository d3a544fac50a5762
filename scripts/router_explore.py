"""One GPU call's worth of evidence for the router + latent down-projection (kernels/ops/router.py)
at the smallest batches: the stream design's variants beside the mma design, on k3 shapes; the
dynamic race audit of the stream design's arrival counter on the mini preset; a stress series.

  python scripts/router_explore.py plan [--sweep]              # CPU host with the DSL
  PYTHONPATH=. python3 scripts/router_explore.py gpu --out DIR # GPU host, carrying .devcarry/router_x
      (ROUTER_EXPLORE_ONLY=ID,ID,...: only those k3 variants, and only those mini variants in
      the sanitizers and the mini stress)
  PYTHONPATH=. python3 scripts/router_explore.py ab ID [ID ...] --rounds N --out DIR   # GPU host

`plan` builds every variant of `_variants()` (with --sweep also the mma design's CTA widths at
batches 8-64, `MMA_SWEEP`) into build/router_explore, audits each statically
(PTX and SASS against the manifest roles) and copies its cubin and metadata to
.devcarry/router_x/<id>/ with plan.json. `gpu`, in order:
  * the read-only ceiling, and a pure streaming read of exactly the router+down weight bytes per
    launch (benchmarks/read_kernel.py, graph of rotated copies): what any kernel reading those
    bytes in one launch can reach, ramp and drain included;
  * k3, per variant: outputs on one h against the float64 oracle (logits; selection re-derived
    from the kernel's logits by the reference rule; weights; grouping exactly; z beside the bf16
    torch path's error), sync words left zero (the arrival counter, or with `arrive` 3 every
    tagged logit word); time per launch in a CUDA graph of launches on
    distinct h, weights rotated past the L2 (the per-op condition of scripts/block_proof.py);
    stress: 16 launches on the same inputs, half beside bf16 matmuls on another stream, bitwise
    identical, counter zero after each; tied scores (`_tied`: W_g rows and bias repeated in
    threes, and all equal), where the ids must be exactly the reference's; for `timeline`
    variants the stamps of 8 launches alone and in a graph (`_timeline`); `arrive` 0 variants
    (no selection) are timed only;
  * compute-sanitizer memcheck, racecheck, synccheck, initcheck (validation/race/dynamic.py) over
    a child that launches the mini variants (stream: batch 1 with and without pdl, batch 3 with
    several rows per CTA; mma: batch 3 with 4 warps, and the block's shapes: batches 20 and 40
    with 16 warps of 16-row router and 32-row down CTAs, batch 8 with 32/64-row CTAs) and checks
    them against the reference, tied inputs included; a mini stress.
Results: DIR/explore.json, DIR/sanitizers.log.

`ab`: interleaved rounds of batch-1 variants of the carried plan and the same-bytes read, the
order rotated each round, medians over rounds (DIR/ab.json): A/B figures that drift within a
call cannot favour one variant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

BUILD = ROOT / "build" / "router_explore"
CARRY = ROOT / ".devcarry" / "router_x"
K3 = {"n_experts": 896, "hidden": 7168, "top_k": 16, "latent": 3584}
MINI = {"n_experts": 64, "hidden": 1024, "top_k": 8, "latent": 512}
# round 9's stream-design defaults (round 10 changed them: kernels/manifest.toml [kernels.router])
R9 = {"stream_w_regs": 0, "stream_topk": 2, "group_one": 0, "stream_ctas_per_sm": 0}


# The mma design's CTA widths swept past batch 4 (`plan --sweep`): (warps, row_tiles, down_row_tiles)
MMA_SWEEP = ((8, 1, 2), (16, 1, 2), (8, 1, 4), (8, 1, 8), (8, 2, 4), (8, 4, 8), (16, 1, 4), (16, 2, 4), (16, 4, 4))
SWEEP_BATCHES = (8, 16, 32, 64)


def _mma_sweep() -> list[tuple[str, dict, dict]]:
    """b<batch>_w<warps>_rt<row_tiles>_d<down_row_tiles>, where the CTA's partials fit in
    sm_90's shared memory (the build refuses the others)."""
    from kernels.build import SM90_SMEM_PER_CTA
    from kernels.ops.router import RouterOp

    v = []
    for T in SWEEP_BATCHES:
        for w, rt, d in MMA_SWEEP:
            shape, tun = {"batch": T, **K3}, {"warps_per_cta": w, "row_tiles": rt, "down_row_tiles": d}
            if RouterOp(shape, **tun).smem_bytes + 1024 <= SM90_SMEM_PER_CTA:
                v.append((f"b{T}_w{w}_rt{rt}_d{d}", shape, tun))
    return v


def _variants(sweep: bool = False) -> list[tuple[str, dict, dict]]:
    """(id, shape, tunables). Ids: b<batch>_s<threads>_k<cta KiB>_p<pdl> (stream), b<batch>_mma, or
    b<batch>_default (the manifest's defaults); with `sweep`, the mma widths of `_mma_sweep`."""
    b1 = {"batch": 1, **K3}
    round7 = {"stream_threads": 128, "stream_cta_kib": 8, "stream_topk": 0, "arrive": 1}  # round 7's defaults
    v = [("b1_default", b1, {}),
         ("b1_round7", b1, round7),
         ("b1_round7_p0", b1, {**round7, "pdl": 0}),
         # the selection designs (stream_topk) on round 7's CTA shape, and the default's shape with
         # the shuffles
         ("b1_redux_s128_k8", b1, {**round7, "stream_topk": 1}),
         ("b1_radix_s128_k8", b1, {**round7, "stream_topk": 2}),
         ("b1_shuffle", b1, {"stream_topk": 0}),
         # the same launch with one selection round instead of 16: equal times mean the tail is
         # hidden; and a timing bound without arrival or selection (arrive 0)
         ("b1_default_top1", {**b1, "top_k": 1}, {}),
         ("b1_default_arrive0", b1, {"arrive": 0}),
         ("b1_round7_arrive0", b1, {**round7, "arrive": 0}),
         # the last router CTA's arrival instead of the selector CTA (round 7's scheme)
         ("b1_default_arrive1", b1, {"arrive": 1}),
         ("b1_mma", b1, {"stream_max_batch": 0})]
    # CTA shapes of the stream design: threads, KiB of rows per CTA (2 rows per 32 KiB at k = 7168)
    for t, kib in ((128, 32), (64, 32), (256, 64), (128, 64), (64, 8)):
        v.append((f"b1_s{t}_k{kib}", b1, {"stream_threads": t, "stream_cta_kib": kib}))
    # the timeline instrumentation (`timeline`: where a launch's time goes)
    v.append(("b1_default_timeline", b1, {"timeline": 1}))
    v.append(("b1_round7_timeline", b1, {**round7, "timeline": 1}))
    v.append(("b1_arrive1_timeline", b1, {"arrive": 1, "timeline": 1}))
    # round 10 (its README: the variants each call measured, under the names they had then): the
    # weights by plain loads into registers (stream_w_regs 1), the threshold selection
    # (stream_topk 3), batch 1's grouping by ranks (group_one 1), n CTAs per SM by the carveout
    # (stream_ctas_per_sm); each alone on round 9's defaults, and the timing bounds
    w = {"stream_w_regs": 1}
    v.append(("b1_wregs", b1, w))
    v.append(("b1_wregs_arrive0", b1, {**w, "arrive": 0}))
    v.append(("b1_t3", b1, {"stream_topk": 3}))
    v.append(("b1_wregs_t3", b1, {**w, "stream_topk": 3}))
    v.append(("b1_wregs_g1_t3", b1, {**w, "stream_topk": 3, "group_one": 1}))  # five CTAs per SM
    v.append(("b1_wregs_g1_t3_timeline", b1, {**w, "stream_topk": 3, "group_one": 1, "timeline": 1}))
    v.append(("b1_cp_g1_t3_n4", b1, {"stream_topk": 3, "group_one": 1, "stream_ctas_per_sm": 4}))
    v.append(("b1_default_n5", b1, {"group_one": 1, "stream_ctas_per_sm": 5}))
    v.append(("b1_default_g1_n4", b1, {"group_one": 1, "stream_ctas_per_sm": 4}))  # four per SM by the carveout
    v.append(("b1_default_g1", b1, {"group_one": 1}))  # 44 registers: five CTAs per SM
    v.append(("b2_wregs_t3", {"batch": 2, **K3}, {**w, "stream_topk": 3}))
    v.append(("b2_default", {"batch": 2, **K3}, {}))
    v.append(("b2_round7", {"batch": 2, **K3}, round7))
    v.append(("b2_mma", {"batch": 2, **K3}, {"stream_max_batch": 1}))
    for T in (8, 64):
        v.append((f"b{T}_default", {"batch": T, **K3}, {}))  # the mma design, its phase 2 shared
        v.append((f"b{T}_redux", {"batch": T, **K3}, {"topk": 1}))
    mini_stream = {"stream_max_batch": 4, "stream_threads": 128, "stream_cta_kib": 8}
    for T, pdl in ((1, 0), (1, 1), (3, 1)):
        v.append((f"mini_b{T}_p{pdl}", {"batch": T, **MINI}, {**mini_stream, "pdl": pdl}))
    v.append(("mini_b1_default", {"batch": 1, **MINI}, {"stream_max_batch": 4}))  # 8 rows per CTA
    v.append(("mini_b1_round9", {"batch": 1, **MINI}, {"stream_max_batch": 4}))  # R9 beneath (below)
    v.append(("mini_b3_default", {"batch": 3, **MINI}, {"stream_max_batch": 4}))
    v.append(("mini_b3_p1_shuffle", {"batch": 3, **MINI}, {**mini_stream, "stream_topk": 0}))
    v.append(("mini_b3_p1_redux", {"batch": 3, **MINI}, {**mini_stream, "stream_topk": 1}))
    v.append(("mini_b1_p1_a1", {"batch": 1, **MINI}, {**mini_stream, "arrive": 1}))
    v.append(("mini_b1_p0_a1", {"batch": 1, **MINI}, {**mini_stream, "arrive": 1, "pdl": 0}))
    v.append(("mini_b3_p1_a1", {"batch": 3, **MINI}, {**mini_stream, "arrive": 1, "stream_topk": 0}))
    # round 10: its defaults on 128-thread CTAs (mini_stream) with pdl and with the last-arrival
    # scheme; each new tunable alone on round 9's defaults
    new_mini = {"stream_w_regs": 1, "stream_topk": 3, "group_one": 1, "stream_ctas_per_sm": 4}
    v.append(("mini_b1_p1_new", {"batch": 1, **MINI}, {**mini_stream, **new_mini}))
    v.append(("mini_b3_p1_new_a1", {"batch": 3, **MINI}, {**mini_stream, **new_mini, "arrive": 1}))
    for name, extra in (("wregs", {"stream_w_regs": 1}), ("t3", {"stream_topk": 3}), ("g1", {"group_one": 1})):
        v.append((f"mini_b1_{name}", {"batch": 1, **MINI}, {"stream_max_batch": 4, **extra}))
    v.append(("mini_b3_t3", {"batch": 3, **MINI}, {"stream_max_batch": 4, "stream_topk": 3}))
    v.append(("mini_b3_mma", {"batch": 3, **MINI}, {"stream_max_batch": 0, "warps_per_cta": 4}))
    v.append(("mini_b40_mma_redux", {"batch": 40, **MINI}, {"stream_max_batch": 0, "topk": 1}))
    v.append(("mini_b40_mma_radix", {"batch": 40, **MINI}, {"stream_max_batch": 0, "topk": 2}))
    # the block's router shapes (kernels/block.py ROUTER_IN_BLOCK): batches 16-64, 16 warps with
    # 16-row router and 32-row down CTAs (batch 20: a second, partly padded batch tile; batch 40:
    # three); batch 8, 8 warps with 32-row router and 64-row down CTAs
    wide = {"stream_max_batch": 0, "warps_per_cta": 16, "row_tiles": 2, "down_row_tiles": 4}
    v.append(("mini_b20_mma_w16", {"batch": 20, **MINI}, wide))
    v.append(("mini_b40_mma_w16_rt2_d4", {"batch": 40, **MINI}, wide))
    v.append(("mini_b8_mma_rt4_d8", {"batch": 8, **MINI},
              {"stream_max_batch": 0, "warps_per_cta": 8, "row_tiles": 4, "down_row_tiles": 8}))
    # round 11: the tagged logits (arrive 3): router CTAs store each logit as its own flag, no
    # release; the selector polls the logits themselves (one round trip, no staging)
    tag = {"arrive": 3}
    v.append(("b1_tag", b1, tag))
    v.append(("b1_tag_timeline", b1, {**tag, "timeline": 1}))
    v.append(("b2_tag", {"batch": 2, **K3}, tag))
    v.append(("b1_tag_top1", {**b1, "top_k": 1}, tag))  # equal times: phase 2 is hidden
    v.append(("b1_tag_g1", b1, {**tag, "group_one": 1}))  # 44 registers: five CTAs per SM
    v.append(("b1_tag_g1_timeline", b1, {**tag, "group_one": 1, "timeline": 1}))
    v.append(("b1_arrive0_timeline", b1, {"arrive": 0, "timeline": 1}))
    v.append(("b1_arrive2", b1, {"arrive": 2}))  # round 10's default (tagged logits are the default now)
    v.append(("b2_arrive2", {"batch": 2, **K3}, {"arrive": 2}))
    # the three arrivals without programmatic dependent launch: is the default's cost over the
    # no-phase-2 bound an interaction with the next launch's overlap?
    for a in (3, 2, 0):
        v.append((f"b1_arrive{a}_p0", b1, {"arrive": a, "pdl": 0}))
    v.append(("b1_tag_g1_p0", b1, {**tag, "group_one": 1, "pdl": 0}))  # five per SM, no pdl
    # round 11 calls 8-10 (commit dbba415): timing probes (the tagged stores with no selector; the
    # poll with no selection; no poll) and 16-byte polls, removed. The selector's poll paced:
    for sl in (0, 1, 4):  # microseconds of sleep before each round (the default: 2)
        v.append((f"b1_sleep{sl}", b1, {"poll_sleep": sl}))
    v.append(("b2_sleep0", {"batch": 2, **K3}, {"poll_sleep": 0}))
    # round 11 call 7 also measured the selector placed after the router CTAs (`selector_cta` 1,
    # b1_sel1 / b1_sel1_g1 / mini_b3_sel1, commit e47f655): no faster, removed
    v.append(("mini_b1_tag", {"batch": 1, **MINI}, {"stream_max_batch": 4, **tag}))
    v.append(("mini_b3_tag", {"batch": 3, **MINI}, {"stream_max_batch": 4, **tag}))
    v.append(("mini_b3_p0_tag", {"batch": 3, **MINI}, {**mini_stream, "stream_w_regs": 1, "stream_topk": 3, **tag,
                                                         "pdl": 0}))
    v.append(("b1_round9", b1, {}))  # round 9's shipped defaults (R9 below)
    v.append(("b2_round9", {"batch": 2, **K3}, {}))
    # Round 10 changed the stream design's defaults (weights in registers by plain loads, the
    # threshold selection, batch 1's grouping by ranks, four CTAs per SM by the carveout). Every
    # variant but the defaults' own keeps round 9's defaults beneath its tunables, so that its
    # name still says what it measures.
    new_based = {"b1_default", "b2_default", "b1_default_arrive0", "b1_default_arrive1", "b1_default_timeline",
                 "b1_default_top1", "b1_default_n5", "b1_default_g1_n4", "b1_default_g1", "mini_b1_default",
                 "mini_b3_default", "b1_tag", "b1_tag_timeline", "b2_tag", "b1_tag_top1", "b1_tag_g1",
                 "b1_tag_g1_timeline", "b1_arrive0_timeline", "b1_arrive2", "b2_arrive2",
                 "b1_arrive3_p0", "b1_arrive2_p0", "b1_arrive0_p0", "b1_tag_g1_p0", "b1_sleep0", "b1_sleep1", "b1_sleep4", "b2_sleep0", "mini_b1_tag", "mini_b3_tag",
                 "mini_b3_p0_tag"}
    v = [(i, shape, tun if i in new_based else {**R9, **tun}) for i, shape, tun in v]
    return v + (_mma_sweep() if sweep else [])


MINI_IDS = [i for i, _, _ in _variants() if i.startswith("mini_")]


def _mini_ids() -> list[str]:
    """The mini variants the sanitizers and the mini stress launch: every one, or with
    ROUTER_EXPLORE_ONLY set only the mini ids it lists (the child inherits the variable)."""
    only = os.environ.get("ROUTER_EXPLORE_ONLY")
    return [i for i in MINI_IDS if not only or i in only.split(",")]


# -- CPU: build, audit, copy ----------------------------------------------------------------------


def plan(jobs: int, sweep: bool = False) -> int:
    from explore_common import build_and_carry, invocation

    return build_and_carry([(ident, "router", shape, tun) for ident, shape, tun in _variants(sweep)],
                           build_root=BUILD, carry=CARRY, jobs=jobs, command=invocation())


# -- GPU helpers -----------------------------------------------------------------------------------


def _entries() -> dict:
    from explore_common import entries

    return entries(CARRY)


def _load(e):
    from kernels.launch import CubinKernel
    from kernels.ops.router import RouterOp

    k = CubinKernel.from_dir(CARRY / e["id"])
    k.load()
    return RouterOp(e["shape"], **e["tunables"]), k


def _check(op, b, h, w_gate, bias, w_down, scale: float) -> dict:
    """The outputs of one launch against the oracle and the reference rules."""
    import torch

    from block_explore import _rel
    from block_proof import check_grouping, check_selection, judge
    from kernels import reference as R

    F64 = torch.float64
    sel = check_selection(b["logits"], bias, b["ids"], b["weights"], op.top_k, scale)
    grp = check_grouping(b, op.n_experts)
    logits_err = _rel(b["logits"], R.linear(h, w_gate, compute_dtype=F64))
    z = judge("z", b["z"], R.linear(h, w_down, compute_dtype=F64), R.linear(h, w_down))
    counter_zero = _counter_left(op, b) == 0
    finite = bool(torch.isfinite(b["logits"]).all() and torch.isfinite(b["weights"]).all())
    ok = sel["passed"] and grp["passed"] and logits_err < 1e-5 and z["passed"] and counter_zero and finite
    return {"passed": ok, "selection": sel, "grouping": grp, "logits_rel_err_vs_f64": logits_err, "z": z,
            "counter_zero": counter_zero, "finite": finite}


def _counter_left(op, b) -> int:
    """Sync words a launch left non-zero: the arrival counter (word 0), or with `arrive` 3 every
    tagged logit word (each must be reset for the next launch)."""
    import torch

    c = b["counter"]
    c = c[op.tag_base:] if getattr(op, "tagged", False) else c[:1]
    return int(torch.count_nonzero(c).item())


def _tied(w_gate, bias, how: str, h=None, top_k: int = 0):
    """Router weights whose scores tie: "triples" (rows and bias repeated in threes, so the
    k-th place falls inside a tie whenever 3 does not divide top_k) or "all" (every row and
    bias equal: the selection must be experts 0 .. top_k-1); or "mixed": the bias shifted so
    that token 0's biased scores change sign inside its top k (half of them negative), which a
    selection comparing order-preserving keys with the wrong signedness gets wrong."""
    import torch

    E = w_gate.shape[0]
    if how == "all":
        return w_gate[:1].expand(E, -1).contiguous(), torch.zeros_like(bias)
    if how == "mixed":
        s = torch.sigmoid(h[0].float() @ w_gate.float().T) + bias
        top = s.sort(descending=True).values
        half = max(top_k // 2, 1)
        return w_gate, (bias - (top[half - 1] + top[half]) / 2).contiguous()
    idx = (torch.arange(E, device=w_gate.device) // 3) * 3
    return w_gate[idx].contiguous(), bias[idx].contiguous()


def _check_ties(op, k, h, w_gate, bias, w_down, scale: float) -> dict:
    """Tied scores and scores of both signs (`_tied`): the ids must be exactly the reference
    rule's (ties to the lower expert) on the kernel's own logits, besides every check of
    `_check`."""
    from block_explore import _launch_router, _router_buffers
    from block_proof import check_selection

    out = {}
    for how in ("triples", "all", "mixed"):
        wg, bs = _tied(w_gate, bias, how, h, op.top_k)
        b = _router_buffers(op, op.batch, "cuda")
        _poison(b)
        _launch_router(k, op, h, wg, bs, w_down, b)
        import torch

        torch.cuda.synchronize()
        r = _check(op, b, h, wg, bs, w_down, scale)
        sel = check_selection(b["logits"], bs, b["ids"], b["weights"], op.top_k, scale)
        exact = sel["tokens_exactly_reference"] == sel["tokens"]
        out[how] = {"passed": bool(r["passed"] and exact), "exact_ids": exact, "check": r["passed"]}
    out["passed"] = all(v["passed"] for v in out.values() if isinstance(v, dict))
    return out


def _poison(b) -> None:
    for n in ("logits", "weights", "z"):
        b[n].fill_(float("nan"))
    for n in ("ids", "n_groups", "group_expert", "group_start", "sorted_slots"):
        b[n].fill_(-7)


def _stress(op, k, h, w, runs: int = 16) -> dict:
    """`runs` launches on the same inputs (the second half beside bf16 matmuls on another
    stream): outputs bitwise identical to the first, counter zero after each."""
    import torch

    from block_explore import Occupier, _launch_router, _router_buffers, _same_bits

    occ = Occupier()
    b = _router_buffers(op, op.batch, "cuda")
    first, mism, nonzero = None, 0, 0
    for r in range(runs):
        if r >= runs // 2:
            occ.start()
        _poison(b)
        _launch_router(k, op, h, w.w_gate, w.bias, w.w_down, b)
        torch.cuda.synchronize()
        cur = [b[n].clone() for n in ("logits", "ids", "weights", "n_groups", "group_expert", "group_start",
                                      "sorted_slots", "z")]
        nonzero += int(_counter_left(op, b) != 0)
        if first is None:
            first = cur
        elif not all(_same_bits(a, c) for a, c in zip(cur, first)):
            mism += 1
    return {"runs": runs, "with_concurrent_matmul": runs - runs // 2, "not_bitwise_identical": mism,
            "counters_left_nonzero": nonzero}


def _read_same_bytes(nbytes: int, replays: int = 20) -> dict:
    """A pure streaming read of `nbytes` per launch (the ceiling's Triton kernel), chained in a
    graph over rotated copies: the best any one launch reading these bytes reaches."""
    import torch
    import triton

    from benchmarks.common import l2_bytes, rotation_count, time_graph
    from benchmarks.read_kernel import read_sum_kernel

    nel = nbytes // 4
    copies = rotation_count(nbytes, l2_bytes())
    bufs = [torch.randint(0, 1 << 20, (nel,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    best = None
    for it in (4, 2, 1):
        g = (triton.cdiv(nel, 8192 * it),)
        part = torch.empty(g[0], dtype=torch.int32, device="cuda")
        t = time_graph(lambda i, g=g, part=part, it=it: read_sum_kernel[g](bufs[i % copies], part, nel, BLOCK=8192,
                                                                        ITERS=it, num_warps=8),
                       launches=max(copies, 20), replays=replays)
        if best is None or t.median_us < best["us"]:
            best = {"us": t.median_us, "iters": it, "bytes": nbytes, "launches": max(copies, 20)}
    del bufs
    return best


def _timeline(op, k, hs, wg, wd, bias, rounds: int = 5, launches: int = 8) -> dict:
    """`timeline` variants: `launches` launches, each with its own stamp buffer
    (kernels/ops/router.py TIMELINE_SLOTS), weights rotated past the L2, two ways: "stream"
    (issued one by one from the host; pdl is set, but the host's pace leaves the GPU idle between
    them: `gap_from_previous_down_end` was 80-150 us in every call) and "graph" (captured in one
    CUDA graph, as the per-op timing runs them: pdl lets each start under the previous one).
    Stamps in ns from the launch's first CTA start (the `_clk` fields: SM cycles from phase 2's
    arrival); medians (and min, max) over `rounds` of launches 1 .. launches-2, the steady
    state; `gap_from_previous_down_end`: this launch's first start after the previous one's last
    down CTA end (negative: they overlap)."""
    import statistics

    import torch

    from block_explore import _launch_router, _router_buffers
    from kernels.ops.router import TIMELINE_SLOTS

    bufs = [_router_buffers(op, op.batch, "cuda") for _ in range(launches)]

    def launch_all():
        for i, b in enumerate(bufs):
            _launch_router(k, op, hs[i % len(hs)], wg[i % len(wg)], bias, wd[i % len(wd)], b)

    def wrap(x):  # u32 difference as a signed int
        return ((x + (1 << 31)) % (1 << 32)) - (1 << 31)

    launch_all()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        launch_all()
    out = {"launches": launches, "rounds": rounds, "unit": "ns (the _clk fields: SM cycles)"}
    for how in ("stream", "graph"):
        rows = []
        for _ in range(rounds):
            for b in bufs:
                b["counter"].zero_()
            torch.cuda.synchronize()
            graph.replay() if how == "graph" else launch_all()
            torch.cuda.synchronize()
            stamps = [[int(x) & 0xFFFFFFFF for x in b["counter"].tolist()] for b in bufs]
            for i in range(1, launches - 1):
                st, prev = stamps[i], stamps[i - 1]
                t0 = st[TIMELINE_SLOTS["first_start"]]
                row = {n: wrap(st[j] - t0) for n, j in TIMELINE_SLOTS.items() if not n.endswith("_clk")}
                c0 = st[TIMELINE_SLOTS["p2_arrived_clk"]]
                row.update({n: wrap(st[j] - c0) for n, j in TIMELINE_SLOTS.items() if n.endswith("_clk")})
                row["gap_from_previous_down_end"] = wrap(t0 - prev[TIMELINE_SLOTS["last_down_end"]])
                row["start_to_start"] = wrap(t0 - prev[TIMELINE_SLOTS["first_start"]])
                rows.append(row)
        out[how] = {"median": {n: statistics.median(r[n] for r in rows) for n in rows[0]},
                    "min": {n: min(r[n] for r in rows) for n in rows[0]},
                    "max": {n: max(r[n] for r in rows) for n in rows[0]}}
    del graph
    return out


def _rotated_weights(cfg):
    """k3 weights (seed 0), the router+down weight bytes, and W_g / W_down rotated over up to 8
    copies past the L2 (the per-op condition of scripts/block_proof.py): (w, bytes, n, wg, wd)."""
    import torch

    from benchmarks.common import l2_bytes, rotation_count
    from kernels import reference as R

    w = R.make_weights(cfg, "cuda", seed=0)
    torch.cuda.synchronize()
    wbytes = (cfg.n_experts + cfg.latent) * cfg.hidden * 2
    nr = min(8, rotation_count(wbytes, l2_bytes()))
    wg = [w.w_gate] + [w.w_gate.clone() for _ in range(nr - 1)]
    wd = [w.w_down] + [w.w_down.clone() for _ in range(nr - 1)]
    return w, wbytes, nr, wg, wd


def _tokens(cfg, w, T: int, calls: int):
    """`calls` normalised hidden states of T tokens (seed 100 + T)."""
    import torch

    from kernels import reference as R

    g = torch.Generator(device="cpu").manual_seed(100 + T)
    return [R.rmsnorm(torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16).cuda(), w.gamma_pre)
            for _ in range(calls)]


def _per_op_us(op, k, hs, wg, wd, bias, b) -> float:
    """us per launch in a CUDA graph of launches on distinct h with the weights rotated."""
    from block_explore import _launch_router, graph_us

    n = max(len(hs), len(wg))
    return graph_us(lambda i: _launch_router(k, op, hs[i % len(hs)], wg[i % len(wg)], bias, wd[i % len(wd)], b),
                    n, replays=20)


# -- GPU: k3 -----------------------------------------------------------------------------------------


def k3(res: dict, read_tbps: float, calls: int = 8) -> None:
    import torch

    from block_explore import _launch_router, _rel, _router_buffers
    from block_proof import op_bytes
    from kernels.config import get_config

    cfg = get_config("k3")
    only = os.environ.get("ROUTER_EXPLORE_ONLY")  # comma-separated ids: a shorter call (minis too)
    ents = {i: e for i, e in _entries().items() if not i.startswith("mini_")
            and (not only or i in only.split(","))}
    w, wbytes, nr, wg, wd = _rotated_weights(cfg)
    res["read_same_bytes"] = r = _read_same_bytes(wbytes)
    r["fraction_of_read"] = wbytes / r["us"] / 1e6 / read_tbps
    print(f"read of the same {wbytes / 1e6:.1f} MB per launch: {r['us']:.2f} us {r['fraction_of_read']:.1%}",
          flush=True)
    res["k3"] = {}
    firsts = {}
    for ident, e in ents.items():
        T = e["shape"]["batch"]
        op, k = _load(e)
        hs = _tokens(cfg, w, T, calls)
        b = _router_buffers(op, T, "cuda")
        if op.stream and op.arrive in (0, 4, 5, 6):  # timing bounds: nothing selected, nothing to check
            us = _per_op_us(op, k, hs, wg, wd, w.bias, b)
            nb = op_bytes(cfg, T, min(T * cfg.top_k, cfg.n_experts))["router+down"]
            res["k3"][ident] = {"timing_bound_only": True, "passed": True, "us": us, "bytes": nb,
                                "fraction_of_read": nb / us / 1e6 / read_tbps, "tunables": e["tunables"],
                                "stress": {"not_bitwise_identical": 0, "counters_left_nonzero": 0}}
            print(f"{ident:20s} {us:7.2f} us {nb / us / 1e6 / read_tbps:6.1%} of read (timing bound only: "
                  f"no arrival, no selection)", flush=True)
            if op.timeline:  # the streaming's own stamps (no phase 2 ones)
                res["k3"][ident]["timeline"] = tl = _timeline(op, k, hs, wg, wd, w.bias)
                for how in ("stream", "graph"):
                    print(f"{ident} timeline {how} (median, ns from the first CTA start): "
                          f"{json.dumps(tl[how]['median'])}", flush=True)
            continue
        _poison(b)
        _launch_router(k, op, hs[0], w.w_gate, w.bias, w.w_down, b)
        torch.cuda.synchronize()
        row = _check(op, b, hs[0], w.w_gate, w.bias, w.w_down, cfg.routed_scale)
        out = {n: b[n].clone() for n in ("logits", "ids", "z")}
        if T in firsts:  # another variant, same inputs: same selection, sums in another order
            f = firsts[T]
            row["vs_first_of_batch"] = {"first": f["id"], "ids_equal": bool(torch.equal(out["ids"], f["ids"])),
                                        "logits_rel_diff": _rel(out["logits"], f["logits"]),
                                        "z_rel_diff": _rel(out["z"], f["z"])}
        else:
            firsts[T] = {"id": ident, **out}
        us = _per_op_us(op, k, hs, wg, wd, w.bias, b)
        n_groups = int(b["n_groups"][0].item())
        nb = op_bytes(cfg, T, n_groups)["router+down"]
        row.update({"us": us, "bytes": nb, "fraction_of_read": nb / us / 1e6 / read_tbps,
                    "vs_read_same_bytes": res["read_same_bytes"]["us"] / us, "registers": e["registers"],
                    "launch": e["launch"], "tunables": e["tunables"]})
        row["stress"] = _stress(op, k, hs[0], w)
        row["ties"] = _check_ties(op, k, hs[0], w.w_gate, w.bias, w.w_down, cfg.routed_scale)
        row["passed"] = bool(row["passed"] and row["ties"]["passed"])
        if op.timeline:
            row["timeline"] = tl = _timeline(op, k, hs, wg, wd, w.bias)
            for how in ("stream", "graph"):
                print(f"{ident} timeline {how} (median, ns from the first CTA start): {json.dumps(tl[how]['median'])}",
                      flush=True)
        res["k3"][ident] = row
        print(f"{ident:20s} {us:7.2f} us {row['fraction_of_read']:6.1%} of read "
              f"(x{row['vs_read_same_bytes']:.3f} of the same-bytes read) ok {row['passed']} "
              f"logits {row['logits_rel_err_vs_f64']:.1e} z ratio {row['z']['ratio']:.3f} "
              f"stress {row['stress']['not_bitwise_identical']}/{row['stress']['counters_left_nonzero']} "
              f"ties {'ok' if row['ties']['passed'] else 'NOT OK ' + json.dumps(row['ties'])}", flush=True)
    del wg, wd, w
    torch.cuda.empty_cache()


def ab(ids: list[str], rounds: int, out_dir: Path) -> int:
    """Interleaved A/B at k3: `rounds` rounds, each timing every variant of `ids` once (the
    per-op condition of `k3`) and the read of the same bytes, in a rotated order, so that
    drift over the call falls on all of them alike; medians over rounds."""
    import statistics

    from benchmarks.common import gpu_environment, read_bandwidth
    from block_explore import _router_buffers
    from block_proof import op_bytes
    from kernels.config import get_config

    out_dir.mkdir(parents=True, exist_ok=True)
    plan_doc = json.loads((CARRY / "plan.json").read_text())
    cfg = get_config("k3")
    ents = _entries()
    bad = [i for i in ids if i not in ents or ents[i]["shape"] != {"batch": 1, **K3}]
    if bad:
        print(f"router_explore ab: not batch-1 k3 variants of the carried plan: {bad}", file=sys.stderr)
        return 2
    res = {"commit": plan_doc["commit"], "plan_dirty": plan_doc["dirty"], "env": gpu_environment(),
           "command": "PYTHONPATH=. python3 " + " ".join(sys.argv), "ids": ids, "rounds": rounds,
           "variants": [e for e in plan_doc["entries"] if e["id"] in ids]}
    res["ceiling_read"] = read_bandwidth(reps=10)
    read_tbps = res["ceiling_read"]["tbps"]
    w, wbytes, nr, wg, wd = _rotated_weights(cfg)
    hs = _tokens(cfg, w, 1, 8)
    loaded = {}
    for i in ids:
        op, k = _load(ents[i])
        loaded[i] = (op, k, _router_buffers(op, op.batch, "cuda"))
    samples = {i: [] for i in ids + ["read_same_bytes"]}
    for r in range(rounds):
        order = ids[r % len(ids):] + ids[:r % len(ids)]
        for i in order:
            op, k, b = loaded[i]
            samples[i].append(_per_op_us(op, k, hs, wg, wd, w.bias, b))
        samples["read_same_bytes"].append(_read_same_bytes(wbytes)["us"])
        print(f"round {r}: " + " ".join(f"{i} {samples[i][-1]:.2f}" for i in samples), flush=True)
    res["results"] = {}
    for i, v in samples.items():
        nb = wbytes if i == "read_same_bytes" else op_bytes(cfg, 1, cfg.top_k)["router+down"]
        med = statistics.median(v)
        res["results"][i] = {"us_per_round": v, "median_us": med, "min_us": min(v), "max_us": max(v),
                             "bytes": nb, "fraction_of_read": nb / med / 1e6 / read_tbps}
        print(f"{i:24s} median {med:6.2f} us ({min(v):.2f}-{max(v):.2f}) {nb / med / 1e6 / read_tbps:6.1%} of read",
              flush=True)
    (out_dir / "ab.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


# -- sanitized child (mini) ------------------------------------------------------------------------


def child() -> int:
    """Launch the mini stream variants on fresh inputs, check them, print run markers."""
    import torch

    from block_explore import _launch_router, _router_buffers
    from kernels import reference as R
    from kernels.config import get_config
    from validation.race.dynamic import marker

    cfg = get_config("mini")
    ents = _entries()
    g = torch.Generator(device="cpu").manual_seed(5)
    w = R.make_weights(cfg, "cuda", seed=3)
    for ident in _mini_ids():
        op, k = _load(ents[ident])
        T = op.batch
        h = R.rmsnorm(torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16).cuda(), w.gamma_pre)
        b = _router_buffers(op, T, "cuda")
        _poison(b)
        _launch_router(k, op, h, w.w_gate, w.bias, w.w_down, b)
        torch.cuda.synchronize()
        r = _check(op, b, h, w.w_gate, w.bias, w.w_down, cfg.routed_scale)
        ties = _check_ties(op, k, h, w.w_gate, w.bias, w.w_down, cfg.routed_scale)
        print(marker(ident, r["passed"] and ties["passed"], logits_err=f"{r['logits_rel_err_vs_f64']:.2e}",
                     z_ratio=f"{r['z']['ratio']:.3f}", selection=r["selection"]["passed"],
                     grouping=r["grouping"]["passed"], counter_zero=r["counter_zero"],
                     ties=ties["passed"]), flush=True)
    return 0


def sanitize(res: dict, out_dir: Path) -> bool:
    import torch

    from kernels import reference as R
    from kernels.config import get_config
    from explore_common import run_sanitizers

    run_sanitizers(res, "scripts/router_explore.py", _mini_ids(), out_dir, timeout_s=240)
    cfg = get_config("mini")
    w = R.make_weights(cfg, "cuda", seed=4)
    g = torch.Generator(device="cpu").manual_seed(9)
    res["mini_stress"] = {}
    for ident in _mini_ids():
        op, k = _load(_entries()[ident])
        h = R.rmsnorm(torch.randn(op.batch, cfg.hidden, generator=g).to(torch.bfloat16).cuda(), w.gamma_pre)
        res["mini_stress"][ident] = s = _stress(op, k, h, w, runs=24)
        print(f"stress {ident:14s} {json.dumps(s)}", flush=True)
    return all(r["clean"] for r in res["sanitizers"].values()) and not any(
        s["not_bitwise_identical"] or s["counters_left_nonzero"] for s in res["mini_stress"].values())


def gpu(out_dir: Path, skip_sanitize: bool) -> int:
    from benchmarks.common import gpu_environment, read_bandwidth

    out_dir.mkdir(parents=True, exist_ok=True)
    plan_doc = json.loads((CARRY / "plan.json").read_text())
    res = {"commit": plan_doc["commit"], "plan_dirty": plan_doc["dirty"], "env": gpu_environment(),
           "command": "PYTHONPATH=. python3 " + " ".join(sys.argv), "variants": plan_doc["entries"]}
    path = out_dir / "explore.json"
    t0 = time.time()
    res["ceiling_read"] = read_bandwidth(reps=10)
    read_tbps = res["ceiling_read"]["tbps"]
    print(f"read-only {read_tbps:.3f} TB/s ({time.time() - t0:.0f} s)", flush=True)
    try:
        k3(res, read_tbps)
    except Exception:  # keep what was measured
        import traceback

        res["error"] = traceback.format_exc()[-3000:]
        print(res["error"], flush=True)
    path.write_text(json.dumps(res, indent=1, default=str))
    clean = None
    if not skip_sanitize:
        clean = sanitize(res, out_dir)
        res["dynamic_audit_clean"] = clean
    path.write_text(json.dumps(res, indent=1, default=str))
    ok = "error" not in res and all(r["passed"] and not r["stress"]["not_bitwise_identical"]
                                    and not r["stress"]["counters_left_nonzero"] for r in res["k3"].values())
    print(f"done ({time.time() - t0:.0f} s): k3 {'ok' if ok else 'NOT OK'}, dynamic audit "
          f"{'skipped' if clean is None else 'CLEAN' if clean else 'NOT CLEAN'} -> {path}")
    return 0 if ok and clean is not False else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--sweep", action="store_true", help="also the mma design's CTA widths at batches 8-64")
    g = sub.add_parser("gpu")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--skip-sanitize", action="store_true")
    sub.add_parser("child")
    b = sub.add_parser("ab", help="interleaved rounds of batch-1 variants (ids of the carried plan)")
    b.add_argument("ids", nargs="+")
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "ab":
        return ab(a.ids, a.rounds, a.out)
    if a.cmd == "plan":
        return plan(a.jobs, a.sweep)
    if a.cmd == "child":
        return child()
    return gpu(a.out, a.skip_sanitize)


if __name__ == "__main__":
    sys.exit(main())
