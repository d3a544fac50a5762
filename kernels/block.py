"""The LatentMoE decode block as a chain of prebuilt CuTe DSL kernels, captured in one CUDA graph.

GPU host only and DSL-free: every kernel is an AOT-built cubin found with
`kernels.build.find_artifact` (verified against today's sources) and launched through
`kernels.launch.CubinKernel`. The chain, for T tokens (kernels/reference.py gives the semantics):

    1 rmsnorm         h = RMSNorm(x) * gamma_pre                       (foundation kernel)
    2 router          logits, top-k ids and weights, routing grouped by expert, and alongside
                      in the same launch the latent down-projection z = h @ W_down.T
    4 moe_w13         act = SiTU(z[token] @ W13_e.T) per (expert, token)
    5 moe_w2          c = sum_k w_k (act @ W2_e.T)
    6 rmsnorm         n = RMSNorm(c) * gamma_latent                    (foundation kernel)
    7 shared_gate_up  a_s = SiTU(h @ W_sgu.T)
    8 latent_out      out = x + n @ W_up.T + a_s @ W_sd.T

With `concurrent=True`, 7 runs on a second stream beside 2-6 (it needs only h); an event joins it
before 8. Under graph capture the streams become parallel branches of the one graph.

Scratch buffers are allocated once per block object; the split-K counters (router, moe_w2) are
zeroed once and every launch leaves them zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kernels.build import DEFAULT_ROOT, find_artifact
from kernels.config import ModelConfig

BLOCK_KERNELS = ("rmsnorm", "router", "moe_w13", "moe_w2", "shared_gate_up", "latent_out")

# The routed experts' pipelined path (32-row items), chosen on an H200 by scripts/block_explore.py
# (evidence_reports/moe_block/round2) for batches up to one 16-row mma tile of tokens. Since round 3
# the stream path (STREAM_EXPERTS, below) serves every batch up to STREAM_EXPERTS_MAX_BATCH (16),
# so block_tunables reaches these only if that bound is lowered; from batch 16 both kernels take
# their warpgroup paths (WG_EXPERTS, below).
PIPELINED_EXPERTS = {
    "moe_w13": {"pipeline": 1, "row_tiles": 4, "warps_per_cta": 4, "k_unroll": 2, "ctas_per_sm": 3},
    # 4 warps: 165 registers at most up to batch 16 keep 3 CTAs of 128 threads per SM (with 8
    # warps batches 2 and 4 need 130: one CTA per SM, half the persistent grid waiting)
    "moe_w2": {"pipeline": 1, "row_tiles": 4, "warps_per_cta": 4, "k_unroll": 2, "ctas_per_sm": 3},
}


# moe_w2 from batch 2: the TMA-fed warpgroup path (`wg`, kernels/ops/moe_experts.py; the stream
# path yields to it with stream 0), 4 stages of 128 k, 8-token tiles. Measured on an H200 by
# scripts/experts_batch_explore.py --wg-sweep against the block's previous choice in the same
# call (evidence_reports/moe_block/round6/moe_w2_wg/): batch 2 162.6 -> 157.8 us (93.8 -> 96.7%
# of read), 4 311.3 -> 300.7 (95.7 -> 99.0%), 8 600 -> 571 (95.4 -> 100.3%), 16 1152 -> 1071
# (93.5 -> 100.6%), 32 2114 -> 1901 (90.3 -> 100.4%), 64 3610 -> 2990 (81.9 -> 98.8%). Before it:
# the stream path to 16, at 32 the persistent path with 4 row tiles, at 64 with 4 warps and 4 CTAs
# per SM. Batch 1 keeps the stream path: wg measured 85.5 -> 83.9 us alone, but the stream path
# launches with pdl, which overlaps its start with moe_w13's end in the block, and wg does not.
# moe_w13 from batch 16 (its cp.async-fed form; the same sweep, evidence_reports/moe_block/round6/
# w13_wg/): batch 16 2246 -> 2159 us (97.7 -> 101.6% of read), 32 4020 -> 3756 (94.9 -> 101.6%),
# 64 6452 -> 5827 (91.6 -> 101.4%). Up to batch 8 its stream path reads 99-100% already. Before
# it: the stream path to 16; at 32 the stream path on a persistent grid of 6 CTAs per SM (round 5,
# evidence_reports/moe_block/round5/experts_stream/), at 64 the persistent per-item path (round 4).
WG_EXPERTS = {"moe_w2": (2, 4, 8, 16, 32, 64), "moe_w13": (16, 32, 64)}


# Up to STREAM_EXPERTS_MAX_BATCH tokens the routed experts take the stream design where
# WG_EXPERTS does not take them
# (kernels/ops/moe_experts.py: a short CTA per expert and block of whole weight rows, every cp.async
# issued before one wait; past batch 1 a group's tokens go through `stream_slots` activation rows
# in shared memory a chunk at a time), chosen on an H200 by scripts/experts_b1_explore.py
# (evidence_reports/moe_block/round3/experts) and, past batch 1, scripts/experts_batch_explore.py
# (evidence_reports/moe_block/round3/experts_b8).
STREAM_EXPERTS = {
    # 2 (gate, up) row pairs per CTA; 1 pair measured the same (99.7-100% of read)
    "moe_w13": {"stream": 1, "stream_threads": 128, "stream_cta_kib": 32, "pdl": 1},
    # 4 rows per CTA: 91.7% of read, 2 rows 87.9%, 1 row 82.9% (fewer arrivals and combines)
    "moe_w2": {"stream": 1, "stream_threads": 128, "stream_cta_kib": 32, "pdl": 1},
}
STREAM_EXPERTS_MAX_BATCH = 16
# One activation row per CTA past batch 1 (at batch 8 almost every group has 1 token, a few 2-3:
# those take a second short round trip). H200, per op at batch 8: 1 slot moe_w13 99.8% / moe_w2
# 95.5% of read, 2 slots 93.4% / 83.9%, 4 slots 67.8% / 58.4% (fewer CTAs per SM by shared memory).
STREAM_SLOTS = 1


# The router's stream design is its default up to batch 2 (faster alone: 24.3 us against the
# mma design's 34.2 at batch 2), but in the block at batch 2 the step took 1000 us against 644
# with the mma router (evidence_reports/moe_block/round3/final/, when batch 2's experts were still
# the persistent pipelined kernels; not re-measured since they moved to the stream path), so the
# block keeps the mma router there.
# Batches 8-64: the mma design's CTA shape, swept in one call (evidence_reports/moe_block/round5/
# router_widths/; round 4 had 16 warps at 32 and 64): 16 warps with 16-row router and 32-row down
# CTAs from batch 16 (router+down 52.4 -> 40.7 us at 16, 69.2 -> 62.8 at 32, 124.1 -> 109.3 at 64
# against 16 warps of 8- and 16-row CTAs); at batch 8 8 warps with 32-row router and 64-row down
# CTAs (36.6 -> 34.6 us).
_WIDE_ROUTER = {"warps_per_cta": 16, "row_tiles": 2, "down_row_tiles": 4}
ROUTER_IN_BLOCK = {2: {"stream_max_batch": 1}, 8: {"row_tiles": 4, "down_row_tiles": 8},
                   16: _WIDE_ROUTER, 32: _WIDE_ROUTER, 64: _WIDE_ROUTER}


def block_tunables(kernel: str, batch: int) -> dict:
    """The tunables the block launches `kernel` with at `batch` (empty: the manifest defaults)."""
    if kernel == "router":
        return dict(ROUTER_IN_BLOCK.get(batch, {}))
    if batch in WG_EXPERTS.get(kernel, ()):
        return {"stream": 0, "wg": 1}
    if kernel in STREAM_EXPERTS and batch <= STREAM_EXPERTS_MAX_BATCH:
        if batch == 1:
            return dict(STREAM_EXPERTS[kernel])
        return {**STREAM_EXPERTS[kernel], "stream_max_batch": batch, "stream_slots": STREAM_SLOTS}
    if batch <= 16:
        return dict(PIPELINED_EXPERTS.get(kernel, {}))
    return {}  # past 16, a batch that is not a decode size: the manifest defaults


def block_variants(cfg: ModelConfig, batch: int) -> list[tuple[str, dict]]:
    """(kernel, manifest shape) of every kernel variant the block launches at `batch`."""
    T = batch
    return [
        ("rmsnorm", {"batch": T, "width": cfg.hidden}),
        ("router", {"batch": T, "n_experts": cfg.n_experts, "hidden": cfg.hidden, "top_k": cfg.top_k,
                    "latent": cfg.latent}),
        ("moe_w13", {"batch": T, "n_experts": cfg.n_experts, "latent": cfg.latent,
                     "expert_inter": cfg.expert_inter, "top_k": cfg.top_k}),
        ("moe_w2", {"batch": T, "n_experts": cfg.n_experts, "latent": cfg.latent,
                    "expert_inter": cfg.expert_inter, "top_k": cfg.top_k}),
        ("rmsnorm", {"batch": T, "width": cfg.latent}),
        ("shared_gate_up", {"batch": T, "hidden": cfg.hidden, "shared_inter": cfg.shared_inter}),
        ("latent_out", {"batch": T, "hidden": cfg.hidden, "latent": cfg.latent, "shared_inter": cfg.shared_inter}),
    ]


@dataclass
class BlockKernels:
    """The loaded kernels of one batch size, by role."""

    norm_pre: object
    router: object
    w13: object
    w2: object
    norm_latent: object
    shared_gate_up: object
    latent_out: object

    def hashes(self) -> dict[str, str]:
        return {f"{role}:{k.meta['kernel']}": k.sha256 for role, k in vars(self).items()}


def load_block_kernels(cfg: ModelConfig, batch: int, root: Path = DEFAULT_ROOT, dirs=None) -> BlockKernels:
    """Load (on the current device) every prebuilt cubin of the block at `batch`.

    By default each variant is this checkout's choice (`block_tunables`), found under `root` and
    verified against today's sources (kernels.build.find_artifact raises BuildError naming a
    missing or stale variant). `dirs(kernel, shape)` instead names each variant's build folder:
    scripts/block_proof.py passes its plan's (whose cubins it has checked against the plan's
    hashes), so a plan runs as it was built, whatever the checkout's sources are now.
    """
    from kernels.launch import CubinKernel

    def folder(name, shape):
        if dirs is not None:
            return dirs(name, shape)
        return find_artifact(name, shape, block_tunables(name, batch), root=root).dir

    ks = [CubinKernel.from_dir(folder(name, shape)) for name, shape in block_variants(cfg, batch)]
    for k in ks:
        k.load()  # before any graph capture (module loading is not capturable)
    return BlockKernels(*ks)


class MoEBlock:
    """One batch size of the block: its kernels, weights and scratch; `launch` enqueues the chain."""

    def __init__(self, cfg: ModelConfig, batch: int, weights, *, root: Path = DEFAULT_ROOT,
                 concurrent: bool = True, kernels: BlockKernels | None = None):
        import torch

        self.cfg = cfg
        self.batch = T = batch
        self.w = weights
        self.k = kernels or load_block_kernels(cfg, batch, root)
        self.concurrent = concurrent
        dev = weights.w_gate.device
        bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
        E, H, L, I, S, K = cfg.n_experts, cfg.hidden, cfg.latent, cfg.expert_inter, cfg.shared_inter, cfg.top_k
        TK = T * K
        G = min(TK, E)
        counters = next(p for p in self.k.w2.meta["params"] if p["name"] == "counters")
        rb_w2 = counters["spec"]["shape"][0]  # one per row block

        def e(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=dev)

        self.buf = {
            "h": e((T, H), bf16), "logits": e((T, E), f32), "ids": e((T, K), i32), "weights": e((T, K), f32),
            "n_groups": e((1,), i32), "group_expert": e((G,), i32), "group_start": e((G + 1,), i32),
            "sorted_slots": e((TK,), i32), "router_counter": torch.zeros((1,), dtype=i32, device=dev),
            "z": e((T, L), bf16), "act": e((TK, I), bf16), "o": e((TK, L), f32),
            "w2_counters": torch.zeros((rb_w2,), dtype=i32, device=dev), "c": e((T, L), bf16),
            "n": e((T, L), bf16), "a_shared": e((T, S), bf16),
        }
        if concurrent:
            self._side = torch.cuda.Stream(device=dev)

    def routing_tensors(self) -> dict:
        """The router's outputs of the last launch (ids, weights, logits and the grouping)."""
        return {k: self.buf[k] for k in ("logits", "ids", "weights", "n_groups", "group_expert",
                                         "group_start", "sorted_slots")}

    def launch(self, x, out) -> None:
        """Enqueue the block on torch's current stream (forking to side streams when concurrent):
        out = block(x). Asynchronous; capturable."""
        import torch

        b, w, k = self.buf, self.w, self.k
        main = torch.cuda.current_stream()
        k.norm_pre(x, w.gamma_pre, b["h"])
        if self.concurrent:
            h_ready = torch.cuda.Event()
            h_ready.record(main)
            self._side.wait_event(h_ready)
            with torch.cuda.stream(self._side):
                k.shared_gate_up(b["h"], w.w_shared_gate_up, b["a_shared"])
            a_ready = torch.cuda.Event()
            a_ready.record(self._side)
        k.router(b["h"], w.w_gate, w.bias, b["logits"], b["ids"], b["weights"], b["n_groups"],
                 b["group_expert"], b["group_start"], b["sorted_slots"], b["router_counter"], w.w_down, b["z"])
        k.w13(b["z"], w.w13, b["n_groups"], b["group_expert"], b["group_start"], b["sorted_slots"], b["act"])
        k.w2(b["act"], w.w2, b["weights"], b["n_groups"], b["group_expert"], b["group_start"],
             b["sorted_slots"], b["o"], b["w2_counters"], b["c"])
        k.norm_latent(b["c"], w.gamma_latent, b["n"])
        if self.concurrent:
            main.wait_event(a_ready)
        else:
            k.shared_gate_up(b["h"], w.w_shared_gate_up, b["a_shared"])
        k.latent_out(x, b["n"], w.w_up, b["a_shared"], w.w_shared_down, out)

    def capture(self, xs, outs):
        """A CUDA graph of `launch(xs[i], outs[i])` for every i, in order (one decode step each).
        Warms up every launch first. Returns the torch.cuda.CUDAGraph."""
        import torch

        for x, o in zip(xs, outs):
            self.launch(x, o)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for x, o in zip(xs, outs):
                self.launch(x, o)
        return graph
