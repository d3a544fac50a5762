"""The MoE router, and its selection alone (`router_select`).

`router` (RouterOp), one launch at the decode batches where the block runs it (1 and 2): fp32
logits = h @ W_g.T (bf16 in), sigmoid, the top-k of s + bias (selection only; ties to the lower
expert), weights renormalised over the unbiased scores, the routing grouped by expert for the
expert kernels (kernels/ops/moe_experts.py), and, in the same launch, the latent
down-projection z = h @ W_down.T (bf16 out). Both projections read h, and the down CTAs keep
the SMs streaming while phase 2 selects and groups, so phase 2 costs nothing when it ends
before the streaming.

The grid is one stream of short CTAs (kernels/ops/parts/stream.py): work item 0 is the selector, items
1 .. ctas own whole rows of W_g (`stream_cta_kib` KiB of weights, at least one row; at k3 two
rows of 128 threads each), the rest whole rows of W_down. The router rows come first so that
they are dispatched first. A streaming item
  * loads its weight vectors into registers by plain 16-byte loads, all issued before
    `griddepcontrol.wait` (`pdl` 1: the launch overlaps the previous one's tail while the static
    weights are fetched; read-only loads would be sunk below the wait by ptxas), then copies h
    into shared memory (`cp.async`) after it, one wait, fp32 FMAs, and stream.py's warp-order
    reduction (deterministic);
  * stores its outputs; a router thread also stores its logit, bits inverted, as a tagged word
    of the counter buffer (one word per token and expert, relaxed gpu-scope store, 0 = not in
    yet; the one NaN whose inverse is 0 goes in as another NaN). The word is its own flag: no
    barrier, fence or atomic follows, and the CTA leaves once its stores are issued.
The selector copies the bias before the wait, then polls its words (relaxed gpu-scope loads, a
round's loads all issued before one test, `poll_sleep` us of nanosleep before each round: back
to back, the polls cost the launch part of its overlap with the next one) until none is 0,
decodes them into shared memory and resets each word it polled (only the poller may reset a
word: one reset before its poll would never be written again). The next launch's router CTAs
store only after their own `griddepcontrol.wait`, after this grid completed. The static audit
knows this protocol: the counter's spec says "tagged" (validation/race/rules.py).
The default's 64 registers hold four CTAs per SM; with five the deeper memory queues put
phase 2 past the end of the streaming (tests/test_router.py pins the register count).

Phase 2, the selection (the whole selector CTA per token, `RouterOp._topk_thresh`): each warp
finds its first ceil(top_k / warps) experts by redux.sync; the last of the warps' last firsts
bounds the candidates, and each candidate is ranked by a count. One warp's top_k serial rounds
were longer than the streaming they must hide behind.

`router_select` (RouterSelectOp), at the batches where the block computes the logits by a
foundation GEMM (kernels/block.py GEMV_ROUTER): the same phase 2 from fp32 logits, a warp per
token (`_Routing._topk_one`: top_k butterfly argmax rounds over (score, index)) on
batch / warps_per_cta CTAs; then a gpu-scope acq_rel counter, and the last CTA groups.

The grouping by expert (`_Routing._group`), a deterministic counting sort: each chosen expert
gets its tokens' bits in a shared token mask; warp 0 scans the experts' token counts
(population counts) and group flags, so expert e's slots start at start[e] and its group index
is the number of lower experts chosen; slot p = t * top_k + j of expert e goes to sorted
position start[e] + #tokens below t that chose e. Outputs: n_groups, group_expert[u]
(ascending), group_start[u] (the entry at n_groups is T * top_k), sorted_slots[pos] = p;
entries past n_groups are left as they were. O(T * top_k + n_experts) work.

Both ops are written as tile functions (`tile(item, tidx, smem, ...)`): the device work of one
work item, given the thread's index and shared-memory tensors the caller allocated
(`allocate_smem`); the @cute.kernel is the thin wrapper item = blockIdx.x.
"""

from __future__ import annotations

from kernels import reference
from kernels.ops.parts import stream
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec, op_tunables
from kernels.ops.parts.common import BF16_PER_VECTOR, WARP, ceil_div, cute, cutlass
from kernels.ops.parts.decode_mma import sigmoid
from kernels.ops.parts.stream import StreamPlan

MAX_BATCH = 64  # router_select (a bit per token in 32-bit mask words, up to two)
ROUTER_MAX_BATCH = 4  # the router's one-selector-CTA design: past it, the block routes by gemv
WEIGHT_EPS = 1e-20  # kernels.reference.router
TOPK_CHAINS = 4  # independent compare chains per lane in each top-k round (instruction-level parallelism)
INT32_MIN = -(1 << 31)  # the key of a retired (or absent) expert

# A tagged logit word is the logit's bits inverted (0: not in yet); the NaN whose inverse would
# be 0 (0xffffffff) goes in as this word, the inverse of the NaN 0xffc00000
TAG_NAN_WORD = 0x003FFFFF

SMEM_RESERVED_PER_CTA = 1024  # sm_90 reserves 1 KB of shared memory per CTA
SM90_SMEM_PER_SM = 228 * 1024  # the largest shared-memory carveout of an H100/H200 SM


def _nanosleep(ns: int) -> None:
    """Trace-time: `nanosleep.u32 ns` (the warp sleeps about that long, at most 1 ms; sm_70+)."""
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [], f"nanosleep.u32 {int(ns)};", "", has_side_effects=True)


def _load_row_regs(P, gW, row, kv0):
    """This thread's weight vectors of `row` into registers by plain 16-byte loads (weak,
    default caching), all issued here (an empty volatile asm ties each to this point: the
    compiler would otherwise sink each load to its first use). Plain loads, not the read-only
    path, although the weights are static: ptxas moves read-only (`ld.global.nc`) loads below
    `griddepcontrol.wait`, so no weight would be fetched while the previous launch drains;
    plain loads stay ahead of it (tests/test_router.py pins the SASS)."""
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    bf16 = cutlass.BFloat16
    flat = cute.make_layout((BF16_PER_VECTOR,))
    atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), bf16, num_bits_per_copy=128,
                               load_cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS)
    wv = []
    for j in range(P.vectors):
        t = cute.make_rmem_tensor(flat, bf16)
        src = gW[(None, (row, kv0 + j * P.row_threads))]
        cute.copy(atom, cute.make_tensor(src.iterator, flat), t)
        wv.append(t)
    u32 = cutlass.Uint32
    for t in wv:
        words = cute.recast_tensor(t, u32)
        n = cute.size(words)
        res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * n), [words[i].ir_value() for i in range(n)],
                              "", ",".join(["=r"] * n + [str(i) for i in range(n)]), has_side_effects=True)
        for i in range(n):
            words[i] = u32(llvm.extractvalue(T.i32(), res, [i]))
    return wv


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


class _Routing(OpBase):
    """What both routing ops share: the selection's sizes, and phase 2's device pieces (the
    staging of fp32 vectors, the last-CTA arrival, a warp's top-k, the weights, the grouping)."""

    kernel_name = "routing"

    def _routing_shape(self, shape: dict, max_batch: int) -> None:
        """The selection's sizes from `shape` (batch, n_experts, top_k, optional scale), checked;
        a ValueError names what is missing or out of range."""
        name = self.kernel_name
        try:
            self.batch = int(shape["batch"])
            self.n_experts = int(shape["n_experts"])
            self.top_k = int(shape["top_k"])
        except KeyError as e:
            raise ValueError(f"{name}: shape needs batch, n_experts and top_k; missing {e}") from None
        self.scale = float(shape.get("scale", 1.0))
        if not 1 <= self.batch <= max_batch:
            raise ValueError(f"{name}: batch {self.batch} outside 1..{max_batch}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"{name}: top_k {self.top_k} outside 1..n_experts ({self.n_experts})")
        self.slots = self.batch * self.top_k
        self.groups = min(self.slots, self.n_experts)
        self.per_lane = ceil_div(self.n_experts, WARP)
        self.mask_words = ceil_div(self.batch, WARP)  # per expert: a bit per token

    def _routing_specs(self) -> dict[str, TensorSpec]:
        T, K = self.batch, self.top_k
        return {
            "ids": TensorSpec((T, K), "int32"),
            "weights": TensorSpec((T, K), "float32"),
            "n_groups": TensorSpec((1,), "int32"),
            "group_expert": TensorSpec((self.groups,), "int32"),
            "group_start": TensorSpec((self.groups + 1,), "int32"),
            "sorted_slots": TensorSpec((self.slots,), "int32"),
        }

    @cute.jit
    def _stage_f32(self, srcs, tidx, wait: bool = True):
        """Trace-time: for each (global pointer, shared pointer, n, bound) of `srcs`, the first
        `bound` (None: all n; else a run-time count up to n) of the n 16-byte fp32 vectors from
        global into shared memory by L2-only cp.async, every copy issued before one wait (plain
        loads were sunk to their first use by ptxas: one serial L2 round trip per 32 experts);
        then a CTA barrier. With `wait` False the copies are only issued and committed: the
        caller waits."""
        atom = stream.weight_copy_atom(cutlass.Float32)
        flat = cute.make_layout((4,))
        for g_ptr, s_ptr, n, bound in srcs:
            gv = cute.zipped_divide(cute.make_tensor(g_ptr, cute.make_layout(n * 4)), (4,))
            sv = cute.zipped_divide(cute.make_tensor(s_ptr, cute.make_layout(n * 4)), (4,))
            for j in cutlass.range_constexpr(ceil_div(n, self.threads)):
                v = tidx + j * self.threads
                if v < (n if bound is None else bound):
                    cute.copy(atom, cute.make_tensor(gv[(None, v)].iterator, flat), sv[(None, v)])
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(wait):
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

    @cute.jit
    def _arrive(self, mCounter, sLast, tidx):
        """Trace-time: after this CTA's stores (a CTA barrier first), thread 0 adds 1 to the
        counter (gpu scope, acq_rel); the last of the `ctas` CTAs resets it (release; the host
        zeroes it once) and sLast[0] says, after a second barrier, whether this CTA is the last."""
        i32 = cutlass.Int32
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

    @cute.jit
    def _topk_one(self, lg, bias, lt, t, mIds, mWeights, sIds, sSel, sMask, lane):
        """Trace-time, one warp: token t's top-k of sigmoid(lg[lt]) + bias (ties to the lower
        expert), its ids and renormalised weights stored; its selections at sIds / sSel from
        lt * top_k; with `sMask` (not None) t's bit set in each chosen expert's token mask.
        Each lane holds n_experts / 32 biased scores; top_k rounds of a butterfly argmax over
        (score, index): the greater score wins, equal scores go to the lower expert (the
        reference's stable descending sort); the winner's lane retires it."""
        E = self.n_experts
        K = self.top_k
        V = self.per_lane
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        neg_inf = f32(float("-inf"))
        vals = cute.make_rmem_tensor(cute.make_layout(V), f32)
        for i in cutlass.range_constexpr(V):
            if cutlass.const_expr((i + 1) * WARP <= E):  # no guard (nor branch) where all lanes hold one
                vals[i] = sigmoid(lg[lt, lane + i * WARP]) + bias[lane + i * WARP]
            else:
                vals[i] = neg_inf
                if lane + i * WARP < E:
                    vals[i] = sigmoid(lg[lt, lane + i * WARP]) + bias[lane + i * WARP]
        # selection j is kept by lane j % 32 (register j // 32) and written after the rounds,
        # so no round waits on a store or a branch
        mine = [i32(E)] * ceil_div(K, WARP)
        for j in cutlass.range_constexpr(K):
            # This lane's best (greatest score, then lowest index) as TOPK_CHAINS independent
            # chains over its values (value i in chain i % TOPK_CHAINS, ascending index: strict
            # > keeps the lowest), merged after: one long dependent chain per round would make
            # the rounds serial in the compare latency.
            nch = min(TOPK_CHAINS, V)
            cv = [neg_inf] * nch
            ci = [i32(E)] * nch
            for i in cutlass.range_constexpr(V):
                c = i % nch
                take = vals[i] > cv[c]
                cv[c] = cutlass.select_(take, vals[i], cv[c])
                ci[c] = cutlass.select_(take, lane + i * WARP, ci[c])
            bv = cv[0]
            bi = ci[0]
            for c in cutlass.range_constexpr(1, nch):
                take = cutlass.or_(cv[c] > bv, cutlass.and_(cv[c] == bv, ci[c] < bi))
                bv = cutlass.select_(take, cv[c], bv)
                bi = cutlass.select_(take, ci[c], bi)
            for sh in cutlass.range_constexpr(5):
                ov = cute.arch.shuffle_sync_bfly(bv, offset=16 >> sh)
                oi = cute.arch.shuffle_sync_bfly(bi, offset=16 >> sh)
                if cutlass.or_(ov > bv, cutlass.and_(ov == bv, oi < bi)):
                    bv = ov
                    bi = oi
            for i in cutlass.range_constexpr(V):
                if lane + i * WARP == bi:
                    vals[i] = neg_inf
            mine[j // WARP] = cutlass.select_(lane == j % WARP, bi, mine[j // WARP])
        for q in cutlass.range_constexpr(len(mine)):
            if q * WARP + lane < K:
                mIds[t, q * WARP + lane] = mine[q]
                sIds[lt * K + q * WARP + lane] = mine[q]
                if cutlass.const_expr(sMask is not None):
                    # token t's bit in the chosen expert's token mask (a token's experts are distinct)
                    cute.arch.atomic_or(sMask.iterator + (t // WARP) * E + mine[q], i32(1) << (t % WARP))
        # The selected unbiased scores again (same input, same function: bitwise the
        # ones ranked), one lane per selection so the loads overlap, rather than
        # carrying every lane's scores in registers through the rounds.
        cute.arch.sync_warp()
        for j0 in cutlass.range_constexpr(0, K, WARP):
            if j0 + lane < K:
                sSel[lt * K + j0 + lane] = sigmoid(lg[lt, sIds[lt * K + j0 + lane]])
        cute.arch.sync_warp()
        if lane == 0:
            total = sSel[lt * K]
            for j in cutlass.range_constexpr(1, K):
                total = total + sSel[lt * K + j]
            total = total + f32(WEIGHT_EPS)
            for j in cutlass.range_constexpr(K):
                mWeights[t, j] = sSel[lt * K + j] / total * f32(self.scale)

    @cute.jit
    def _group(self, outs, sMask, sStart, sIds, tidx):
        """Trace-time, after a CTA barrier that follows every token's mask bits and sIds: the
        grouping by expert (module docstring), a counting sort over the token masks."""
        mNGroups, mGroupExpert, mGroupStart, mSorted = outs[3:]
        E = self.n_experts
        K = self.top_k
        NTH = self.threads
        TK = self.slots
        MW = self.mask_words
        CH = self.per_lane
        i32 = cutlass.Int32
        warp = tidx // WARP
        lane = tidx % WARP
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
        for p in cutlass.range(tidx, TK, NTH, unroll=1):
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


class RouterOp(_Routing):
    """One variant of the router (module docstring): shape {"batch", "n_experts", "hidden",
    "top_k", "latent"} plus tunables (the manifest's defaults where not given); `scale` (routed_scale) is
    baked in (default 1.0)."""

    kernel_name = "router"
    TUNABLES = ("stream_threads", "stream_cta_kib", "pdl", "poll_sleep")

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **op_tunables(self.kernel_name, self.TUNABLES, tunables))
        try:
            self.latent = int(shape["latent"])
            self.hidden = int(shape["hidden"])
        except KeyError as e:
            raise ValueError(f"router: shape needs batch, n_experts, hidden, top_k and latent; missing {e}") from None
        self._routing_shape(shape, ROUTER_MAX_BATCH)
        self.pdl = int(self.tunables["pdl"])
        if self.pdl not in (0, 1):
            raise ValueError("router: pdl must be one of 0..1")
        self.poll_sleep = int(self.tunables["poll_sleep"])
        if not 0 <= self.poll_sleep <= 1000:  # nanosleep sleeps at most 1 ms
            raise ValueError("router: poll_sleep must be 0..1000 (microseconds)")
        self._plan()
        # the counter buffer: the tagged logits, one word per token and expert (16-byte padded)
        self.counter_words = ceil_div(self.batch * self.n_experts, 4) * 4

    def _thresh_words(self) -> tuple:
        """(name, int32 words) of the threshold selection's shared scratch: control words, the
        warps' m-th bests, every candidate."""
        return (("ctl", 4), ("wb_key", self.warps), ("wb_id", self.warps), ("cand_key", self.n_experts),
                ("cand_id", self.n_experts))

    def _plan(self) -> None:
        """The router's rows and W_down's as one grid of short whole-row CTAs of the same thread
        count (kernels/ops/parts/stream.py), after the selector; shared memory holds h, or, in the
        selector, phase 2's arrays (`phase2_offsets`, int32 words)."""
        t = self.tunables
        threads, cta_bytes = int(t["stream_threads"]), int(t["stream_cta_kib"]) * 1024
        self.plan = StreamPlan(n=self.n_experts, k=self.hidden, threads=threads, cta_bytes=cta_bytes)
        self.down_plan = StreamPlan(n=self.latent, k=self.hidden, threads=threads, cta_bytes=cta_bytes)
        if self.plan.threads != self.down_plan.threads:
            raise ValueError(f"router: the stream plans of W_g ({self.plan.threads} threads) and W_down "
                             f"({self.down_plan.threads}) need the same CTA size; change stream_cta_kib")
        self.threads = self.plan.threads
        self.warps = self.plan.warps
        self.rows_per_cta = self.plan.rows
        self.down_rows_per_cta = self.down_plan.rows
        self.ctas = self.plan.ctas
        self.down_ctas = self.down_plan.ctas
        B, k = self.batch, self.hidden
        self.phase2_offsets = {}
        off = 0
        if self.n_experts % 4:
            raise ValueError(f"router: n_experts {self.n_experts} is not a multiple of 4 (16-byte logit copies)")
        for name, words in (("logits", B * self.n_experts), ("bias", self.n_experts),
                            ("mask", self.mask_words * self.n_experts), ("start", self.n_experts),
                            ("ids", self.slots), ("sel", self.slots)) + self._thresh_words():
            self.phase2_offsets[name] = off
            off += ceil_div(words, 4) * 4  # 16-byte aligned int32 / fp32 arrays
        # bf16 elements of the union: h's rows, or phase 2's arrays
        self.union_elems = max(B * k, 2 * off)
        # the union, the warps' partial sums, and 80 bytes of alignment slack
        self.smem_bytes = self.union_elems * 2 + ceil_div(B * self.warps, 4) * 16 + 16 + 64

    # -- contract ---------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, E, H = self.batch, self.n_experts, self.hidden
        return {
            "h": TensorSpec((T, H), "bfloat16"),
            "w_gate": TensorSpec((E, H), "bfloat16"),
            "bias": TensorSpec((E,), "float32"),
            "logits": TensorSpec((T, E), "float32"),
            **self._routing_specs(),
            "counter": TensorSpec((self.counter_words,), "int32", protocol="tagged"),
            "w_down": TensorSpec((self.latent, H), "bfloat16"),
            "z": TensorSpec((T, self.latent), "bfloat16"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(1 + self.ctas + self.down_ctas, 1, 1), block=(self.threads, 1, 1),
                            smem_bytes=self.smem_bytes, pdl=bool(self.pdl))

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
        tidx, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        smem = self.allocate_smem(cutlass.memory.SmemAllocator())
        self.tile(item, tidx, smem, mH, mW, mBias, (mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted),
                  mCounter, mWd, mZ)

    def allocate_smem(self, smem) -> dict:
        """Trace-time: one work item's shared memory from the allocator `smem` (`smem_bytes` in
        all): "union" (bf16: h's rows, or the selector's phase-2 arrays) and "partials" (fp32
        [batch, warps])."""
        sU = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((self.union_elems,)), byte_alignment=16)
        sP = smem.allocate_tensor(cutlass.Float32, cute.make_layout((self.batch, self.warps)), byte_alignment=16)
        return {"union": sU, "partials": sP}

    @cute.jit
    def tile(self, item, tidx, smem, mH, mW, mBias, outs, mCounter, mWd, mZ):
        """Trace-time: work item `item` of the launch (0 the selector, 1 .. ctas router rows,
        then W_down's rows), run by `threads` threads (`tidx` this one's index), over the
        shared memory `smem` (`allocate_smem`); `outs` = (logits, ids, weights, n_groups,
        group_expert, group_start, sorted_slots)."""
        sU, sP = smem["union"], smem["partials"]
        vU = cute.zipped_divide(sU, (BF16_PER_VECTOR,))  # ((8), vectors)
        if item == 0:
            self._phase2_tagged(mCounter, sU, outs, mBias, tidx)
        else:
            c = item - 1
            if c < self.ctas:
                self._stream_rows(self.plan, mW, mH, outs[0], c, vU, sP, tidx, tag=mCounter)
            else:
                self._stream_rows(self.down_plan, mWd, mH, mZ, c - self.ctas, vU, sP, tidx)

    def _phase2_views(self, sU) -> dict:
        """Trace-time: phase 2's shared arrays over the union sU (`phase2_offsets`): logits
        [B, E] and bias (fp32), the token masks, starts, ids and selections, `words` (the logits
        as int32 words), `thresh` (the threshold selection's scratch)."""
        B, E = self.batch, self.n_experts
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        base = cute.recast_ptr(sU.iterator, dtype=i32)
        o = self.phase2_offsets
        W = self.warps
        return {"logits": cute.make_tensor(cute.recast_ptr(base + o["logits"], dtype=f32),
                                           cute.make_layout((B, E), stride=(E, 1))),
                "words": cute.make_tensor(base + o["logits"], cute.make_layout(B * E)),
                "bias": cute.make_tensor(cute.recast_ptr(base + o["bias"], dtype=f32), cute.make_layout(E)),
                "mask": cute.make_tensor(base + o["mask"], cute.make_layout(self.mask_words * E)),
                "start": cute.make_tensor(base + o["start"], cute.make_layout(E)),
                "ids": cute.make_tensor(base + o["ids"], cute.make_layout(self.slots)),
                "sel": cute.make_tensor(cute.recast_ptr(base + o["sel"], dtype=f32), cute.make_layout(self.slots)),
                "thresh": {"ctl": cute.make_tensor(base + o["ctl"], cute.make_layout(4)),
                           "wb_key": cute.make_tensor(base + o["wb_key"], cute.make_layout(W)),
                           "wb_id": cute.make_tensor(base + o["wb_id"], cute.make_layout(W)),
                           "cand_key": cute.make_tensor(base + o["cand_key"], cute.make_layout(E)),
                           "cand_id": cute.make_tensor(base + o["cand_id"], cute.make_layout(E))}}

    @cute.jit
    def _stream_rows(self, P, mW, mX, mY, blk, vU, sP, tidx, tag=None):
        """Trace-time: CTA `blk` of plan `P` computes its rows of y = x @ W.T (stream.py): its
        weight vectors into registers, then (after the pdl wait) x's rows into vU from vector 0,
        one wait, fp32 dots, stored in y's dtype in fixed order; with `tag` (the router rows)
        each value also as a tagged word."""
        B = self.batch
        r = tidx // P.row_threads
        kv0 = tidx % P.row_threads
        gW = cute.zipped_divide(mW, (1, BF16_PER_VECTOR))
        wv = _load_row_regs(P, gW, blk * P.rows + r, kv0)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # only static weights are read before it
        if r == 0:  # row 0's threads copy x for every row of the CTA
            gX = cute.zipped_divide(mX, (1, BF16_PER_VECTOR))
            for b in cutlass.range_constexpr(B):
                stream.copy_row(P, stream.activation_copy_atom(cutlass.BFloat16), gX, b, vU, b * P.kv, kv0)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # x was copied by row 0's threads

        acc = stream.dot(P, None, None, vU, [b * P.kv for b in range(B)], kv0, w_regs=wv)
        stream.publish_partials(acc, sP, tidx // WARP, tidx % WARP)
        cute.arch.sync_threads()
        if tidx < P.rows * B:  # one thread per (row, token), indices computed: no switch over them
            rr = tidx // B
            bb = tidx % B
            total = stream.row_total(P, sP, rr, bb)
            mY[bb, blk * P.rows + rr] = total.to(mY.element_type)
            if cutlass.const_expr(tag is not None):
                self._publish_tagged(tag, bb * self.n_experts + blk * P.rows + rr, total)

    @cute.jit
    def _publish_tagged(self, mCounter, i, value):
        """Trace-time, a router thread: logit `value` into tagged word i of the counter buffer
        as its bits inverted (never 0: the one float whose inverse is 0, the NaN 0xffffffff,
        goes in as another NaN), by a relaxed gpu-scope store, single-copy atomic: the word is
        its own flag, nothing else is ordered by it, so no fence, barrier or atomic follows and
        the CTA does not wait for the store to land."""
        i32 = cutlass.Int32
        v = cute.make_rmem_tensor(cute.make_layout(1), cutlass.Float32)
        v[0] = value
        w = cute.recast_tensor(v, i32)[0] ^ i32(-1)
        w = cutlass.select_(w == i32(0), i32(TAG_NAN_WORD), w)
        cute.arch.store(mCounter.iterator + i, w, sem="relaxed", scope="gpu")

    @cute.jit
    def _phase2_tagged(self, mCounter, sU, outs, mBias, tidx):
        """Trace-time, the selector: phase 2 once every tagged logit is in. The bias (static)
        is copied before `griddepcontrol.wait`; after it every thread polls its words of the
        tagged logits (relaxed gpu-scope loads, all of a round issued before any is tested,
        `poll_sleep` us of sleep before each round) until none is 0, decodes them into shared
        memory and resets them to 0 for the next launch. Then the selection and the grouping."""
        B, E, NTH = self.batch, self.n_experts, self.threads
        i32 = cutlass.Int32
        v = self._phase2_views(sU)
        sBias, sW = v["bias"], v["words"]
        self._stage_f32(((mBias.iterator, sBias.iterator, E // 4, None),), tidx, wait=False)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
        tag = mCounter.iterator
        n = B * E
        J = ceil_div(n, NTH)
        missing = i32(1)
        sleep = self.poll_sleep
        while missing != i32(0):
            if cutlass.const_expr(sleep > 0):  # the warp sleeps before each round (the first too)
                _nanosleep(sleep * 1000)
            missing = i32(0)
            for j in cutlass.range_constexpr(J):
                i = tidx + j * NTH
                if cutlass.const_expr((j + 1) * NTH <= n):
                    w = cute.arch.load(tag + i, i32, sem="relaxed", scope="gpu")
                    sW[i] = w ^ i32(-1)
                    missing = missing | cutlass.select_(w == i32(0), i32(1), i32(0))
                else:
                    if i < n:
                        w = cute.arch.load(tag + i, i32, sem="relaxed", scope="gpu")
                        sW[i] = w ^ i32(-1)
                        missing = missing | cutlass.select_(w == i32(0), i32(1), i32(0))
        for j in cutlass.range_constexpr(J):
            i = tidx + j * NTH
            if cutlass.const_expr((j + 1) * NTH <= n):
                cute.arch.store(tag + i, i32(0), sem="relaxed", scope="gpu")
            else:
                if i < n:
                    cute.arch.store(tag + i, i32(0), sem="relaxed", scope="gpu")
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        self._select_and_group(v["logits"], sBias, outs, v["mask"], v["start"], v["ids"], v["sel"], tidx,
                               v["thresh"])

    @cute.jit
    def _select_and_group(self, lg, bias, outs, sMask, sStart, sIds, sSel, tidx, sc):
        """Trace-time phase 2 in the selector: the top-k of every token (`_topk_thresh`), the
        weights, then the grouping by expert. `lg` [T, E] and `bias` [E] are in shared memory."""
        mIds, mWeights = outs[1], outs[2]
        T = self.batch
        E = self.n_experts
        NTH = self.threads
        MW = self.mask_words
        i32 = cutlass.Int32

        for i in cutlass.range(tidx, MW * E, NTH, unroll=1):
            sMask[i] = i32(0)
        cute.arch.sync_threads()
        for t in cutlass.range(0, T, unroll=1):
            self._topk_thresh(lg, bias, t, mIds, mWeights, sIds, sSel, sMask, sc, tidx)
        cute.arch.sync_threads()
        self._group(outs, sMask, sStart, sIds, tidx)

    @cute.jit
    def _score_keys(self, lg, bias, t, tidx):
        """Trace-time: this thread's experts tidx, tidx + threads, ... scored s = sigmoid(logit)
        + bias (-0 made +0; absent experts 0) as order-preserving int32 keys in a register
        tensor (negative scores' bits ^ 0x7fffffff): the keys' signed order is the scores' order."""
        E = self.n_experts
        NTH = self.threads
        J = ceil_div(E, NTH)
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        vals = cute.make_rmem_tensor(cute.make_layout(J), f32)
        keys = cute.recast_tensor(vals, i32)
        for j in cutlass.range_constexpr(J):
            e = tidx + j * NTH
            if cutlass.const_expr((j + 1) * NTH <= E):
                vals[j] = sigmoid(lg[t, e]) + bias[e]
            else:
                vals[j] = f32(0.0)
                if e < E:
                    vals[j] = sigmoid(lg[t, e]) + bias[e]
            vals[j] = cutlass.select_(vals[j] == f32(0.0), f32(0.0), vals[j])
            keys[j] = keys[j] ^ cutlass.select_(keys[j] < i32(0), i32(0x7FFFFFFF), i32(0))
        return keys

    @cute.jit
    def _topk_thresh(self, lg, bias, t, mIds, mWeights, sIds, sSel, sMask, sc, tidx):
        """Trace-time, the whole CTA (after a CTA barrier; ends with one): token t's top-k (the
        same selection, ids order and weights as `_topk_one`) by a threshold and ranks.

        Order: expert a precedes b when its key is greater, or equal with a lower index. Keys are
        signed int32 and every comparison is signed (a uint32 key loaded back from shared
        memory compared as signed in the generated code, which misordered scores of opposite
        signs). Each warp finds its m first experts in that order (m = ceil(top_k / warps); per
        round two redux.sync, the greatest key, then the lowest index holding it; the winner's
        lane retires it). The warps' m-th experts and everything before them are warps * m >=
        top_k distinct experts, so the last of the m-th experts, P, precedes or is the top_k-th
        expert: every expert of the top k is P or precedes it. Those candidates (P and every
        expert before it) claim slots by a shared atomic counter, and each candidate's rank is
        the number of candidates before it; ranks below top_k are the selection. The candidates
        number at least top_k and at most every expert, typically a few dozen (the ranking loop
        is linear in them)."""
        E = self.n_experts
        K = self.top_k
        NTH = self.threads
        W = self.warps
        J = ceil_div(E, NTH)
        M = ceil_div(K, W)
        i32 = cutlass.Int32
        u32 = cutlass.Uint32
        warp = tidx // WARP
        lane = tidx % WARP
        ctl, wb_key, wb_id, cand_key, cand_id = sc["ctl"], sc["wb_key"], sc["wb_id"], sc["cand_key"], sc["cand_id"]
        if tidx == 0:
            ctl[3] = i32(0)  # candidate slots claimed
        keys = self._score_keys(lg, bias, t, tidx)
        # this warp's M first experts: per round the lane's first unretired expert (its values are
        # experts tidx + j * NTH, ascending), the warp's greatest key, the lowest index holding it
        retired = u32(0)  # bit j: value j retired
        wk = i32(INT32_MIN)
        wi = i32(0)
        for _ in cutlass.range_constexpr(M):
            bk = i32(INT32_MIN)
            bi = i32(E)
            for j in cutlass.range_constexpr(J):
                e = tidx + j * NTH
                live = ((retired >> u32(j)) & u32(1)) == u32(0)
                if cutlass.const_expr((j + 1) * NTH > E):
                    live = cutlass.and_(live, e < E)
                better = cutlass.and_(live, cutlass.or_(keys[j] > bk, bi == i32(E)))
                bk = cutlass.select_(better, keys[j], bk)
                bi = cutlass.select_(better, e, bi)
            wk = i32(cute.arch.warp_redux_sync(bk, "max"))
            wi = i32(cute.arch.warp_redux_sync(cutlass.select_(cutlass.and_(bk == wk, bi < i32(E)), bi, i32(E)),
                                               "min"))
            for j in cutlass.range_constexpr(J):
                if tidx + j * NTH == wi:
                    retired = retired | (u32(1) << u32(j))
        if lane == 0:
            wb_key[warp] = wk
            wb_id[warp] = wi
        cute.arch.sync_threads()
        # P: the last, in the order, of the warps' M-th experts
        pk = wb_key[0]
        pi = wb_id[0]
        for w in cutlass.range_constexpr(1, W):
            k2 = wb_key[w]
            i2 = wb_id[w]
            later = cutlass.or_(k2 < pk, cutlass.and_(k2 == pk, i2 > pi))
            pk = cutlass.select_(later, k2, pk)
            pi = cutlass.select_(later, i2, pi)
        for j in cutlass.range_constexpr(J):
            e = tidx + j * NTH
            take = cutlass.or_(keys[j] > pk, cutlass.and_(keys[j] == pk, e <= pi))
            if cutlass.const_expr((j + 1) * NTH > E):
                take = cutlass.and_(take, e < E)
            if take:
                slot = cute.arch.atomic_add(ctl.iterator + 3, i32(1))
                cand_key[slot] = keys[j]
                cand_id[slot] = e
        cute.arch.sync_threads()
        n = ctl[3]
        for p in cutlass.range(tidx, n, NTH, unroll=1):
            kp = cand_key[p]
            ip = cand_id[p]
            rank = i32(0)
            for q in cutlass.range(0, n, unroll=4):
                kq = cand_key[q]
                rank = rank + cutlass.select_(cutlass.or_(kq > kp, cutlass.and_(kq == kp, cand_id[q] < ip)),
                                              i32(1), i32(0))
            if rank < K:
                self._place_ranked(lg, t, rank, ip, mIds, sIds, sSel, sMask)
        cute.arch.sync_threads()
        self._weights_cta(t, mWeights, sSel, tidx)

    def _place_ranked(self, lg, t, rank, ip, mIds, sIds, sSel, sMask):
        """Trace-time: expert ip as token t's selection `rank`: its id (global and shared), its
        unbiased score (sigmoid of its logit) and t's bit in its token mask (a shared atomic OR)."""
        K, E = self.top_k, self.n_experts
        i32 = cutlass.Int32
        mIds[t, rank] = ip
        sIds[t * K + rank] = ip
        sSel[t * K + rank] = sigmoid(lg[t, ip])
        cute.arch.atomic_or(sMask.iterator + (t // WARP) * E + ip, i32(1) << (t % WARP))

    @cute.jit
    def _weights_cta(self, t, mWeights, sSel, tidx):
        """Trace-time, the whole CTA (after a CTA barrier that follows sSel; ends with one):
        token t's weights, each selection's unbiased score over their sum (in selection order)
        + 1e-20, times the scale, one thread per selection."""
        K = self.top_k
        f32 = cutlass.Float32
        for p in cutlass.range(tidx, K, self.threads, unroll=1):
            total = sSel[t * K]
            for j in cutlass.range_constexpr(1, K):
                total = total + sSel[t * K + j]
            total = total + f32(WEIGHT_EPS)
            mWeights[t, p] = sSel[t * K + p] / total * f32(self.scale)
        cute.arch.sync_threads()


class RouterSelectOp(_Routing):
    """router_select (module docstring): the router's phase 2 alone, from fp32 logits another
    launch computed, with the router's rules and tie-breaking (kernels.reference.route_logits).
    Shape {"batch", "n_experts", "top_k"} plus tunables (the manifest's defaults where not given).

    One warp per token and `warps_per_cta` tokens per CTA, so the top-k runs on
    batch / warps_per_cta SMs at once. Each work item copies its tokens' logits and the bias
    into shared memory (`_stage_f32`, one wait), selects (`_topk_one`), stores ids and weights,
    and arrives on the counter (`_arrive`); the last reads every token's ids back (plain loads
    after the acquire and a CTA barrier), sets the token masks and groups (`_group`)."""

    kernel_name = "router_select"
    TUNABLES = ("warps_per_cta",)

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **op_tunables(self.kernel_name, self.TUNABLES, tunables))
        self._routing_shape(shape, MAX_BATCH)
        if self.n_experts % 4:
            raise ValueError(f"router_select: n_experts {self.n_experts} is not a multiple of 4 (16-byte copies)")
        self.warps = int(self.tunables["warps_per_cta"])
        if self.warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"router_select: warps_per_cta {self.warps} is not a power of two up to 32")
        self.threads = self.warps * WARP
        self.tokens_per_cta = self.warps
        self.ctas = ceil_div(self.batch, self.tokens_per_cta)

        def words(n):  # 16-byte aligned int32 / fp32 arrays
            return ceil_div(n, 4) * 4

        E = self.n_experts
        self.smem_words = {"logits": words(self.tokens_per_cta * E), "bias": words(E), "ids": words(self.slots),
                           "sel": words(self.tokens_per_cta * self.top_k), "mask": words(self.mask_words * E),
                           "start": words(E), "last": 4}
        self.smem_bytes = 4 * sum(self.smem_words.values()) + 64

    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, E = self.batch, self.n_experts
        return {
            "logits": TensorSpec((T, E), "float32"),
            "bias": TensorSpec((E,), "float32"),
            **self._routing_specs(),
            "counter": TensorSpec((1,), "int32"),
        }

    def launch_config(self) -> LaunchConfig:
        return LaunchConfig(grid=(self.ctas, 1, 1), block=(self.threads, 1, 1), smem_bytes=self.smem_bytes)

    def reference(self, *, logits, bias, compute_dtype=None, **_outputs):
        """Expected ids/weights (kernels.reference.route_logits) and the grouping of those ids."""
        kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        r = reference.route_logits(logits, bias, self.top_k, scale=self.scale, **kwargs)
        return {"ids": r.ids, "weights": r.weights, **routing_groups_ref(r.ids, self.n_experts)}

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor,
                 mNGroups: cute.Tensor, mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor, mSorted: cute.Tensor,
                 mCounter: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mLogits, mBias, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted,
                    mCounter).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor,
               mNGroups: cute.Tensor, mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor, mSorted: cute.Tensor,
               mCounter: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        smem = self.allocate_smem(cutlass.memory.SmemAllocator())
        self.tile(item, tidx, smem, mLogits, mBias, (mLogits, mIds, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted),
                  mCounter)

    def allocate_smem(self, smem) -> dict:
        """Trace-time: one work item's shared memory from the allocator `smem` (`smem_bytes` in
        all): its tokens' logits [tokens_per_cta, E] and the bias (fp32), the ids, selections,
        token masks and starts of phase 2, and the arrival's verdict."""
        f32 = cutlass.Float32
        i32 = cutlass.Int32
        nw = self.smem_words
        TPC, E = self.tokens_per_cta, self.n_experts
        return {"logits": smem.allocate_tensor(f32, cute.make_layout((TPC, E), stride=(E, 1)), byte_alignment=16),
                "bias": smem.allocate_tensor(f32, cute.make_layout(nw["bias"]), byte_alignment=16),
                "ids": smem.allocate_tensor(i32, cute.make_layout(nw["ids"]), byte_alignment=16),
                "sel": smem.allocate_tensor(f32, cute.make_layout(nw["sel"]), byte_alignment=16),
                "mask": smem.allocate_tensor(i32, cute.make_layout(nw["mask"]), byte_alignment=16),
                "start": smem.allocate_tensor(i32, cute.make_layout(nw["start"]), byte_alignment=16),
                "last": smem.allocate_tensor(i32, cute.make_layout(4), byte_alignment=16)}

    @cute.jit
    def tile(self, item, tidx, smem, mLogits, mBias, outs, mCounter):
        """Trace-time: work item `item` (tokens item * tokens_per_cta ..), run by `threads`
        threads (`tidx` this one's index), over the shared memory `smem` (`allocate_smem`);
        `outs` = (logits, ids, weights, n_groups, group_expert, group_start, sorted_slots)."""
        T, E, K = self.batch, self.n_experts, self.top_k
        TPC = self.tokens_per_cta
        NTH = self.threads
        TK = self.slots
        i32 = cutlass.Int32
        mIds, mWeights = outs[1], outs[2]

        warp = tidx // WARP
        lane = tidx % WARP
        t0 = item * TPC
        sLg, sBias, sIds, sSel = smem["logits"], smem["bias"], smem["ids"], smem["sel"]
        sMask, sStart, sLast = smem["mask"], smem["start"], smem["last"]

        # --- this item's tokens' logits and the bias into shared memory, one wait --------------------
        rows = cutlass.min(T - t0, TPC)
        first = cute.assume(t0 * E, divby=4)  # E % 4 == 0: the row keeps the tensor's 16 bytes
        self._stage_f32(((mLogits.iterator + first, sLg.iterator, TPC * E // 4, rows * (E // 4)),
                         (mBias.iterator, sBias.iterator, E // 4, None)), tidx)

        # --- top-k: one warp per token ------------------------------------------------------------
        if warp < rows:
            self._topk_one(sLg, sBias, warp, t0 + warp, mIds, mWeights, sIds, sSel, None, lane)
        # --- arrival: the last item groups every token's selection --------------------------------
        self._arrive(mCounter, sLast, tidx)
        if sLast[0] == 1:
            for i in cutlass.range(tidx, self.mask_words * E, NTH, unroll=1):
                sMask[i] = i32(0)
            cute.arch.sync_threads()
            for p in cutlass.range(tidx, TK, NTH, unroll=1):
                t = p // K
                e = mIds[t, p % K]
                sIds[p] = e
                cute.arch.atomic_or(sMask.iterator + (t // WARP) * E + e, i32(1) << (t % WARP))
            cute.arch.sync_threads()
            self._group(outs, sMask, sStart, sIds, tidx)
