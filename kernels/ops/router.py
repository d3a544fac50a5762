"""The MoE router in one launch: logits = h @ W_g.T (bf16 in, fp32 accumulation and out), sigmoid,
top-k of s + bias (selection only), weights renormalised over the unbiased scores, and the routing
grouped by expert for the expert kernels (kernels/ops/moe_experts.py). The latent down-projection
z = h @ W_down.T (bf16 out) runs alongside, in the same launch: both read h, and the down CTAs
keep the SMs streaming while the router's last CTA selects and groups.

CTAs 0 .. n_experts/8-1 are router CTAs (phase 1, then the arrival); the others are down CTAs,
16 rows of W_down each, same mma scheme, no arrival.

Phase 1, every CTA: `8 * row_tiles` router rows for every token on the tensor cores (the decode
mma scheme of kernels/ops/decode_mma.py; W_g through the read-only path), partials summed in warp
order in shared memory, fp32 logits stored. Then thread 0 adds 1 to a gpu-scope counter with
acq_rel semantics after a CTA barrier (the split-K pattern of kernels/ops/splitk_gemv.py): the CTA
that arrives last resets the counter (release store; the host zeroes it once) and alone runs
phase 2 over everybody's logits.

Phase 2, the last CTA:
  * one warp per token: each lane holds n_experts/32 biased scores s + b in registers; top_k
    rounds of a warp argmax (butterfly over (score, index): greater score wins, equal scores go
    to the LOWER expert index, exactly the reference's stable descending sort); the winner's lane
    retires it. Then one lane per selection recomputes its unbiased score (sigmoid of the same
    logit: bitwise the score ranked), and weights w_k = s_k / (sum of the selected s, in
    selection order, + 1e-20) * scale. Lane 0 sets token t's bit in the chosen expert's token
    mask (shared memory, one 32-bit word per 32 tokens).
  * grouping by expert, a counting sort, deterministic: warp 0 scans the experts' token counts
    (population counts of the masks) and group flags across its lanes, so expert e's slots start
    at start[e] = #slots of lower experts and its group index is the number of lower experts
    chosen; slot p = t * top_k + j of expert e goes to sorted position start[e] + #tokens below t
    that chose e (a masked population count), so every expert's slots are contiguous and in
    token order. Outputs: n_groups, group_expert[u] (ascending expert id), group_start[u] (group
    u = sorted positions group_start[u] .. group_start[u+1]-1; the entry at n_groups is T*top_k)
    and sorted_slots[pos] = p. Entries past n_groups are left as they were. O(T*top_k +
    n_experts) work (the first version counted in O((T*top_k)^2): ~400 us at batch 64).
"""

from __future__ import annotations

from kernels import reference
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec
from kernels.ops.common import WARP, ceil_div, cute, cutlass
from kernels.ops.decode_mma import (
    BATCH_PER_TILE,
    ROWS_PER_TILE,
    MmaPlan,
    accumulate,
    new_accumulators,
    padded_batch,
    partials_layout,
    sigmoid,
    store_partials,
    sum_partials,
    vector_view,
    x_row_slots,
)

MAX_BATCH = 64
WEIGHT_EPS = 1e-20  # kernels.reference.router
LOAD_GROUP_VECTORS = 16  # 16-byte vectors per lane per load group (two groups live with prefetch)

# Host-side tunables; must equal the manifest's defaults ([kernels.router]).
DEFAULT_TUNABLES = {"warps_per_cta": 8, "row_tiles": 1, "k_unroll": 8}
DOWN_ROW_TILES = 2  # 16 rows of W_down per down CTA


def routing_groups_ref(ids, n_experts: int):
    """The grouping phase 2 computes, in torch: {n_groups [1], group_expert [G], group_start [G+1],
    sorted_slots [T*k]} (int32; G = min(T*k, n_experts); entries past n_groups are -1 / T*k)."""
    import torch

    T, k = ids.shape
    flat = ids.reshape(-1).long().cpu()
    order = torch.sort(flat, stable=True).indices  # by expert, then slot (token order)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    G = min(T * k, n_experts)
    n = experts.numel()
    group_expert = torch.full((G,), -1, dtype=torch.int32)
    group_expert[:n] = experts.to(torch.int32)
    group_start = torch.full((G + 1,), T * k, dtype=torch.int32)
    group_start[:n] = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    dev = ids.device
    return {
        "n_groups": torch.tensor([n], dtype=torch.int32).to(dev),
        "group_expert": group_expert.to(dev),
        "group_start": group_start.to(dev),
        "sorted_slots": order.to(torch.int32).to(dev),
    }


def _token_count(sMask, e, E: int, words: int):
    """How many tokens chose expert e: the population count of its token mask."""
    c = cute.arch.popc(sMask[e])
    for w in range(1, words):
        c = c + cute.arch.popc(sMask[w * E + e])
    return c


class RouterOp(OpBase):
    """One variant of the router: shape {"batch", "n_experts", "hidden", "top_k"} plus tunables;
    `scale` (routed_scale) is baked in (default 1.0)."""

    kernel_name = "router"

    def __init__(self, shape: dict, **tunables):
        unknown = set(tunables) - set(DEFAULT_TUNABLES)
        if unknown:
            raise ValueError(f"router: unknown tunables {sorted(unknown)}; known: {sorted(DEFAULT_TUNABLES)}")
        super().__init__(shape, **{**DEFAULT_TUNABLES, **tunables})
        try:
            self.latent = int(shape["latent"])
            self.batch = int(shape["batch"])
            self.n_experts = int(shape["n_experts"])
            self.hidden = int(shape["hidden"])
            self.top_k = int(shape["top_k"])
        except KeyError as e:
            raise ValueError(f"router: shape needs batch, n_experts, hidden, top_k and latent; missing {e}") from None
        self.scale = float(shape.get("scale", 1.0))
        self.warps = int(self.tunables["warps_per_cta"])
        self.row_tiles = int(self.tunables["row_tiles"])
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"router: batch {self.batch} outside 1..{MAX_BATCH}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"router: top_k {self.top_k} outside 1..n_experts ({self.n_experts})")
        self.rows_per_cta = ROWS_PER_TILE * self.row_tiles
        if self.n_experts % self.rows_per_cta:
            raise ValueError(f"router: n_experts {self.n_experts} is not a multiple of {self.rows_per_cta} rows per CTA")
        if self.batch > self.warps * WARP:
            raise ValueError("router: more tokens than threads")
        self.batch_tiles = ceil_div(self.batch, BATCH_PER_TILE)
        x_vectors = sum(1 for mb in range(self.batch_tiles) for h in range(2)
                        if mb * BATCH_PER_TILE + h * 8 < self.batch)
        k_unroll = max(1, min(int(self.tunables["k_unroll"]), LOAD_GROUP_VECTORS // (self.row_tiles + x_vectors)))
        self.plan = MmaPlan(warps=self.warps, row_tiles=self.row_tiles, batch_tiles=self.batch_tiles,
                            k=self.hidden, k_unroll=k_unroll)
        self.ctas = self.n_experts // self.rows_per_cta
        self.down_row_tiles = DOWN_ROW_TILES
        self.down_rows_per_cta = ROWS_PER_TILE * DOWN_ROW_TILES
        if self.latent % self.down_rows_per_cta:
            raise ValueError(f"router: latent {self.latent} is not a multiple of {self.down_rows_per_cta}")
        self.down_ctas = self.latent // self.down_rows_per_cta
        du = max(1, min(int(self.tunables["k_unroll"]), LOAD_GROUP_VECTORS // (DOWN_ROW_TILES + x_vectors)))
        self.down_plan = MmaPlan(warps=self.warps, row_tiles=DOWN_ROW_TILES, batch_tiles=self.batch_tiles,
                                 k=self.hidden, k_unroll=du)
        self.partial_rows = max(self.rows_per_cta, self.down_rows_per_cta)
        self.threads = self.warps * WARP
        self.slots = self.batch * self.top_k
        self.groups = min(self.slots, self.n_experts)
        self.per_lane = ceil_div(self.n_experts, WARP)
        self.pb = padded_batch(self.batch)
        self.mask_words = ceil_div(self.batch, WARP)  # per expert: a bit per token
        self.smem_bytes = (self.partial_rows * self.pb * self.warps * 4 + 16
                           + 2 * ceil_div(self.slots * 4, 16) * 16
                           + ceil_div(self.mask_words * self.n_experts * 4, 16) * 16
                           + ceil_div(self.n_experts * 4, 16) * 16 + 64)

    # -- contract ---------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, E, H, K = self.batch, self.n_experts, self.hidden, self.top_k
        return {
            "h": TensorSpec((T, H), "bfloat16"),
            "w_gate": TensorSpec((E, H), "bfloat16"),
            "bias": TensorSpec((E,), "float32"),
            "logits": TensorSpec((T, E), "float32"),
            "ids": TensorSpec((T, K), "int32"),
            "weights": TensorSpec((T, K), "float32"),
            "n_groups": TensorSpec((1,), "int32"),
            "group_expert": TensorSpec((self.groups,), "int32"),
            "group_start": TensorSpec((self.groups + 1,), "int32"),
            "sorted_slots": TensorSpec((self.slots,), "int32"),
            "counter": TensorSpec((1,), "int32"),
            "w_down": TensorSpec((self.latent, H), "bfloat16"),
            "z": TensorSpec((T, self.latent), "bfloat16"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.ctas + self.down_ctas, 1, 1), block=(self.threads, 1, 1), smem_bytes=self.smem_bytes)

    def reference(self, *, h, w_gate, bias, w_down, compute_dtype=None, **_outputs):
        """Expected logits/ids/weights (kernels.reference.router), the grouping of those ids, and z."""
        kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        r = reference.router(h, w_gate, bias, self.top_k, scale=self.scale, **kwargs)
        return {"logits": r.logits, "ids": r.ids, "weights": r.weights,
                **routing_groups_ref(r.ids, self.n_experts), "z": reference.linear(h, w_down, **kwargs)}

    # -- device code ------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mH: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor, mLogits: cute.Tensor,
                 mIds: cute.Tensor, mWeights: cute.Tensor, mNGroups: cute.Tensor, mGroupExpert: cute.Tensor,
                 mGroupStart: cute.Tensor, mSorted: cute.Tensor, mCounter: cute.Tensor, mWd: cute.Tensor,
                 mZ: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mH, mW, mBias, mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted,
                    mCounter, mWd, mZ).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mH: cute.Tensor, mW: cute.Tensor, mBias: cute.Tensor, mLogits: cute.Tensor,
               mIds: cute.Tensor, mWeights: cute.Tensor, mNGroups: cute.Tensor, mGroupExpert: cute.Tensor,
               mGroupStart: cute.Tensor, mSorted: cute.Tensor, mCounter: cute.Tensor, mWd: cute.Tensor,
               mZ: cute.Tensor):
        T = self.batch
        E = self.n_experts
        K = self.top_k
        R = self.rows_per_cta
        W = self.warps
        NT = self.row_tiles
        TK = self.slots
        V = self.per_lane
        MW = self.mask_words
        CH = self.per_lane
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        neg_inf = f32(float("-inf"))

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        g = lane // 4
        q = lane % 4
        row0 = bidx * R

        smem = cutlass.utils.SmemAllocator()
        sP = smem.allocate_tensor(f32, partials_layout(self.partial_rows, self.pb, W), byte_alignment=16)
        sLast = smem.allocate_tensor(i32, cute.make_layout(1), byte_alignment=16)
        sIds = smem.allocate_tensor(i32, cute.make_layout(TK), byte_alignment=16)
        sSel = smem.allocate_tensor(f32, cute.make_layout(TK), byte_alignment=16)
        sMask = smem.allocate_tensor(i32, cute.make_layout(MW * E), byte_alignment=16)
        sStart = smem.allocate_tensor(i32, cute.make_layout(E), byte_alignment=16)

        if bidx < self.ctas:
            # --- phase 1: this CTA's logits ------------------------------------------------------
            gW = vector_view(mW)
            gX = vector_view(mH)
            acc = new_accumulators(self.plan)
            x_rows = x_row_slots(self.batch_tiles, T, g, lambda i: i)
            w_tiles = [(gW, row0 + nt * ROWS_PER_TILE) for nt in range(NT)]
            accumulate(self.plan, acc, w_tiles, gX, x_rows, warp, g, q)
            store_partials(self.plan, sP, acc, warp, g, q, T)
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(ceil_div(R * T, self.threads)):
                idx = tidx + j * self.threads
                if idx < R * T:
                    b = idx // R
                    r = idx % R
                    mLogits[b, row0 + r] = sum_partials(sP, r, b, W)

            # --- arrival: the last CTA runs phase 2 ----------------------------------------------
            cute.arch.sync_threads()
            if tidx == 0:
                old = cute.arch.atomic_add(mCounter.iterator, i32(1), sem="acq_rel", scope="gpu")
                last = i32(0)
                if old == self.ctas - 1:
                    last = i32(1)
                    # Every CTA has arrived: nothing reads the counter again this launch.
                    cute.arch.store(mCounter.iterator, i32(0), sem="release", scope="gpu")
                sLast[0] = last
            cute.arch.sync_threads()
            if sLast[0] == 1:
                for i in cutlass.range(tidx, MW * E, self.threads, unroll=1):
                    sMask[i] = i32(0)
                cute.arch.sync_threads()
                # --- top-k: one warp per token ---------------------------------------------------
                for t in cutlass.range(warp, T, W, unroll=1):
                    vals = cute.make_rmem_tensor(cute.make_layout(V), f32)
                    for i in cutlass.range_constexpr(V):
                        vals[i] = neg_inf
                        if lane + i * WARP < E:
                            vals[i] = sigmoid(mLogits[t, lane + i * WARP]) + mBias[lane + i * WARP]
                    for j in cutlass.range_constexpr(K):
                        bv = neg_inf
                        bi = i32(E)
                        for i in cutlass.range_constexpr(V):  # ascending index: strict > keeps the lowest
                            if vals[i] > bv:
                                bv = vals[i]
                                bi = lane + i * WARP
                        for sh in cutlass.range_constexpr(5):
                            ov = cute.arch.shuffle_sync_bfly(bv, offset=16 >> sh)
                            oi = cute.arch.shuffle_sync_bfly(bi, offset=16 >> sh)
                            if cutlass.or_(ov > bv, cutlass.and_(ov == bv, oi < bi)):
                                bv = ov
                                bi = oi
                        for i in cutlass.range_constexpr(V):
                            if lane + i * WARP == bi:
                                vals[i] = neg_inf
                        if lane == 0:
                            mIds[t, j] = bi
                            sIds[t * K + j] = bi
                            # token t's bit in expert bi's token mask (a token's experts are distinct)
                            cute.arch.atomic_or(sMask.iterator + (t // WARP) * E + bi, i32(1) << (t % WARP))
                    # The selected unbiased scores again (same input, same function: bitwise the
                    # ones ranked), one lane per selection so the loads overlap, rather than
                    # carrying every lane's scores in registers through the rounds.
                    cute.arch.sync_warp()
                    for j0 in cutlass.range_constexpr(0, K, WARP):
                        if j0 + lane < K:
                            sSel[t * K + j0 + lane] = sigmoid(mLogits[t, sIds[t * K + j0 + lane]])
                    cute.arch.sync_warp()
                    if lane == 0:
                        total = sSel[t * K]
                        for j in cutlass.range_constexpr(1, K):
                            total = total + sSel[t * K + j]
                        total = total + f32(WEIGHT_EPS)
                        for j in cutlass.range_constexpr(K):
                            mWeights[t, j] = sSel[t * K + j] / total * f32(self.scale)
                cute.arch.sync_threads()

                # --- grouping by expert: a counting sort over the token masks --------------------
                # Warp 0: each lane takes CH consecutive experts; counts and group flags are
                # scanned across the lanes, so expert e's slots start at sStart[e] and its group
                # index is the number of lower experts chosen.
                if warp == 0:
                    slots_here = i32(0)
                    groups_here = i32(0)
                    for i in cutlass.range_constexpr(CH):
                        e = lane * CH + i
                        if e < E:
                            c = _token_count(sMask, e, E, MW)
                            slots_here = slots_here + c
                            if c > 0:
                                groups_here = groups_here + 1
                    slots_incl = slots_here
                    groups_incl = groups_here
                    for sh in cutlass.range_constexpr(5):
                        os_ = cute.arch.shuffle_sync_up(slots_incl, offset=1 << sh)
                        og = cute.arch.shuffle_sync_up(groups_incl, offset=1 << sh)
                        if lane >= (1 << sh):
                            slots_incl = slots_incl + os_
                            groups_incl = groups_incl + og
                    pos = slots_incl - slots_here
                    u = groups_incl - groups_here
                    for i in cutlass.range_constexpr(CH):
                        e = lane * CH + i
                        if e < E:
                            c = _token_count(sMask, e, E, MW)
                            sStart[e] = pos
                            if c > 0:
                                mGroupExpert[u] = e
                                mGroupStart[u] = pos
                                u = u + 1
                            pos = pos + c
                    if lane == WARP - 1:
                        mNGroups[0] = u
                        mGroupStart[u] = i32(TK)
                cute.arch.sync_threads()
                # each slot's sorted position: its expert's start plus the earlier tokens of it
                for p in cutlass.range(tidx, TK, self.threads, unroll=1):
                    e = sIds[p]
                    t = p // K
                    rank = i32(0)
                    for w in cutlass.range_constexpr(MW):
                        m = sMask[w * E + e]
                        if t >= (w + 1) * WARP:
                            rank = rank + cute.arch.popc(m)
                        elif t > w * WARP:
                            rank = rank + cute.arch.popc(m & ((i32(1) << (t - w * WARP)) - 1))
                    mSorted[sStart[e] + rank] = p

        else:
            # --- down CTAs: z = h @ W_down.T for 16 rows --------------------------------------
            RD = self.down_rows_per_cta
            d0 = (bidx - self.ctas) * RD
            gWd = vector_view(mWd)
            accd = new_accumulators(self.down_plan)
            accumulate(self.down_plan, accd, [(gWd, d0 + nt * ROWS_PER_TILE) for nt in range(self.down_row_tiles)],
                       vector_view(mH), x_row_slots(self.batch_tiles, T, g, lambda i: i), warp, g, q)
            store_partials(self.down_plan, sP, accd, warp, g, q, T)
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(ceil_div(RD * T, self.threads)):
                idx = tidx + j * self.threads
                if idx < RD * T:
                    b = idx // RD
                    r = idx % RD
                    mZ[b, d0 + r] = sum_partials(sP, r, b, W).to(cutlass.BFloat16)
