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

At the batches of GEMV_ROUTER the router's projections, and at those of GEMV_DENSE the output
side's, are instead foundation GEMM launches (kernels/ops/gemv.py, its own defaults) with small
kernels for what followed them in the fused launches; same semantics and roundings:

    2  gemv  logits = h @ W_g.T (fp32)      router_select  top-k, weights, grouping
                                             beside them: gemv  z = h @ W_down.T
    7  gemv  gu = h @ W_sgu.T (fp32)         gated_situ  a_s = bf16(SiTU(gu))
    8  gemv  s = a_s @ W_sd.T (bf16)         gemv  r = n @ W_up.T (bf16)
                                             residual  out = bf16(x + r + s)

With `concurrent=True` a second stream runs, beside 2-6, z's gemv (GEMV_ROUTER), then 7 (it
needs only h) and at GEMV_DENSE batches s's gemv; an event joins z before 4, another the shared
expert before 8. Under graph capture the streams become parallel branches of the one graph.

Scratch buffers are allocated once per block object; the split-K counters (router, moe_w2, the
gemv launches) are zeroed once and every launch leaves them zero.
"""

from __future__ import annotations

from pathlib import Path

from kernels.build import DEFAULT_ROOT, find_artifact
from kernels.config import ModelConfig

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


# The router's stream design is its default up to batch 2. Round 3 kept the block's batch 2 on
# the mma router (the step took 1000 us against 644 with the stream router,
# evidence_reports/moe_block/round3/final/, when batch 2's experts were the persistent pipelined
# kernels); round 7 moved it to the gemv path (GEMV_ROUTER); round 8 (the radix selection, 18.8
# us alone against the gemv path's 29.6-30.2 in the block) brings batch 2 back to the router's
# stream design (evidence_reports/moe_block/round8/b2/: the block beside round 8's final on the
# same steps).
# Batches 8-64: the mma design's CTA shape, swept in one call (evidence_reports/moe_block/round5/
# router_widths/; round 4 had 16 warps at 32 and 64): 16 warps with 16-row router and 32-row down
# CTAs from batch 16 (router+down 52.4 -> 40.7 us at 16, 69.2 -> 62.8 at 32, 124.1 -> 109.3 at 64
# against 16 warps of 8- and 16-row CTAs); at batch 8 8 warps with 32-row router and 64-row down
# CTAs (36.6 -> 34.6 us).
_WIDE_ROUTER = {"warps_per_cta": 16, "row_tiles": 2, "down_row_tiles": 4}
ROUTER_IN_BLOCK = {8: {"row_tiles": 4, "down_row_tiles": 8},
                   16: _WIDE_ROUTER, 32: _WIDE_ROUTER, 64: _WIDE_ROUTER}


# The batches at which the router's projections are foundation GEMM launches (kernels/ops/gemv.py,
# its own defaults): the logits h @ W_g.T in fp32, then `router_select` (kernels/ops/router.py:
# the router's selection and grouping alone, a warp per token across CTAs), and beside them on
# the side stream z = h @ W_down.T; instead of the router launch that computes both projections
# on its mma (or stream) design and selects in one CTA. And the batches at which the output
# side's projections (W_sgu, W_sd, W_up) are foundation GEMM launches with kernels/ops/
# epilogue.py's epilogues instead of the fused shared_gate_up / latent_out kernels (module
# docstring). Alone, at batch 64, the foundation GEMM (evidence_reports/foundation/final/) takes
# 7.0 us for W_g, 15.8 for W_down, 43.8 for W_sgu, 15.0 + 23.6 for W_up and W_sd, where the
# block's ops took 109.6 (router+down), 89.0 and 80.6 (evidence_reports/moe_block/round6/
# w13_wg/); at batch 8 5.7, 14.3, 41.6 and 13.6 + 21.7 against 34.9, 46.8 and 39.1
# (round6/block/final/).
#
# Chosen on an H200 in one call, each batch's block beside the block before on the same steps
# (evidence_reports/moe_block/round7/gemv_ab/, read ceiling 4.602-4.603 TB/s), us per step (fraction of
# read), router+down alone: batch 1 329.4 -> 344.3 (94.8 -> 90.7%; router+down 19.5 -> 26.7 us:
# the stream router's one launch stays), 2 583.7 -> 569.6 (92.5 -> 94.8%; 34.6 -> 29.6), 4
# 1007.6 -> 994.4 (96.0 -> 97.2%; 34.6 -> 29.9), 8 1836.5 -> 1805.2 (97.3 -> 99.0%; 34.9 -> 25.2),
# 16 3211.5 -> 3173.2 (99.9 -> 101.1%; 41.0 -> 28.7), 32 5462.5 -> 5381.5 (99.8 -> 101.3%; 63.4 ->
# 29.5), 64 8284.4 -> 8114.0 (98.8 -> 100.9%; 108.9 -> 33.7). The output side at batch 64:
# shared_gate_up 88.9 -> 46.2 us, latent_out 80.4 -> 41.5. GEMV_DENSE stops at 8: alone, the
# foundation GEMM's W_up + W_sd at batches 2 and 4 take 39.3 and 39.7 us where latent_out takes 37, and
# W_sgu's 45.1 where shared_gate_up takes 45.2-45.4. A router split that kept the router's own
# mma launch for the logits and moved only z to a gemv (commit 281903a, round7/split_down_281903a/)
# was no faster: the router's launch itself, not its down CTAs, took the time.
# Round 8 (evidence_reports/moe_block/round8/) made the router's stream design faster: alone,
# 16.7-16.9 us at batch 1 and 18.8 at batch 2 (round 7's: 19.4 and 24.4), where the block's
# gemv path at batch 2 takes 29.6-30.2 us: batch 2 is back on the router kernel (above).
GEMV_ROUTER = (4, 8, 16, 32, 64)
GEMV_DENSE = (8, 16, 32, 64)


def router_by_gemv(batch: int) -> bool:
    """Whether the router's projections at `batch` are foundation GEMM launches."""
    return batch in GEMV_ROUTER


def dense_by_gemv(batch: int) -> bool:
    """Whether the output side's projections at `batch` are foundation GEMM launches."""
    return batch in GEMV_DENSE


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
    return {}  # past 16, a batch that is not a decode size, and every gemv: the manifest defaults


def block_variants(cfg: ModelConfig, batch: int, *, gemv_router: bool | None = None,
                   gemv_dense: bool | None = None) -> list[tuple[str, str, dict]]:
    """(role, kernel, manifest shape) of every kernel variant the block launches at `batch`, in
    launch order (on one stream); `gemv_router` / `gemv_dense` override GEMV_ROUTER / GEMV_DENSE
    (a plan built under other choices). The gemv shapes are the foundation's problems but one,
    W_sgu's with fp32 output (12288 x 7168 at k3), which the foundation proof times in bf16."""
    T = batch
    H, L, S, E = cfg.hidden, cfg.latent, cfg.shared_inter, cfg.n_experts
    gemv_router = router_by_gemv(batch) if gemv_router is None else gemv_router
    gemv_dense = dense_by_gemv(batch) if gemv_dense is None else gemv_dense
    experts = {"n_experts": E, "latent": L, "expert_inter": cfg.expert_inter, "top_k": cfg.top_k}

    def gemv(n, k, out="bfloat16"):
        return {"batch": T, "n": n, "k": k, "out_dtype": out}

    head = [("norm_pre", "rmsnorm", {"batch": T, "width": H})]
    if gemv_router:
        head += [("logits", "gemv", gemv(E, H, "float32")),
                 ("router", "router_select", {"batch": T, "n_experts": E, "top_k": cfg.top_k}),
                 ("down", "gemv", gemv(L, H))]
    else:
        head += [("router", "router", {"batch": T, "n_experts": E, "hidden": H, "top_k": cfg.top_k, "latent": L})]
    routed = [("w13", "moe_w13", {"batch": T, **experts}), ("w2", "moe_w2", {"batch": T, **experts}),
              ("norm_latent", "rmsnorm", {"batch": T, "width": L})]
    if not gemv_dense:
        return head + routed + [
            ("shared_gate_up", "shared_gate_up", {"batch": T, "hidden": H, "shared_inter": S}),
            ("latent_out", "latent_out", {"batch": T, "hidden": H, "latent": L, "shared_inter": S})]
    return head + routed + [
        ("shared_gate_up", "gemv", gemv(2 * S, H, "float32")),
        ("shared_situ", "gated_situ", {"batch": T, "width": S}),
        ("shared_down", "gemv", gemv(H, S)),
        ("up", "gemv", gemv(H, L)),
        ("residual", "residual", {"batch": T, "width": H})]


class BlockKernels:
    """The loaded kernels of one batch size, by role (block_variants' roles, as attributes)."""

    def __init__(self, **kernels):
        vars(self).update(kernels)

    def get(self, role: str):
        return vars(self).get(role)

    def hashes(self) -> dict[str, str]:
        return {f"{role}:{k.meta['kernel']}": k.sha256 for role, k in vars(self).items()}


def load_block_kernels(cfg: ModelConfig, batch: int, root: Path = DEFAULT_ROOT, dirs=None,
                       variants=None) -> BlockKernels:
    """Load (on the current device) every prebuilt cubin of the block at `batch`.

    By default each variant is this checkout's choice (`block_variants`, `block_tunables`), found
    under `root` and verified against today's sources (kernels.build.find_artifact raises
    BuildError naming a missing or stale variant). `dirs(kernel, shape)` instead names each
    variant's build folder and `variants` the (role, kernel, shape) list: scripts/block_proof.py
    passes its plan's (whose cubins it has checked against the plan's hashes), so a plan runs as
    it was built, whatever the checkout's sources and choices are now.
    """
    from kernels.launch import CubinKernel

    def folder(name, shape):
        if dirs is not None:
            return dirs(name, shape)
        return find_artifact(name, shape, block_tunables(name, batch), root=root).dir

    if variants is None:
        variants = block_variants(cfg, batch)
    ks = {role: CubinKernel.from_dir(folder(name, shape)) for role, name, shape in variants}
    for k in ks.values():
        k.load()  # before any graph capture (module loading is not capturable)
    return BlockKernels(**ks)


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
        self.gemv_router = self.k.get("down") is not None
        self.gemv_dense = self.k.get("residual") is not None
        dev = weights.w_gate.device
        bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
        E, H, L, I, S, K = cfg.n_experts, cfg.hidden, cfg.latent, cfg.expert_inter, cfg.shared_inter, cfg.top_k
        TK = T * K
        G = min(TK, E)

        def e(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=dev)

        def param_buffer(kernel, name):
            """A zeroed buffer of `kernel`'s parameter `name` as its metadata declares it."""
            spec = next(p for p in kernel.meta["params"] if p["name"] == name)["spec"]
            return torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=dev)

        self.buf = {
            "h": e((T, H), bf16), "logits": e((T, E), f32), "ids": e((T, K), i32), "weights": e((T, K), f32),
            "n_groups": e((1,), i32), "group_expert": e((G,), i32), "group_start": e((G + 1,), i32),
            "sorted_slots": e((TK,), i32), "router_counter": param_buffer(self.k.router, "counter"),
            "z": e((T, L), bf16), "act": e((TK, I), bf16), "o": e((TK, L), f32),
            "w2_counters": param_buffer(self.k.w2, "counters"), "c": e((T, L), bf16),
            "n": e((T, L), bf16), "a_shared": e((T, S), bf16),
        }
        if self.gemv_dense:
            self.buf.update({"gu": e((T, 2 * S), f32), "r": e((T, H), bf16), "s": e((T, H), bf16)})
        for role, kern in vars(self.k).items():  # each gemv its own split-K scratch: two may run at once
            if kern.meta["kernel"] == "gemv":
                self.buf[f"{role}_partials"] = param_buffer(kern, "partials")
                self.buf[f"{role}_counters"] = param_buffer(kern, "counters")
        if concurrent:
            self._side = torch.cuda.Stream(device=dev)

    def routing_tensors(self) -> dict:
        """The router's outputs of the last launch (ids, weights, logits and the grouping)."""
        return {k: self.buf[k] for k in ("logits", "ids", "weights", "n_groups", "group_expert",
                                         "group_start", "sorted_slots")}

    def _gemv(self, role: str, x, w, y) -> None:
        self.k.get(role)(x, w, y, self.buf[f"{role}_partials"], self.buf[f"{role}_counters"])

    def _event(self, stream):
        import torch

        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _router(self, h, w_gate, w_down) -> None:
        """The routing (and, in the router's launch, z) on the current stream."""
        b = self.buf
        if self.gemv_router:
            self._gemv("logits", h, w_gate, b["logits"])
            self.k.router(b["logits"], self.w.bias, b["ids"], b["weights"], b["n_groups"], b["group_expert"],
                          b["group_start"], b["sorted_slots"], b["router_counter"])
            return
        self.k.router(h, w_gate, self.w.bias, b["logits"], b["ids"], b["weights"], b["n_groups"],
                      b["group_expert"], b["group_start"], b["sorted_slots"], b["router_counter"], w_down, b["z"])

    def route(self, h, w_gate, w_down) -> None:
        """Step 2 alone on torch's current stream: the routing and z = h @ W_down.T (in the
        router's launch, or at GEMV_ROUTER batches a gemv on the side stream, joined)."""
        import torch

        if not self.gemv_router:
            self._router(h, w_gate, w_down)
            return
        if self.concurrent:
            main = torch.cuda.current_stream()
            self._side.wait_event(self._event(main))
            with torch.cuda.stream(self._side):
                self._gemv("down", h, w_down, self.buf["z"])
            z_ready = self._event(self._side)
            self._router(h, w_gate, w_down)
            main.wait_event(z_ready)
        else:
            self._router(h, w_gate, w_down)
            self._gemv("down", h, w_down, self.buf["z"])

    def shared_gate_up(self, h, w_sgu) -> None:
        """Step 7: a_s = bf16(SiTU(h @ W_sgu.T)) on torch's current stream."""
        b = self.buf
        if self.gemv_dense:
            self._gemv("shared_gate_up", h, w_sgu, b["gu"])
            self.k.shared_situ(b["gu"], b["a_shared"])
        else:
            self.k.shared_gate_up(h, w_sgu, b["a_shared"])

    def shared_down(self, a, w_sd) -> None:
        """At GEMV_DENSE batches, s = a_s @ W_sd.T (elsewhere part of latent_out)."""
        self._gemv("shared_down", a, w_sd, self.buf["s"])

    def latent_out(self, x, n, w_up, a, w_sd, out, *, with_shared_down: bool = True) -> None:
        """Step 8: out = x + n @ W_up.T + a @ W_sd.T; at GEMV_DENSE batches, unless the shared
        expert's down-projection already ran (`with_shared_down` False: buf["s"] holds it)."""
        b = self.buf
        if not self.gemv_dense:
            self.k.latent_out(x, n, w_up, a, w_sd, out)
            return
        if with_shared_down:
            self.shared_down(a, w_sd)
        self._gemv("up", n, w_up, b["r"])
        self.k.residual(x, b["r"], b["s"], out)

    def launch(self, x, out) -> None:
        """Enqueue the block on torch's current stream (forking to side streams when concurrent):
        out = block(x). Asynchronous; capturable."""
        import torch

        b, w, k = self.buf, self.w, self.k
        k.norm_pre(x, w.gamma_pre, b["h"])
        if self.concurrent:
            main = torch.cuda.current_stream()
            self._side.wait_event(self._event(main))
            with torch.cuda.stream(self._side):  # beside the router and the routed experts
                if self.gemv_router:
                    self._gemv("down", b["h"], w.w_down, b["z"])
                    z_ready = self._event(self._side)
                self.shared_gate_up(b["h"], w.w_shared_gate_up)
                if self.gemv_dense:
                    self.shared_down(b["a_shared"], w.w_shared_down)
            shared_ready = self._event(self._side)
            self._router(b["h"], w.w_gate, w.w_down)
            if self.gemv_router:
                main.wait_event(z_ready)
        else:
            self.route(b["h"], w.w_gate, w.w_down)
        k.w13(b["z"], w.w13, b["n_groups"], b["group_expert"], b["group_start"], b["sorted_slots"], b["act"])
        k.w2(b["act"], w.w2, b["weights"], b["n_groups"], b["group_expert"], b["group_start"],
             b["sorted_slots"], b["o"], b["w2_counters"], b["c"])
        k.norm_latent(b["c"], w.gamma_latent, b["n"])
        if self.concurrent:
            main.wait_event(shared_ready)
        else:
            self.shared_gate_up(b["h"], w.w_shared_gate_up)
        self.latent_out(x, b["n"], w.w_up, b["a_shared"], w.w_shared_down, out,
                        with_shared_down=not (self.concurrent and self.gemv_dense))

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
