"""Expert parallelism of the LatentMoE block over the N ranks (GPUs) of one host.

Rank r of N holds the routed experts r*E/N .. (r+1)*E/N - 1 (a contiguous range, `ExpertShard`)
and every dense weight (replicated). One decode step on each rank, over that rank's own T_r tokens
(kernels/reference.py `moe_block` gives the semantics and roundings; they are kept exactly):

  1 route     h = RMSNorm(x) * gamma_pre, the router's ids [T_r, k] and weights, z = h @ W_down.T
              (bf16): the routed experts consume z, so z is what travels.
  2 dispatch  `plan_dispatch`: each slot (t*k + j) goes to the rank that owns ids[t, j]. A token
              whose experts sit on one rank several times is sent there once (its z row once, one
              (row, local expert) pair per slot). The counts (tokens, slots) per peer are exchanged
              first (all_to_all_single of N x 2 int64), then the z rows (bf16) and the pairs (int64).
  3 experts   the owner runs each local expert once over every row that chose it, rows in source
              rank order then token order: exactly the rows, in the order, that `moe_block` on the
              concatenated batch (rank 0's tokens first) gives that expert. `LocalExperts` is the
              hook: `TorchLocalExperts` (pure torch, any device) here; on the GPU host the
              moe_w13 / moe_w2 cubins plug in through `local_grouping` (`CubinLocalExperts`).
  4 return    each slot's expert output o (fp32, unrounded, as the reference keeps it) goes back to
              the slot's rank in the order it came (all_to_all_single with the splits reversed).
  5 finish    c = reference.combine(o [T_r, k, L], weights): sum over k in the fixed order
              0..k-1 in fp32, rounded to bf16 once; then the latent norm and up-projection, the
              shared expert on h, and x + r + shared.

So the EP block's expert outputs equal the one-GPU reference's bit for bit (same rows, same
order, same ops), and c equals `reference.routed_experts` on the gathered (z, ids, weights).

Communication goes through torch.distributed (NCCL on GPUs, gloo on CPUs); the process group is
the caller's. The counts are read on the host (they size the payload exchange), so a step
synchronizes the host once per exchange and is not CUDA-graph capturable; a fixed-capacity
exchange (every rank sends room for T_r*k slots to every peer) would be, at N times the bytes.
NVLink multicast stays off: `multicast_off_env` sets the variables every process this module
starts must carry.

Imports torch only (kernels.launch / kernels.build lazily, on the GPU path): runs on the GPU host.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from . import reference as R
from .config import ModelConfig

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COMM_PHASES = ("dispatch", "return")
PHASES = ("route", "dispatch", "experts", "return", "finish")


class EPError(ValueError):
    """An expert-parallel layout that cannot be built (degree, rank, token counts)."""


def multicast_off_env(environ: dict | None = None) -> dict:
    """Set NVLink multicast off in `environ` (default os.environ) and return it: NCCL's NVLS,
    torch's symmetric-memory multicast and NVSHMEM's NVLS, whatever was there before."""
    env = os.environ if environ is None else environ
    env.update(MULTICAST_OFF)
    return env


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of `world` holds experts first .. first + per_rank - 1 of `n_experts`."""

    n_experts: int
    world: int
    rank: int

    def __post_init__(self) -> None:
        if self.world < 1 or self.n_experts % self.world:
            raise EPError(f"expert-parallel degree {self.world} must divide the {self.n_experts} experts")
        if not 0 <= self.rank < self.world:
            raise EPError(f"rank {self.rank} outside 0..{self.world - 1}")

    @property
    def per_rank(self) -> int:
        return self.n_experts // self.world

    @property
    def first(self) -> int:
        return self.rank * self.per_rank

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank holding each expert id (same shape, int64)."""
        return ids.long() // self.per_rank


def shard_weights(w: R.BlockWeights, shard: ExpertShard) -> R.BlockWeights:
    """The weights rank `shard.rank` holds: every dense tensor, and its experts' w13 / w2 (views:
    `.contiguous()` is a no-op on a contiguous range; clone to free the rest)."""
    lo, hi = shard.first, shard.first + shard.per_rank
    return replace(w, w13=w.w13[lo:hi], w2=w.w2[lo:hi])


# ---------------------------------------------------------------------------------------------
# Dispatch bookkeeping (pure torch; the same on every device)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchPlan:
    """Where one rank's T*k slots go, in the order they are sent (by destination, then slot).

    order        [T*k] the slots (t*k + j), sorted by destination rank (stable: token, then j)
    slot_counts  [N] slots sent to each rank
    token_counts [N] distinct tokens sent to each rank
    token_rows   [sum token_counts] the tokens sent, per destination in ascending order
    slot_row     [T*k] for each slot of `order`, its row within its destination's token block
    slot_expert  [T*k] for each slot of `order`, its expert's index on the destination rank
    """

    order: torch.Tensor
    slot_counts: torch.Tensor
    token_counts: torch.Tensor
    token_rows: torch.Tensor
    slot_row: torch.Tensor
    slot_expert: torch.Tensor


def plan_dispatch(ids: torch.Tensor, shard: ExpertShard) -> DispatchPlan:
    """The dispatch of routing `ids` [T, k] (this rank's tokens) under `shard`'s layout."""
    T, k = ids.shape
    N = shard.world
    flat = ids.reshape(-1).long()
    dest = flat // shard.per_rank
    order = torch.sort(dest, stable=True).indices
    slot_counts = torch.bincount(dest, minlength=N)
    tok = torch.arange(T * k, device=ids.device) // k
    key = dest * max(T, 1) + tok  # (destination, token), unique per pair
    pairs = torch.unique(key)  # sorted: destination-major, tokens ascending
    token_counts = torch.bincount(pairs // max(T, 1), minlength=N)
    token_start = torch.cumsum(token_counts, 0) - token_counts
    pos = torch.searchsorted(pairs, key[order])
    dest_o = dest[order]
    return DispatchPlan(order=order, slot_counts=slot_counts, token_counts=token_counts,
                        token_rows=pairs % max(T, 1), slot_row=pos - token_start[dest_o],
                        slot_expert=flat[order] - dest_o * shard.per_rank)


@dataclass(frozen=True)
class Received:
    """What a rank's experts get: z rows from every source (source rank order), and per slot
    the row in `z` and the local expert, in the order the slots arrived."""

    z: torch.Tensor  # [R_tok, latent] bf16
    rows: torch.Tensor  # [R_slots] int64
    experts: torch.Tensor  # [R_slots] int64, 0 .. per_rank - 1
    slot_counts: list[int]  # slots from each source rank
    token_counts: list[int]


def _all_to_all(out_rows: list[int], inp: torch.Tensor, in_rows: list[int], group) -> torch.Tensor:
    import torch.distributed as dist

    out = inp.new_empty((sum(out_rows),) + tuple(inp.shape[1:]))
    dist.all_to_all_single(out, inp.contiguous(), out_rows, in_rows, group=group)
    return out


def dispatch(z: torch.Tensor, plan: DispatchPlan, group=None) -> Received:
    """Step 2: counts first, then z rows and (row, local expert) pairs, to every rank."""
    counts = torch.stack([plan.token_counts, plan.slot_counts], 1).to(torch.int64)
    peer = _all_to_all([1] * counts.shape[0], counts.to(z.device), [1] * counts.shape[0], group).cpu()
    tok_in, slot_in = peer[:, 0].tolist(), peer[:, 1].tolist()
    tok_out, slot_out = plan.token_counts.tolist(), plan.slot_counts.tolist()
    z_recv = _all_to_all(tok_in, z[plan.token_rows], tok_out, group)
    pairs = torch.stack([plan.slot_row, plan.slot_expert], 1).to(device=z.device, dtype=torch.int64)
    p_recv = _all_to_all(slot_in, pairs, slot_out, group)
    # rows are per source block: offset by the source's first row in z_recv
    tok_start = torch.tensor([0] + tok_in[:-1], dtype=torch.int64).cumsum(0)
    src = torch.repeat_interleave(torch.arange(len(slot_in)), torch.tensor(slot_in, dtype=torch.int64))
    rows = p_recv[:, 0] + tok_start[src].to(p_recv.device)
    return Received(z=z_recv, rows=rows, experts=p_recv[:, 1], slot_counts=slot_in, token_counts=tok_in)


def give_back(o_recv: torch.Tensor, rec: Received, plan: DispatchPlan, group=None) -> torch.Tensor:
    """Step 4: each slot's output to the rank it came from; returns o [T*k, latent] in slot order."""
    back = _all_to_all(plan.slot_counts.tolist(), o_recv, rec.slot_counts, group)
    o = torch.empty_like(back)
    o[plan.order.to(back.device)] = back
    return o


# ---------------------------------------------------------------------------------------------
# The routed experts over a rank's received rows
# ---------------------------------------------------------------------------------------------


class LocalExperts(Protocol):
    def __call__(self, rec: Received) -> torch.Tensor:
        """o [R_slots, latent] fp32 (float64 in the oracle): each received slot's expert output."""


@dataclass
class TorchLocalExperts:
    """The reference path: each local expert once over its rows, in arrival order."""

    w13: torch.Tensor  # [per_rank, 2I, L]
    w2: torch.Tensor  # [per_rank, L, I]
    cfg: ModelConfig
    compute_dtype: torch.dtype = R.F32

    def __call__(self, rec: Received) -> torch.Tensor:
        o = torch.empty(rec.rows.numel(), self.w2.shape[1], dtype=self.compute_dtype, device=rec.z.device)
        for e in torch.unique(rec.experts).tolist():
            m = (rec.experts == e).nonzero(as_tuple=True)[0]
            o[m] = R.expert_ffn(rec.z[rec.rows[m]], self.w13[e], self.w2[e], gate_limit=self.cfg.situ_gate_limit,
                                up_limit=self.cfg.situ_up_limit, compute_dtype=self.compute_dtype)
        return o


def local_grouping(rows: torch.Tensor, experts: torch.Tensor, max_rows: int, top_k: int,
                   n_local: int) -> dict:
    """The moe_w13 / moe_w2 cubins' routing inputs for a rank's received slots.

    The cubins (kernels/ops/moe_experts.py) take a batch of `max_rows` tokens (z rows), k =
    `top_k` slots per token (slot = row * k + j), and the router's grouping by expert. Here row r
    of the received z has its slots (at most k: a token's experts are distinct) at j = 0, 1, ...
    in arrival order. Returns {n_groups [1], group_expert [G], group_start [G+1], sorted_slots
    [max_rows*k]} (int32, G = min(max_rows*k, n_local), the router's conventions: groups by
    ascending local expert, a group's slots in row order, entries past n_groups -1 / the slot
    count; sorted_slots ends with the unused slots, so it is a permutation as the router's is)
    and `slot` [R_slots] (int64): each received slot's virtual slot, where moe_w2 writes its o.
    """
    n = rows.numel()
    dev = rows.device
    if n and int(rows.max()) >= max_rows:
        raise EPError(f"received row {int(rows.max())} exceeds the kernels' batch {max_rows}")
    # rows arrive non-decreasing (source blocks in order, tokens ascending): runs give j
    _, run = torch.unique_consecutive(rows, return_counts=True)
    if run.numel() and int(run.max()) > top_k:
        raise EPError(f"a row has {int(run.max())} slots on one rank, more than top_k {top_k}")
    run_start = torch.repeat_interleave(torch.cumsum(run, 0) - run, run)
    slot = rows.long() * top_k + (torch.arange(n, device=dev) - run_start)
    by_expert = torch.sort(experts.long(), stable=True)
    sorted_valid = slot[by_expert.indices]
    uniq, counts = torch.unique_consecutive(by_expert.values, return_counts=True)
    G = min(max_rows * top_k, n_local)
    g = uniq.numel()
    group_expert = torch.full((G,), -1, dtype=torch.int32, device=dev)
    group_expert[:g] = uniq.to(torch.int32)
    group_start = torch.full((G + 1,), n, dtype=torch.int32, device=dev)
    group_start[:g] = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    unused = torch.ones(max_rows * top_k, dtype=torch.bool, device=dev)
    unused[slot] = False
    sorted_slots = torch.cat([sorted_valid, unused.nonzero(as_tuple=True)[0]]).to(torch.int32)
    return {"n_groups": torch.tensor([g], dtype=torch.int32, device=dev), "group_expert": group_expert,
            "group_start": group_start, "sorted_slots": sorted_slots, "slot": slot}


KERNEL_MAX_BATCH = 64  # kernels/ops/moe_experts.py MAX_BATCH: the most z rows one launch takes


def cubin_batch(world: int, tokens_per_rank: int) -> int:
    """The batch the EP experts' cubins are built for: every token of the host may land on one
    rank (N * T_r rows, the hot-expert case), at most one launch's KERNEL_MAX_BATCH."""
    return max(1, min(world * tokens_per_rank, KERNEL_MAX_BATCH))


def cubin_variants(cfg: ModelConfig, n_local: int, batch: int) -> list[tuple[str, dict, dict]]:
    """(kernel, shape, tunables) of the two cubins `CubinLocalExperts` launches over `n_local`
    experts at `batch` rows (`cubin_batch`), with the block's tunables at that batch."""
    from kernels.block import block_tunables

    shape = {"batch": batch, "n_experts": n_local, "latent": cfg.latent, "expert_inter": cfg.expert_inter,
             "top_k": cfg.top_k}
    return [(name, dict(shape), block_tunables(name, batch)) for name in ("moe_w13", "moe_w2")]


class CubinLocalExperts:
    """The GPU path of step 3: the moe_w13 and moe_w2 cubins over the local experts (built for
    `cubin_variants`). Untested on a GPU here; on CPU its wiring is tested with stand-in kernels
    that follow the cubins' contract, and its routing inputs against the router's grouping.

    Per step, the received rows in chunks of `max_rows` (the cubins' batch: all of them unless
    N * T_r > KERNEL_MAX_BATCH, where each chunk re-reads its experts' weights): copy the chunk's
    z rows into rows 0.. of a [max_rows, L] buffer, build its grouping (`local_grouping`),
    launch moe_w13(z, w13_local, n_groups, group_expert, group_start, sorted_slots, act) and
    moe_w2(act, w2_local, weights, ..., o, counters, c), and read o[slot]: moe_w2's fp32 per-slot
    outputs before its own combine (its c, over placeholder weights, is discarded: the weighted
    combine happens on the token's rank, in the one-GPU order). Rows past the chunk hold stale z
    that no group reads.
    """

    def __init__(self, cfg: ModelConfig, shard: ExpertShard, w13_local: torch.Tensor, w2_local: torch.Tensor,
                 max_rows: int, kernels: dict | None = None, root=None):
        self.cfg, self.shard, self.max_rows = cfg, shard, max_rows
        self.w13, self.w2 = w13_local.contiguous(), w2_local.contiguous()
        if kernels is None:
            from kernels.build import DEFAULT_ROOT, find_artifact
            from kernels.launch import CubinKernel

            kernels = {name: CubinKernel.from_dir(find_artifact(name, shape, tun, root=root or DEFAULT_ROOT).dir)
                       for name, shape, tun in cubin_variants(cfg, shard.per_rank, max_rows)}
        self.k = kernels
        for kern in self.k.values():
            kern.load()
        dev, T, K, L, I = self.w13.device, max_rows, cfg.top_k, cfg.latent, cfg.expert_inter
        spec = next(p for p in self.k["moe_w2"].meta["params"] if p["name"] == "counters")["spec"]
        self.buf = {"z": torch.zeros(T, L, dtype=torch.bfloat16, device=dev),
                    "act": torch.empty(T * K, I, dtype=torch.bfloat16, device=dev),
                    "weights": torch.zeros(T, K, dtype=torch.float32, device=dev),
                    "o": torch.empty(T * K, L, dtype=torch.float32, device=dev),
                    "c": torch.empty(T, L, dtype=torch.bfloat16, device=dev),
                    "counters": torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=dev)}

    def __call__(self, rec: Received) -> torch.Tensor:
        b, B = self.buf, self.max_rows
        o = torch.empty(rec.rows.numel(), self.cfg.latent, dtype=torch.float32, device=rec.z.device)
        for r0 in range(0, rec.z.shape[0], B):
            idx = ((rec.rows >= r0) & (rec.rows < r0 + B)).nonzero(as_tuple=True)[0]
            if not idx.numel():
                continue
            g = local_grouping(rec.rows[idx] - r0, rec.experts[idx], B, self.cfg.top_k, self.shard.per_rank)
            z = rec.z[r0: r0 + B]
            b["z"][: z.shape[0]].copy_(z)
            args = [g["n_groups"], g["group_expert"], g["group_start"], g["sorted_slots"]]
            self.k["moe_w13"](b["z"], self.w13, *args, b["act"])
            self.k["moe_w2"](b["act"], self.w2, b["weights"], *args, b["o"], b["counters"], b["c"])
            o[idx] = b["o"][g["slot"]]
        return o


# ---------------------------------------------------------------------------------------------
# The block
# ---------------------------------------------------------------------------------------------


class PhaseClock:
    """Wall time per phase of one step: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def phases_us(self) -> dict[str, float]:
        """{phase: us} between consecutive marks (the phase is named by its closing mark)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6
        return out


@dataclass
class StepTrace:
    """One rank's step: its output and what the checks need (routing, z, c, the expert rows)."""

    out: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    z: torch.Tensor
    c: torch.Tensor
    c_acc: torch.Tensor  # the combine before its rounding (fp32): where a reordered sum shows
    experts_used: int  # distinct local experts that ran (their weights were read)
    phases_us: dict[str, float]


class EPBlock:
    """The LatentMoE block on one rank of an expert-parallel group (module docstring)."""

    def __init__(self, cfg: ModelConfig, weights: R.BlockWeights, shard: ExpertShard, *, group=None,
                 experts: LocalExperts | None = None, compute_dtype: torch.dtype = R.F32):
        self.cfg, self.shard, self.group, self.cd = cfg, shard, group, compute_dtype
        self.w = shard_weights(weights, shard) if weights.w13.shape[0] == cfg.n_experts else weights
        if self.w.w13.shape[0] != shard.per_rank:
            raise EPError(f"rank {shard.rank} holds {self.w.w13.shape[0]} experts, expected {shard.per_rank}")
        self.experts = experts or TorchLocalExperts(self.w.w13, self.w.w2, cfg, compute_dtype)

    def route(self, x: torch.Tensor, ids: torch.Tensor | None):
        cfg, w, cd = self.cfg, self.w, self.cd
        h = R.rmsnorm(x, w.gamma_pre, cfg.eps, compute_dtype=cd)
        routing = R.router(h, w.w_gate, w.bias, cfg.top_k, scale=cfg.routed_scale, ids=ids, compute_dtype=cd)
        z = R.linear(h, w.w_down, compute_dtype=cd)
        return h, routing, z

    def combine(self, o: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k w_k o_k in the fixed k order, as the one-GPU block (reference.combine), before
        its one rounding: fp32 (float64 in the oracle); c is this rounded to bf16."""
        T, K = weights.shape
        return R.combine(o.view(T, K, self.cfg.latent), weights, out_dtype=self.cd, compute_dtype=self.cd)

    def finish(self, x, h, c):
        cfg, w, cd = self.cfg, self.w, self.cd
        kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit, compute_dtype=cd)
        r = R.latent_norm_up(c, w.gamma_latent, w.w_up, cfg.eps, compute_dtype=cd)
        shared = R.shared_expert(h, w.w_shared_gate_up, w.w_shared_down, **kw)
        return R.residual(x, r, shared, compute_dtype=cd)

    def step(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> StepTrace:
        """One decode step over this rank's tokens x [T_r, hidden] (T_r may be 0); collective:
        every rank of the group calls it once. `ids` pins this rank's selection [T_r, k]."""
        clock = PhaseClock(x.device)
        clock.mark("start")
        h, routing, z = self.route(x, ids)
        plan = plan_dispatch(routing.ids, self.shard)
        clock.mark("route")
        rec = dispatch(z, plan, self.group)
        clock.mark("dispatch")
        o_recv = self.experts(rec)
        clock.mark("experts")
        o = give_back(o_recv, rec, plan, self.group)
        clock.mark("return")
        c_acc = self.combine(o, routing.weights)
        c = c_acc if self.cd == R.F64 else c_acc.to(z.dtype)
        out = self.finish(x, h, c)
        clock.mark("finish")
        return StepTrace(out=out, ids=routing.ids, weights=routing.weights, z=z, c=c, c_acc=c_acc,
                         experts_used=int(torch.unique(rec.experts).numel()), phases_us=clock.phases_us())

