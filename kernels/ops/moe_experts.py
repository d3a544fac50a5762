"""Routed experts grouped by expert, in two launches: `moe_w13` ([g | u] = z @ W13_e.T, SiTU in fp32,
a in bf16) and `moe_w2` (o = a @ W2_e.T in fp32, then the weighted combine c = sum_k w_k o_k in the
latent, bf16). Every selected expert's weights are read once per launch, whatever the routing.

Input routing is the router's grouping (kernels/ops/router.py): group u is expert group_expert[u]
with the sorted positions group_start[u] .. group_start[u+1]-1, whose slots (t * top_k + j) are
sorted_slots[pos], in token order. A work item is (group, row block); the grid has one CTA per
possible item (min(T * top_k, n_experts) groups), and a CTA whose group is past this launch's
n_groups (read on the device, so one CUDA graph serves every routing) exits at once.

Two designs, chosen by the tunable `wg` (the block's per-batch table, kernels/block_plan.toml,
says which at which batch; docs/decisions.md says why):

The stream path (`wg` 0; kernels/ops/parts/stream.py, read its docstring): no tensor cores. At
batch 1 every group is one token and a weight byte feeds one FMA; at batch 8 almost every group
still has one token (a few 2-3), so all that matters is how many bytes are in flight. A short CTA
per (possible group, block of whole weight rows) reads the group's expert id (after
`griddepcontrol.wait` with `pdl`: the routing is the router's output), issues every 16-byte
`cp.async` of its rows (`.cg`) and of the group's first `stream_slots` activation rows (`.ca`)
into shared memory, waits once, and runs fp32 FMAs with a warp-shuffle and warp-order reduction
(bitwise deterministic). A group with more tokens than slots then loops: barrier, copy the next
chunk's rows into the same slots, wait, FMAs against the weights still in shared memory (read
from DRAM once per group). Slots past the group's tokens repeat its last row and are not stored.
  moe_w13: a CTA owns R gate rows and the R matching up rows (R = stream rows / 2) and writes
  R columns of act after SiTU for each of the group's tokens.
  moe_w2: a CTA owns a block of W2_e's rows and writes them to o[slot] in fp32 for each of the
  group's tokens, then, after a barrier that follows every chunk's writes, arrives on the row
  block's counter (below).

The warpgroup paths (`wg` 1): a CTA per possible (group, 64-row block) item, a ring of
`wg_stages` 128-byte-swizzled slots of `wg_k` k read by wgmma m64n`wg_n`k16, a group's tokens in
chunks of `wg_n` through the same ring. moe_w2's tokens are contiguous rows of `act`, so TMA
boxes fetch W2_e's rows and them (full and empty mbarriers, kernels/ops/parts/wg_ring.py);
moe_w13's are gathered rows of z, so every thread copies W13_e's 32 gate + 32 up rows and its
token's row by cp.async, and SiTU meets each gate row with its up row through shared memory.

moe_w2's combine (both designs), the split-K pattern of validation/race/specimens/splitk_gemv.py: after a CTA
barrier thread 0 adds 1 to the row block's gpu-scope counter with acq_rel semantics; the CTA that
completes the row block's n_groups-th item resets the counter (release) and sums, for every
token, w_k * o[t * top_k + k] over k in order 0..top_k-1 (fixed order: bitwise deterministic),
rounding c to bf16 once. The host zeroes the counters once.
Both ops are written as tile functions, so that a persistent kernel can call them: `tile(item,
tidx, smem, ...)` (moe_w2's warpgroup path: `wg_tile`, whose operands are TMA atoms) is the
device work of one work item, given the thread's index and the shared memory the caller
allocated (`allocate_smem`); the item is the linear index of (group u, block b) =
(item // blocks, item % blocks), and each @cute.kernel is the thin wrapper item = blockIdx.x.

Why moe_w2 keeps the counters rather than a CTA that streams one output row of all 16 experts
(16 x 6 KB): that CTA needs the 16 activation rows beside them (another 96 KB), 192 KB of shared
memory, one CTA per SM; the stream design measured best with 8-16 KB CTAs, several per SM.
"""

from kernels import reference
from kernels.ops.parts import pdl, stream
from kernels.ops.base import LaunchConfig, OpBase, TensorSpec, op_tunables
from kernels.ops.parts.common import BF16_PER_VECTOR, HAVE_DSL, WARP, ceil_div, cute, cutlass
from kernels.ops.parts.decode_mma import expert_view, situ, vector_view
from kernels.ops.parts import wg_ring
from kernels.ops.router import routing_groups_ref
from kernels.ops.parts.stream import StreamPlan
from kernels.ops.parts.tma import TensorMap, TmaTensorSpec

MAX_BATCH = 64
GATE_LIMIT, UP_LIMIT = 4.0, 25.0  # ModelConfig.situ_gate_limit / situ_up_limit

_CopyAtom = cute.CopyAtom if HAVE_DSL else object  # a kernel annotation (the GPU host has no DSL)
WG_SMEM_LIMIT = 225 * 1024  # under sm_90's 227 KB opt-in maximum per CTA, with the DSL's static 1 KB


def expert_outputs_ref(z, ids, w13, w2, compute_dtype=None):
    """o [T*k, latent] per slot (kernels.reference.expert_outputs, flattened)."""
    kwargs = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
    o = reference.expert_outputs(z, ids, w13, w2, gate_limit=GATE_LIMIT, up_limit=UP_LIMIT, **kwargs)
    return o.reshape(-1, o.shape[-1])


class _GroupedBase(OpBase):
    """Shape {"batch", "n_experts", "latent", "expert_inter", "top_k"} plus tunables."""

    # the tunables' defaults: kernels/manifest.toml [kernels.moe_w13.tunables], [kernels.moe_w2.tunables]
    TUNABLES = ("stream_threads", "stream_cta_kib", "pdl", "stream_slots", "wg", "wg_stages", "wg_k", "wg_n")

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **op_tunables(self.kernel_name, self.TUNABLES, tunables))
        try:
            self.batch = int(shape["batch"])
            self.n_experts = int(shape["n_experts"])
            self.latent = int(shape["latent"])
            self.inter = int(shape["expert_inter"])
            self.top_k = int(shape["top_k"])
        except KeyError as e:
            raise ValueError(f"{self.kernel_name}: shape needs batch, n_experts, latent, expert_inter and top_k; "
                             f"missing {e}") from None
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"{self.kernel_name}: batch {self.batch} outside 1..{MAX_BATCH}")
        self.slots = self.batch * self.top_k
        self.groups = min(self.slots, self.n_experts)
        # The design: wg 1 the warpgroup path, else the stream path.
        self.wg = bool(int(self.tunables["wg"]))
        # The stream path's activation slots in shared memory: a group's tokens go through them a
        # chunk at a time (the first chunk is copied with the weights, before the one wait).
        self.x_slots = min(int(self.tunables["stream_slots"]), self.batch)
        if self.x_slots < 1:
            raise ValueError(f"{self.kernel_name}: stream_slots must be at least 1")
        self.pdl = int(self.tunables["pdl"])
        if self.pdl not in (0, 1):
            raise ValueError(f"{self.kernel_name}: pdl must be 0 or 1")

    def _plan_wg_ring(self, n: int, rows: int, k: int, wg_n_choices: tuple, extra: int, per_token: int = 0) -> None:
        """What both warpgroup paths plan alike: items of `rows` of the n output rows, `wg_k`
        (64 or 128, dividing k) per stage, `wg_n` tokens per tile (one of `wg_n_choices`, at most
        the slots), 2..k-tiles stages, one warpgroup, a CTA per possible item, and the ring's
        shared memory with `extra` + `per_token` x wg_n bytes beside it (refused past
        WG_SMEM_LIMIT)."""
        t, name = self.tunables, self.kernel_name
        if n % rows:
            raise ValueError(f"{name}: {n} rows are not a multiple of {rows} (wg)")
        self.row_blocks = n // rows
        self.stage_k, self.wg_n, self.stages = int(t["wg_k"]), int(t["wg_n"]), int(t["wg_stages"])
        if self.stage_k not in (64, 128) or k % self.stage_k:
            raise ValueError(f"{name}: wg_k must be 64 or 128 and divide k={k}")
        self.k_tiles = k // self.stage_k
        if self.wg_n not in wg_n_choices or self.wg_n > self.slots:
            raise ValueError(f"{name}: wg_n must be one of {', '.join(map(str, wg_n_choices))} and at most the "
                             f"{self.slots} slots")
        if not 2 <= self.stages <= self.k_tiles:
            raise ValueError(f"{name}: wg_stages must be 2..{self.k_tiles} (the k tiles of an item)")
        self.warps = 4
        self.threads = 4 * WARP
        self.ctas = self.groups * self.row_blocks
        self.smem_bytes = wg_ring.ring_smem_bytes(wg_ring.WG_M, self.wg_n, self.stage_k, self.stages,
                                                  extra=extra + per_token * self.wg_n)
        if self.smem_bytes > WG_SMEM_LIMIT:
            raise ValueError(f"{name}: {self.stages} stages of {self.stage_k} k need {self.smem_bytes} B of shared "
                             f"memory (limit {WG_SMEM_LIMIT})")

    def _stream_plan(self, n: int, k: int, min_rows: int) -> StreamPlan:
        """The stream path's CTA: whole rows of k bf16, at least `min_rows` of them, within
        `stream_cta_kib` KiB otherwise, of `stream_threads` threads."""
        t = self.tunables
        try:
            return StreamPlan(n=n, k=k, threads=int(t["stream_threads"]),
                              cta_bytes=max(int(t["stream_cta_kib"]) * 1024, min_rows * k * 2))
        except ValueError as e:
            raise ValueError(f"{self.kernel_name}: the stream path: {e}") from None

    def _stream_launch(self, ctas: int) -> LaunchConfig:
        # pdl only where the kernel waits (griddepcontrol.wait is in the stream path alone)
        return LaunchConfig(grid=(ctas, 1, 1), block=(self.threads, 1, 1), smem_bytes=self.smem_bytes,
                            pdl=bool(self.pdl))

    def _pdl_wait(self):
        pdl.wait(self.pdl)  # kernels/ops/parts/pdl.py

    def _pdl_trigger(self):
        pdl.launch_dependents(self.pdl)

    @cute.jit
    def _copy_slots(self, P, gX, vX, r, kv0, row_of, c0):
        """The stream path: issue the copies of a chunk's activation rows (`.ca`): slot s holds
        row `row_of(s, c0)` of `gX` and is copied by the threads of the CTA's row s % rows (so
        the slots spread over the rows' threads). The caller commits and waits."""
        for s in cutlass.range_constexpr(self.x_slots):
            if r == s % P.rows:
                stream.copy_row(P, stream.activation_copy_atom(cutlass.BFloat16), gX, row_of(s, c0), vX, s * P.kv,
                                kv0)

    def routing_tensors(self, ids):
        """The router's grouping of `ids` (torch), for launching this op on a given routing."""
        return routing_groups_ref(ids, self.n_experts)


def _stream_smem(op, smem) -> dict:
    """Trace-time: the stream path's shared memory (both ops): "w" the CTA's weight rows and "x"
    the `x_slots` activation rows, as 16-byte vectors, and "partials" (fp32 [x_slots, warps])."""
    P, S = op.stream_plan, op.x_slots
    bf16 = cutlass.BFloat16
    sW = smem.allocate_tensor(bf16, cute.make_layout((P.rows * P.k,)), byte_alignment=16)
    sX = smem.allocate_tensor(bf16, cute.make_layout((S * P.k,)), byte_alignment=16)
    sP = smem.allocate_tensor(cutlass.Float32, cute.make_layout((S, P.warps)), byte_alignment=16)
    return {"w": cute.zipped_divide(sW, (BF16_PER_VECTOR,)), "x": cute.zipped_divide(sX, (BF16_PER_VECTOR,)),
            "partials": sP}


class ExpertsUpOp(_GroupedBase):
    """moe_w13: act[pos] = bf16(SiTU(z[token] @ W13_e.T)) for every sorted position of every group."""

    kernel_name = "moe_w13"

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **tunables)
        if self.wg:
            self._plan_up_wg()
            return
        self._plan_up_stream()

    def _plan_up_wg(self) -> None:
        """The warpgroup path (`wg` 1), moe_w13's form: a CTA per possible (group u, column block
        cb) item, one warpgroup; its 64-row W tile is 32 gate rows and the 32 matching up rows
        (W13_e rows cb*32.. and I + cb*32..), its x tile `wg_n` of the group's tokens, gathered
        rows of z (a TMA box cannot gather), so every thread copies both by 16-byte cp.async into
        a ring of `wg_stages` 128-byte-swizzled slots of `wg_k` k, `wg_stages` - 1 stages ahead
        (per stage its own copies' wait, the async-proxy fence, one CTA barrier), and wgmma m64n`wg_n`k16 reads the slots. After a chunk's last k tile the
        accumulators go through shared memory so that each gate row meets its up row, and
        a[sorted position, column] = bf16(SiTU(g, u))."""
        self.half_rows = wg_ring.WG_M // 2
        # (one x row per thread and stage: at most 16 token rows); beside the ring, the
        # accumulators' exchange, 64 rows of fp32 per token
        self._plan_wg_ring(self.inter, self.half_rows, self.latent, (8, 16), extra=0, per_token=wg_ring.WG_M * 4)

    def _plan_up_stream(self) -> None:
        """A CTA per (group, block of `stream_cols` act columns): its gate rows and the matching
        up rows of W13_e (at least one pair), one group per selected expert; `x_slots` z rows in
        shared memory beside them."""
        P = self.stream_plan = self._stream_plan(2 * self.inter, self.latent, 2)
        if P.rows % 2:
            raise ValueError("moe_w13: the stream path needs at least 64 threads (a gate and an up row)")
        self.stream_cols = P.rows // 2
        self.col_blocks = self.inter // self.stream_cols
        self.threads = P.threads
        self.ctas = self.groups * self.col_blocks
        self.smem_bytes = P.smem_bytes(P.rows, self.x_slots, self.x_slots * P.warps)

    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, E, L, I = self.batch, self.n_experts, self.latent, self.inter
        return {
            "z": TensorSpec((T, L), "bfloat16"),
            "w13": TensorSpec((E, 2 * I, L), "bfloat16"),
            "n_groups": TensorSpec((1,), "int32"),
            "group_expert": TensorSpec((self.groups,), "int32"),
            "group_start": TensorSpec((self.groups + 1,), "int32"),
            "sorted_slots": TensorSpec((self.slots,), "int32"),
            "act": TensorSpec((self.slots, I), "bfloat16"),
        }

    def launch_config(self) -> LaunchConfig:
        if not self.wg:
            return self._stream_launch(self.ctas)
        return LaunchConfig(grid=(self.ctas, 1, 1), block=(self.threads, 1, 1), smem_bytes=self.smem_bytes)

    def reference(self, *, z, w13, sorted_slots, compute_dtype=None, **_rest):
        """act [T*k, I] in sorted-position order: SiTU(z[token] @ W13_e.T), bf16 (float64 oracle)."""
        import torch

        cd = compute_dtype or torch.float32
        K, I = self.top_k, self.inter
        slots = sorted_slots.long()
        ids_flat = _rest["ids"].reshape(-1).long() if "ids" in _rest else None
        if ids_flat is None:
            raise ValueError("moe_w13 reference needs ids= (the routing the metadata came from)")
        tok = slots // K
        exp = ids_flat[slots]
        out = torch.empty(slots.numel(), I, dtype=cd if cd == torch.float64 else z.dtype, device=z.device)
        for e in torch.unique(exp).tolist():
            m = exp == e
            gu = z[tok[m]].to(cd) @ w13[e].to(cd).T
            a = reference.situ(gu[:, :I], gu[:, I:], GATE_LIMIT, UP_LIMIT)
            out[m] = a if cd == torch.float64 else a.to(z.dtype)
        return {"act": out}

    @cute.jit
    def __call__(self, mZ: cute.Tensor, mW: cute.Tensor, mNGroups: cute.Tensor, mGroupExpert: cute.Tensor,
                 mGroupStart: cute.Tensor, mSorted: cute.Tensor, mAct: cute.Tensor):
        lc = self.launch_config()
        self.kernel(mZ, mW, mNGroups, mGroupExpert, mGroupStart, mSorted, mAct).launch(
            grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def kernel(self, mZ: cute.Tensor, mW: cute.Tensor, mNGroups: cute.Tensor, mGroupExpert: cute.Tensor,
               mGroupStart: cute.Tensor, mSorted: cute.Tensor, mAct: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        smem = self.allocate_smem(cutlass.memory.SmemAllocator())
        self.tile(item, tidx, smem, mZ, mW, mNGroups, mGroupExpert, mGroupStart, mSorted, mAct)

    def allocate_smem(self, smem) -> dict:
        """Trace-time: one work item's shared memory from the allocator `smem` (`smem_bytes` in
        all). Stream path: "w" (the CTA's weight rows) and "x" (the activation slots), both as
        16-byte vectors, and "partials" (fp32 [slots, warps]); warpgroup path: the rings "w" and
        "x" (128-byte-swizzled slots) and "acc" (fp32 [64, wg_n], the accumulators' exchange)."""
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        if cutlass.const_expr(self.wg):
            M, N = wg_ring.WG_M, self.wg_n
            _, lay_w, lay_x = wg_ring.layouts(M, N, self.stage_k, self.stages)
            sW = smem.allocate_tensor(bf16, lay_w.outer, byte_alignment=wg_ring.SWIZZLE_ALIGN, swizzle=lay_w.inner)
            sX = smem.allocate_tensor(bf16, lay_x.outer, byte_alignment=wg_ring.SWIZZLE_ALIGN, swizzle=lay_x.inner)
            sAcc = smem.allocate_tensor(f32, cute.make_layout((M, N), stride=(N, 1)), byte_alignment=16)
            return {"w": sW, "x": sX, "acc": sAcc}
        return _stream_smem(self, smem)

    @cute.jit
    def tile(self, item, tidx, smem, mZ, mW, mNGroups, mGroupExpert, mGroupStart, mSorted, mAct):
        """Trace-time: work item `item`, the linear index of (group u, column block cb) =
        (item // blocks, item % blocks) (`col_blocks` or `row_blocks` of the design), run by
        `threads` threads (`tidx` this one's index), over the shared memory `smem`
        (`allocate_smem`). An item whose group is past n_groups does nothing."""
        if cutlass.const_expr(self.wg):
            self._up_wg(item, tidx, smem, mZ, mW, mNGroups, mGroupExpert, mGroupStart, mSorted, mAct)
        else:
            self._up_stream(item, tidx, smem, mZ, mW, mNGroups, mGroupExpert, mGroupStart, mSorted, mAct)

    @cute.jit
    def _up_wg(self, bidx, tidx, smem, mZ, mW, mNGroups, mGroupExpert, mGroupStart, mSorted, mAct):
        """The warpgroup path (see `_plan_up_wg`): tiles numbered across the item's chunks of
        `wg_n` tokens; per tile: this thread's copies of the tile landed, the async-proxy
        fence, one CTA barrier, then the copies of the tile S - 1 ahead into the slot the
        previous tile's (waited-for) wgmmas read, and this tile's wgmmas."""
        from cutlass.cute.nvgpu import warpgroup

        S, BK, N, KT = self.stages, self.stage_k, self.wg_n, self.k_tiles
        L, I, R, RB = self.latent, self.inter, self.half_rows, self.row_blocks
        bf16 = cutlass.BFloat16
        M = wg_ring.WG_M

        u = bidx // RB
        cb = bidx % RB
        mma, _, _ = wg_ring.layouts(M, N, BK, S)
        sW, sX, sAcc = smem["w"], smem["x"], smem["acc"]

        n_groups = mNGroups[0]
        if u < n_groups:  # CTA-uniform: every thread takes the same branch
            e = mGroupExpert[u]
            start = mGroupStart[u]
            cnt = mGroupStart[u + 1] - start
            total = (cnt + (N - 1)) // N * KT
            # W: rows 0..R-1 gate rows cb*R.., rows R..2R-1 the up rows I + cb*R.. of expert e
            eW = expert_view(mW, e, 2 * I, L)
            w_off = cute.assume(cb * (R * L), divby=BF16_PER_VECTOR)
            gW2 = cute.make_tensor(eW.iterator + w_off, cute.make_layout(((R, 2), L), stride=((L, I * L), 1)))
            gW = cute.local_tile(gW2, (M, BK), (0, None))  # (M, BK, k tiles)
            # both copies: `per_row` threads per row's 16-byte vectors, rows down the thread block
            per_row = BK // BF16_PER_VECTOR
            thr = cute.make_layout((self.threads // per_row, per_row), stride=(per_row, 1))
            vals = cute.make_layout((1, BF16_PER_VECTOR))
            w_copy = cute.make_tiled_copy_tv(stream.weight_copy_atom(bf16), thr, vals)
            x_copy = cute.make_tiled_copy_tv(stream.activation_copy_atom(bf16), thr, vals)
            thr_w = w_copy.get_slice(tidx)
            tWg, tWs = thr_w.partition_S(gW), thr_w.partition_D(sW)
            thr_x = x_copy.get_slice(tidx)
            tXs = thr_x.partition_D(sX)
            xrow = tidx // per_row  # this thread's x row of every tile (N rows x per_row vectors)
            tCrA, tCrB, tCc, acc = wg_ring.operands(mma, sW, sX, tidx, M, N)

            # prologue: tiles 0..S-2 (chunk 0: S <= KT)
            tXg = self._wg_x_rows(mZ, mSorted, start, cnt, 0, xrow, thr_x)
            for st in cutlass.range_constexpr(S - 1):
                cute.copy(w_copy, tWg[(None, None, None, st)], tWs[(None, None, None, st)])
                if xrow < N:
                    cute.copy(x_copy, tXg[(None, None, None, st)], tXs[(None, None, None, st)])
                cute.arch.cp_async_commit_group()
            for it in cutlass.range(total, unroll=1):
                cute.arch.cp_async_wait_group(S - 2)  # this thread's copies of tile it have landed
                warpgroup.wait_group(0)  # the wgmmas of tile it - 1 are done
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
                nxt = it + (S - 1)
                if nxt < total:
                    kt = nxt % KT
                    cute.copy(w_copy, tWg[(None, None, None, kt)], tWs[(None, None, None, nxt % S)])
                    if xrow < N:
                        tXn = self._wg_x_rows(mZ, mSorted, start, cnt, nxt // KT, xrow, thr_x)
                        cute.copy(x_copy, tXn[(None, None, None, kt)], tXs[(None, None, None, nxt % S)])
                cute.arch.cp_async_commit_group()  # possibly empty: keeps one group per tile
                slot = it % S
                warpgroup.fence()
                for kb in cutlass.range_constexpr(BK // 16):
                    cute.gemm(mma, acc, tCrA[(None, None, kb, slot)], tCrB[(None, None, kb, slot)], acc)
                warpgroup.commit_group()
                if it % KT == KT - 1:  # the chunk's last k tile: SiTU of its tokens' columns
                    warpgroup.wait_group(0)
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        r, j = tCc[i]
                        sAcc[r, j] = acc[i]
                    acc.fill(0.0)
                    cute.arch.sync_threads()
                    c0 = it // KT * N
                    for q in cutlass.range_constexpr(ceil_div(R * N, self.threads)):
                        idx = tidx + q * self.threads
                        col = idx % R
                        j = idx // R
                        if idx < R * N:
                            if c0 + j < cnt:
                                a = situ(sAcc[col, j], sAcc[R + col, j], GATE_LIMIT, UP_LIMIT)
                                mAct[start + c0 + j, cb * R + col] = a.to(bf16)
                    cute.arch.sync_threads()  # sAcc is read before the next chunk writes it
            warpgroup.wait_group(0)

    def _wg_x_rows(self, mZ, mSorted, start, cnt, chunk, xrow, thr_x):
        """Trace-time: this thread's x source tiles for `chunk`: every row of the (N, L) view is
        the z row of the chunk's token `xrow` (stride 0: a thread copies only its own row), the
        last token repeated past the group's (never stored)."""
        L, K, N = self.latent, self.top_k, self.wg_n
        pos = start + cutlass.min(chunk * N + xrow, cnt - 1)
        tok = mSorted[pos] // K
        base = mZ.iterator + cute.assume(tok * L, divby=BF16_PER_VECTOR)
        gZ = cute.make_tensor(base, cute.make_layout((N, L), stride=(0, 1)))
        return thr_x.partition_S(cute.local_tile(gZ, (N, self.stage_k), (0, None)))

    @cute.jit
    def _up_stream(self, bidx, tidx, smem, mZ, mW, mNGroups, mGroupExpert, mGroupStart, mSorted, mAct):
        """The stream path (see the module docstring): CTA (group u, column block cb) copies gate
        rows cb*R .. cb*R+R-1 and up rows I + cb*R .. of expert group_expert[u] and the group's
        first `x_slots` z rows, then, a chunk of tokens at a time, writes
        act[pos, cb*R + r] = bf16(SiTU(gate . z[token], up . z[token])) for each sorted position."""
        P = self.stream_plan

        r = tidx // P.row_threads  # the CTA's row: gate rows first, then the up rows
        kv0 = tidx % P.row_threads
        u = bidx // self.col_blocks
        cb = bidx % self.col_blocks
        vW, vX, sP = smem["w"], smem["x"], smem["partials"]

        early = self._expert_before_wait(u, mGroupExpert)
        self._pdl_wait()  # the routing and z are the router's outputs
        if u < mNGroups[0]:  # CTA-uniform: every thread takes the same branch
            self._up_stream_item(P, vW, vX, sP, r, kv0, tidx, u, cb, early, mZ, mW, mGroupExpert, mGroupStart,
                                 mSorted, mAct)

    def _expert_before_wait(self, u, mGroupExpert):
        """Trace-time: the group's expert id where read before `griddepcontrol.wait`, else None
        (the item reads it after the wait): the routing is the router's output, so this op reads
        none of it early."""
        return None

    @cute.jit
    def _up_stream_item(self, P, vW, vX, sP, r, kv0, tidx, u, cb, early, mZ, mW, mGroupExpert, mGroupStart,
                        mSorted, mAct):
        """One (group u, column block cb) item of the stream path: its copies, one wait, its chunks."""
        pos0, cnt = self.up_issue(P, vW, vX, r, kv0, u, cb, early, mZ, mW, mGroupExpert, mGroupStart, mSorted)
        cute.arch.cp_async_commit_group()
        self._pdl_trigger()
        self.up_finish(P, vW, vX, sP, r, kv0, tidx, pos0, cnt, cb, mZ, mSorted, mAct, 0)

    @cute.jit
    def up_issue(self, P, vW, vX, r, kv0, u, cb, early, mZ, mW, mGroupExpert, mGroupStart, mSorted):
        """The copies of item (group u, column block cb), uncommitted: its gate and up rows of
        W13_e and the group's first chunk of z rows. Returns (pos0, cnt): the group's first
        sorted position and its token count (1 at batch 1). A persistent caller that commits
        them and runs the previous item's `up_finish` meanwhile keeps two items' copies in
        flight (kernels/ops/megakernel.py, the w13 stage's prefetch)."""
        T, I, R = self.batch, self.inter, self.stream_cols
        bf16 = cutlass.BFloat16
        gW = vector_view(expert_view(mW, mGroupExpert[u] if early is None else early, 2 * I, self.latent))
        row = (r // R) * I + cb * R + r % R
        stream.copy_row(P, stream.weight_copy_atom(bf16), gW, row, vW, r * P.kv, kv0)
        pos0 = mGroupStart[u]
        cnt = 1
        if cutlass.const_expr(T == 1):  # one token: z row 0, no sorted slot to read
            if r == 0:
                stream.copy_row(P, stream.activation_copy_atom(bf16), vector_view(mZ), 0, vX, 0, kv0)
        else:
            cnt = mGroupStart[u + 1] - pos0
            self._copy_slots(P, vector_view(mZ), vX, r, kv0, self._z_row(mSorted, pos0, cnt), 0)
        return pos0, cnt

    def _z_row(self, mSorted, pos0, cnt):
        """Slot s of chunk c0 holds z row token(sorted position pos0 + min(c0 + s, cnt - 1))."""
        K = self.top_k

        def z_row(s, c0):
            return mSorted[pos0 + cutlass.min(c0 + s, cnt - 1)] // K

        return z_row

    @cute.jit
    def up_finish(self, P, vW, vX, sP, r, kv0, tidx, pos0, cnt, cb, mZ, mSorted, mAct, pending):
        """The item `up_issue` copied (its copies committed): its first chunk once at most
        `pending` later commit groups are outstanding, then the group's further chunks of
        `x_slots` tokens (each copied into the same slots and waited for in full)."""
        S = self.x_slots
        self._up_stream_chunk(P, vW, vX, sP, r, kv0, tidx, pos0, 0, cnt, cb, mAct, pending)
        if cutlass.const_expr(self.batch > 1):
            z_row = self._z_row(mSorted, pos0, cnt)
            for c0 in cutlass.range(S, cnt, S, unroll=1):  # groups of more than S tokens
                cute.arch.sync_threads()  # every thread is done with the slots and partials
                self._copy_slots(P, vector_view(mZ), vX, r, kv0, z_row, c0)
                cute.arch.cp_async_commit_group()
                self._up_stream_chunk(P, vW, vX, sP, r, kv0, tidx, pos0, c0, cnt, cb, mAct, 0)

    @cute.jit
    def _up_stream_chunk(self, P, vW, vX, sP, r, kv0, tidx, pos0, c0, cnt, cb, mAct, pending):
        """Wait for the copies (all but the `pending` latest commit groups), then the chunk's
        tokens c0 .. c0+S-1 (those below cnt): dot products against the weights in shared
        memory, SiTU, act columns written."""
        R, S = self.stream_cols, self.x_slots
        cute.arch.cp_async_wait_group(pending)
        cute.arch.sync_threads()  # z rows were copied by other rows' threads
        acc = stream.dot(P, vW, r * P.kv, vX, [s * P.kv for s in range(S)], kv0)
        stream.publish_partials(acc, sP, tidx // WARP, tidx % WARP)
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(ceil_div(R * S, P.threads)):
            idx = tidx + j * P.threads
            s = idx // R
            c = idx % R
            if idx < R * S:
                if c0 + s < cnt:
                    gv = stream.row_total(P, sP, c, s)
                    uv = stream.row_total(P, sP, R + c, s)
                    mAct[pos0 + c0 + s, cb * R + c] = situ(gv, uv, GATE_LIMIT, UP_LIMIT).to(cutlass.BFloat16)

class ExpertsDownOp(_GroupedBase):
    """moe_w2: o[slot] = act[pos] @ W2_e.T (fp32 scratch), then c[t] = bf16(sum_k w[t,k] o[t*k + k])."""

    kernel_name = "moe_w2"

    def __init__(self, shape: dict, **tunables):
        super().__init__(shape, **tunables)
        if self.wg:
            self._plan_down_wg()
            return
        self._plan_down_stream()

    def _plan_down_wg(self) -> None:
        """The TMA-fed warpgroup path (`wg` 1): a CTA per possible (group u, 64-row block rb)
        item (those past the routing's n_groups exit at once), one warpgroup. TMA brings W2_e's
        rows rb*64 .. rb*64+63 (a 3-D box: k, rows, one expert) and `wg_n` act rows from the
        group's first sorted position (a 2-D box; rows past the group belong to the next group
        or lie past the buffer, zero-filled, and are never stored) into a ring of `wg_stages`
        slots of `wg_k` k; wgmma m64n`wg_n`k16 reads them straight from shared memory. A group
        of more than `wg_n` tokens takes its chunks one after the other through the same ring
        (W read again per chunk: only where many tokens share an expert). After each chunk's
        last k tile the CTA writes its o rows in fp32, and after the item it arrives on the row
        block's counter exactly as the other paths (`_arrive_and_combine`)."""
        self.rows_per_cta = wg_ring.WG_M
        self._plan_wg_ring(self.latent, self.rows_per_cta, self.inter, (8, 16, 32, 64), extra=16)  # + the verdict

    def _plan_down_stream(self) -> None:
        """A CTA per (group, block of whole W2_e rows), `x_slots` act rows beside them; its row
        block's counter takes one arrival per group."""
        P = self.stream_plan = self._stream_plan(self.latent, self.inter, 1)
        self.rows_per_cta = P.rows
        self.row_blocks = self.latent // P.rows
        self.threads = P.threads
        self.ctas = self.groups * self.row_blocks
        self.smem_bytes = P.smem_bytes(P.rows, self.x_slots, self.x_slots * P.warps) + 16  # + the verdict

    def tensor_specs(self) -> dict[str, TensorSpec]:
        T, E, L, I, K = self.batch, self.n_experts, self.latent, self.inter, self.top_k
        # wg: act and w2 reach the kernel as TMA descriptors the launcher encodes (boxes of one
        # 64-k swizzle line: wg_n act rows; 64 rows of one expert), no L2 promotion
        act_map = TensorMap((wg_ring.TMA_BOX_K, self.wg_n), l2_promotion=0) if self.wg else None
        w_map = TensorMap((wg_ring.TMA_BOX_K, wg_ring.WG_M, 1), l2_promotion=0) if self.wg else None
        return {
            "act": TmaTensorSpec((self.slots, I), "bfloat16", act_map),
            "w2": TmaTensorSpec((E, L, I), "bfloat16", w_map),
            "weights": TensorSpec((T, K), "float32"),
            "n_groups": TensorSpec((1,), "int32"),
            "group_expert": TensorSpec((self.groups,), "int32"),
            "group_start": TensorSpec((self.groups + 1,), "int32"),
            "sorted_slots": TensorSpec((self.slots,), "int32"),
            "o": TensorSpec((self.slots, L), "float32"),
            "counters": TensorSpec((self.row_blocks,), "int32"),
            "c": TensorSpec((T, L), "bfloat16"),
        }

    def launch_config(self) -> LaunchConfig:
        if not self.wg:
            return self._stream_launch(self.ctas)
        return LaunchConfig(grid=(self.ctas, 1, 1), block=(self.threads, 1, 1), smem_bytes=self.smem_bytes)

    def reference(self, *, act, w2, weights, sorted_slots, compute_dtype=None, **_rest):
        """c [T, latent] from act in sorted-position order (see ExpertsUpOp.reference)."""
        import torch

        cd = compute_dtype or torch.float32
        ids_flat = _rest["ids"].reshape(-1).long()
        slots = sorted_slots.long()
        o = torch.empty(self.slots, self.latent, dtype=cd, device=act.device)
        exp = ids_flat[slots]
        for e in torch.unique(exp).tolist():
            m = exp == e
            o[slots[m]] = act[m].to(cd) @ w2[e].to(cd).T
        c = reference.combine(o.view(self.batch, self.top_k, -1), weights, out_dtype=torch.bfloat16,
                              compute_dtype=cd)
        return {"c": c}

    @cute.jit
    def __call__(self, mAct: cute.Tensor, mW: cute.Tensor, mWeights: cute.Tensor, mNGroups: cute.Tensor,
                 mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor, mSorted: cute.Tensor, mO: cute.Tensor,
                 mCounters: cute.Tensor, mC: cute.Tensor):
        lc = self.launch_config()
        if cutlass.const_expr(self.wg):
            L, I, E = self.latent, self.inter, self.n_experts
            _, lay_w, lay_x = wg_ring.layouts(self.rows_per_cta, self.wg_n, self.stage_k, self.stages)
            # W2 as (rows, k, expert): the box tiles rows and k of one expert
            mW3 = cute.make_tensor(mW.iterator, cute.make_layout((L, I, E), stride=(I, 1, L * I)))
            tma_w, gW = wg_ring.tma_atom(mW3, lay_w, (self.rows_per_cta, self.stage_k))
            tma_x, gX = wg_ring.tma_atom(mAct, lay_x, (self.wg_n, self.stage_k))
            self.wg_kernel(tma_x, gX, tma_w, gW, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted, mO,
                           mCounters, mC).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)
        else:
            self.kernel(mAct, mW, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted, mO, mCounters,
                        mC).launch(grid=list(lc.grid), block=list(lc.block), smem=lc.smem_bytes)

    @cute.kernel
    def wg_kernel(self, tma_x: _CopyAtom, gX: cute.Tensor, tma_w: _CopyAtom, gW: cute.Tensor, mWeights: cute.Tensor,
                  mNGroups: cute.Tensor, mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor, mSorted: cute.Tensor,
                  mO: cute.Tensor, mCounters: cute.Tensor, mC: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        smem = self.allocate_smem(cutlass.memory.SmemAllocator())
        self.wg_tile(item, tidx, smem, tma_x, gX, tma_w, gW, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted,
                     mO, mCounters, mC)

    def allocate_smem(self, smem) -> dict:
        """Trace-time: one work item's shared memory from the allocator `smem` (`smem_bytes` in
        all). Stream path: "w", "x", "partials" (as moe_w13's); warpgroup path: the rings "w" and
        "x" and their 2 x `wg_stages` mbarriers "bars" (full, then empty); both: "last" (int32
        [1], the arrival's verdict)."""
        if cutlass.const_expr(self.wg):
            _, lay_w, lay_x = wg_ring.layouts(self.rows_per_cta, self.wg_n, self.stage_k, self.stages)
            sW, sX, bars = wg_ring.smem_tensors(smem, lay_w, lay_x, self.stages)
            out = {"w": sW, "x": sX, "bars": bars}
        else:
            out = _stream_smem(self, smem)
        out["last"] = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), byte_alignment=16)
        return out

    @cute.jit
    def wg_tile(self, item, tidx, smem, tma_x, gX_t, tma_w, gW_t, mWeights, mNGroups, mGroupExpert, mGroupStart,
                mSorted, mO, mCounters, mC):
        """Trace-time: the warpgroup path's work item `item`, the linear index of (group u, row
        block rb) = (item // row_blocks, item % row_blocks), run by one warpgroup (`tidx` this
        thread's index), over the shared memory `smem` (`allocate_smem`). Its mbarriers are
        initialised here, once per item (a persistent caller gives each item fresh barriers)."""
        self._down_wg(item, tidx, smem, tma_x, gX_t, tma_w, gW_t, mWeights, mNGroups, mGroupExpert, mGroupStart,
                      mSorted, mO, mCounters, mC)

    @cute.jit
    def _down_wg(self, bidx, tidx, smem, tma_x, gX_t, tma_w, gW_t, mWeights, mNGroups, mGroupExpert, mGroupStart,
                 mSorted, mO, mCounters, mC):
        """The TMA-fed warpgroup path (see `_plan_down_wg`). Per k tile of the item (chunks of
        `wg_n` tokens one after the other, their tiles numbered on): every thread waits on the
        slot's full barrier, runs its wgmmas and waits for them, each warp's lane 0 arrives on
        the slot's empty barrier, and warp 0 waits on that barrier before refilling the slot
        with the tile `wg_stages` ahead (possibly of the next chunk). No CTA barrier in the loop:
        the TMA writes and the wgmma reads are both async-proxy accesses ordered by the
        mbarriers. After a chunk's last tile its o rows are written (plain stores; the
        arrival's CTA barrier and acq_rel atomic publish them)."""
        from cutlass.cute.nvgpu import cpasync

        S, BK, N, KT, R, RB = self.stages, self.stage_k, self.wg_n, self.k_tiles, self.rows_per_cta, self.row_blocks
        tile_bytes = (R + N) * BK * 2

        lane = tidx % WARP
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        u = bidx // RB
        rb = bidx % RB
        mma, _, _ = wg_ring.layouts(R, N, BK, S)
        sW, sX, bars, sLast = smem["w"], smem["x"], smem["bars"], smem["last"]
        full = bars
        empty = bars + S
        wg_ring.init_barriers(bars, S, self.warps, tidx, [tma_w, tma_x])

        n_groups = mNGroups[0]
        if u < n_groups:  # CTA-uniform: every thread takes the same branch
            e = mGroupExpert[u]
            start = mGroupStart[u]
            cnt = mGroupStart[u + 1] - start
            total = (cnt + (N - 1)) // N * KT
            gWe = cute.local_tile(gW_t[(None, None, e)], (R, BK), (rb, None))  # (R, BK, k tiles)
            tWs, tWg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                             cute.group_modes(gWe, 0, 2))
            tXs, tXg0 = self._wg_x_tiles(tma_x, gX_t, sX, start)
            tCrA, tCrB, tCc, acc = wg_ring.operands(mma, sW, sX, tidx, R, N)
            if warp == 0:  # the prologue: chunk 0's first S tiles (S <= KT)
                for st in cutlass.range_constexpr(S):
                    wg_ring.issue(tma_w, tWg[(None, st)], tWs[(None, st)], tma_x, tXg0[(None, st)],
                                  tXs[(None, st)], full + st, tile_bytes, wg_ring.TMA_EVICT_FIRST,
                                  wg_ring.TMA_EVICT_LAST)
            for it in cutlass.range(total, unroll=1):
                slot = it % S
                parity = (it // S) % 2
                wg_ring.consume(mma, acc, tCrA, tCrB, full + slot, empty + slot, slot, parity, BK // 16, lane)
                if warp == 0:
                    nxt = it + S
                    if nxt < total:
                        cute.arch.mbarrier_wait(empty + slot, parity)
                        _, tXg = self._wg_x_tiles(tma_x, gX_t, sX, start + nxt // KT * N)
                        kt = nxt % KT
                        wg_ring.issue(tma_w, tWg[(None, kt)], tWs[(None, slot)], tma_x, tXg[(None, kt)],
                                      tXs[(None, slot)], full + slot, tile_bytes, wg_ring.TMA_EVICT_FIRST,
                                      wg_ring.TMA_EVICT_LAST)
                if it % KT == KT - 1:  # the chunk's last k tile: its tokens' o rows
                    c0 = it // KT * N
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        r, j = tCc[i]
                        if c0 + j < cnt:
                            mO[mSorted[start + c0 + j], rb * R + r] = acc[i]
                    acc.fill(0.0)
            _arrive_and_combine(self, sLast, rb, n_groups, tidx, mWeights, mO, mCounters, mC)

    def _wg_x_tiles(self, tma_x, gX_t, sX, row0):
        """Trace-time: the slots' and the act tiles (k tiles) of rows row0 .. row0 + wg_n - 1."""
        from cutlass.cute.nvgpu import cpasync

        gXc = cute.local_tile(cute.domain_offset((row0, 0), gX_t), (self.wg_n, self.stage_k), (0, None))
        return cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                     cute.group_modes(gXc, 0, 2))

    @cute.kernel
    def kernel(self, mAct: cute.Tensor, mW: cute.Tensor, mWeights: cute.Tensor, mNGroups: cute.Tensor,
               mGroupExpert: cute.Tensor, mGroupStart: cute.Tensor, mSorted: cute.Tensor, mO: cute.Tensor,
               mCounters: cute.Tensor, mC: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        smem = self.allocate_smem(cutlass.memory.SmemAllocator())
        self.tile(item, tidx, smem, mAct, mW, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted, mO, mCounters,
                  mC)

    @cute.jit
    def tile(self, item, tidx, smem, mAct, mW, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted, mO, mCounters,
             mC):
        """Trace-time: the stream path's work item `item`, the linear index of (group u, row block
        rb) = (item // row_blocks, item % row_blocks), run by `threads` threads (`tidx` this
        one's index), over the shared memory `smem` (`allocate_smem`). The warpgroup path's
        item is `wg_tile` (its operands are TMA atoms, not these tensors)."""
        self._down_stream(item, tidx, smem, mAct, mW, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted, mO,
                          mCounters, mC)

    @cute.jit
    def _down_stream(self, bidx, tidx, smem, mAct, mW, mWeights, mNGroups, mGroupExpert, mGroupStart, mSorted, mO,
                     mCounters, mC):
        """The stream path (see the module docstring): CTA (group u, row block rb) copies W2_e rows
        rb*R .. rb*R+R-1 of expert group_expert[u] and the group's first `x_slots` act rows, then,
        a chunk of tokens at a time, writes o[slot, rows] in fp32; once all its tokens are written
        it arrives on counters[rb] (one arrival per group); the CTA that completes the row block
        resets its counter and writes c[t, rows] = bf16(sum_k w[t, k] o[t*K + k, rows]), k in order."""
        P = self.stream_plan

        r = tidx // P.row_threads
        kv0 = tidx % P.row_threads
        u = bidx // self.row_blocks
        rb = bidx % self.row_blocks
        vW, vX, sP, sLast = smem["w"], smem["x"], smem["partials"], smem["last"]

        self._pdl_wait()  # the routing and act are earlier kernels' outputs
        n_groups = mNGroups[0]
        if u < n_groups:  # CTA-uniform: every thread takes the same branch
            self._down_stream_item(P, vW, vX, sP, sLast, r, kv0, tidx, u, rb, n_groups, mAct, mW, mWeights,
                                   mGroupExpert, mGroupStart, mSorted, mO, mCounters, mC)

    @cute.jit
    def _down_stream_item(self, P, vW, vX, sP, sLast, r, kv0, tidx, u, rb, n_groups, mAct, mW, mWeights,
                          mGroupExpert, mGroupStart, mSorted, mO, mCounters, mC):
        """One (group u, row block rb) item of the stream path: its copies, one wait, its chunks,
        the arrival on the row block's counter and, in the CTA that completes it, the combine."""
        T, L, I, R, S = self.batch, self.latent, self.inter, self.rows_per_cta, self.x_slots
        bf16 = cutlass.BFloat16
        gW = vector_view(expert_view(mW, mGroupExpert[u], L, I))
        stream.copy_row(P, stream.weight_copy_atom(bf16), gW, rb * R + r, vW, r * P.kv, kv0)
        pos0 = mGroupStart[u]
        gA = vector_view(mAct)
        if cutlass.const_expr(T == 1):  # one token: the group's one act row
            if r == 0:
                stream.copy_row(P, stream.activation_copy_atom(bf16), gA, pos0, vX, 0, kv0)
            cute.arch.cp_async_commit_group()
            self._pdl_trigger()
            self._down_stream_chunk(P, vW, vX, sP, r, kv0, tidx, pos0, 0, 1, rb, mSorted, mO)
        else:
            cnt = mGroupStart[u + 1] - pos0

            def a_row(s, c0, pos0=pos0, cnt=cnt):
                return pos0 + cutlass.min(c0 + s, cnt - 1)

            self._copy_slots(P, gA, vX, r, kv0, a_row, 0)
            cute.arch.cp_async_commit_group()
            self._pdl_trigger()
            self._down_stream_chunk(P, vW, vX, sP, r, kv0, tidx, pos0, 0, cnt, rb, mSorted, mO)
            for c0 in cutlass.range(S, cnt, S, unroll=1):  # groups of more than S tokens
                cute.arch.sync_threads()  # every thread is done with the slots and partials
                self._copy_slots(P, gA, vX, r, kv0, a_row, c0)
                cute.arch.cp_async_commit_group()
                self._down_stream_chunk(P, vW, vX, sP, r, kv0, tidx, pos0, c0, cnt, rb, mSorted, mO)
        # one arrival per group, after every chunk's o writes
        _arrive_and_combine(self, sLast, rb, n_groups, tidx, mWeights, mO, mCounters, mC)

    @cute.jit
    def _down_stream_chunk(self, P, vW, vX, sP, r, kv0, tidx, pos0, c0, cnt, rb, mSorted, mO):
        """Wait for the copies, then the chunk's tokens c0 .. c0+S-1 (those below cnt): dot
        products against the weights in shared memory, o rows written in fp32."""
        R, S = self.rows_per_cta, self.x_slots
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # act rows were copied by other rows' threads
        acc = stream.dot(P, vW, r * P.kv, vX, [s * P.kv for s in range(S)], kv0)
        stream.publish_partials(acc, sP, tidx // WARP, tidx % WARP)
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(ceil_div(R * S, P.threads)):
            idx = tidx + j * P.threads
            s = idx // R
            c = idx % R
            if idx < R * S:
                if c0 + s < cnt:
                    mO[mSorted[pos0 + c0 + s], rb * R + c] = stream.row_total(P, sP, c, s)

@cute.jit
def _arrive_and_combine(op, sLast, rb, n_groups, tidx, mWeights, mO, mCounters, mC):
    """moe_w2's arrival on row block rb, in every path, after this CTA's o writes of the item:
    a CTA barrier orders them; thread 0 adds 1 to the row block's gpu-scope counter with acq_rel
    semantics; the CTA whose arrival is the n_groups-th resets the counter (release: nothing
    reads it again this launch) and writes c[t, rows] = bf16(sum_k w[t, k] o[t*K + k, rows]),
    k in order 0..top_k-1 (bitwise deterministic)."""
    T, K, R = op.batch, op.top_k, op.rows_per_cta
    i32 = cutlass.Int32
    cute.arch.sync_threads()
    if tidx == 0:
        old = cute.arch.atomic_add(mCounters.iterator + rb, i32(1), sem="acq_rel", scope="gpu")
        last = i32(0)
        if old == n_groups - 1:
            last = i32(1)
            cute.arch.store(mCounters.iterator + rb, i32(0), sem="release", scope="gpu")
        sLast[0] = last
    cute.arch.sync_threads()
    if sLast[0] == 1:
        for j in cutlass.range_constexpr(ceil_div(R * T, op.threads)):
            idx = tidx + j * op.threads
            if idx < R * T:
                combine_one(mWeights, mO, mC, K, idx // R, rb * R + idx % R)


def combine_one(mWeights, mO, mC, K: int, t, col):
    """Trace-time: c[t, col] = bf16(sum_k w[t, k] * o[t*K + k, col]), k in order 0..K-1 (bitwise
    deterministic): moe_w2's combine, and the megakernel's combine stage."""
    s = mWeights[t, 0] * mO[t * K, col]
    for k in range(1, K):  # trace-time
        s = s + mWeights[t, k] * mO[t * K + k, col]
    mC[t, col] = s.to(cutlass.BFloat16)
