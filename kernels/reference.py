"""Pure-torch reference of the Kimi-K3-style LatentMoE decode block (see ARCHITECTURE.md).

Device-agnostic. Every op takes `compute_dtype`:
  * torch.float32 (default) is the bf16 path a serving stack runs: bf16 tensors between stages,
    fp32 inside reductions and activations, outputs rounded to the input dtype (bf16);
  * torch.float64 is the oracle: inputs upcast once, no intermediate rounding, float64 outputs.
The candidate kernels are judged against the oracle, with the bf16 path's own error against the
same oracle as the yardstick.

Rounding points of the bf16 path: h (bf16), router logits and weights (fp32), z (bf16), the
expert FFN's gate/up in fp32 with SiTU in fp32 then `a` rounded to bf16, expert outputs kept in
fp32 and combined in fp32, c (bf16), latent norm n (bf16), r (bf16), shared expert activation
(bf16) and output (bf16), block output x + r + shared summed in fp32 then rounded to bf16.

Routing ties: experts are ranked by biased score s + b, descending; equal scores go to the lower
expert index (a stable sort), so the selection is deterministic on every device.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import torch

from .config import ModelConfig

F64 = torch.float64
F32 = torch.float32


def _out(t: torch.Tensor, like_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.Tensor:
    """Oracle results stay float64; the bf16 path rounds to the storage dtype."""
    return t if compute_dtype == F64 else t.to(like_dtype)


def _check_compute(compute_dtype: torch.dtype) -> None:
    if compute_dtype not in (F32, F64):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype}")


# ---------------------------------------------------------------------------------------------
# Sub-ops
# ---------------------------------------------------------------------------------------------


def rmsnorm(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-5, *,
            compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2, -1) + eps) * gamma, statistics in `compute_dtype`."""
    _check_compute(compute_dtype)
    xf = x.to(compute_dtype)
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return _out(xf * inv * gamma.to(compute_dtype), x.dtype, compute_dtype)


def linear(x: torch.Tensor, w: torch.Tensor, *, out_dtype: torch.dtype | None = None,
           compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """y = x @ w.T with accumulation in `compute_dtype`; bf16 path returns `out_dtype` (default x's)."""
    _check_compute(compute_dtype)
    y = x.to(compute_dtype) @ w.to(compute_dtype).T
    return _out(y, out_dtype or x.dtype, compute_dtype)


def situ(g: torch.Tensor, u: torch.Tensor, gate_limit: float = 4.0, up_limit: float = 25.0) -> torch.Tensor:
    """SiTU(g, u) = L_g·tanh(g/L_g)·sigmoid(g) · L_u·tanh(u/L_u), in the dtype of g and u."""
    return gate_limit * torch.tanh(g / gate_limit) * torch.sigmoid(g) * (up_limit * torch.tanh(u / up_limit))


@dataclass(frozen=True)
class Routing:
    """Top-k routing of T tokens: expert ids [T, k] (int32) and combine weights [T, k]."""

    ids: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor  # [T, n_experts], fp32 (float64 in the oracle)


def select_experts(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Ids [T, k] of the top_k experts by scores + bias, descending; ties to the lower index.

    A non-finite biased score (NaN, +-inf) ranks as -inf, as vLLM's router treats it: a NaN never
    wins a slot, and an expert whose score overflowed is chosen only when nothing finite is left."""
    biased = scores + bias.to(scores.dtype)
    biased = torch.where(torch.isfinite(biased), biased, torch.full_like(biased, float("-inf")))
    order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
    return order[:, :top_k].to(torch.int32)


def router(h: torch.Tensor, w_gate: torch.Tensor, bias: torch.Tensor, top_k: int, *,
           scale: float = 1.0, ids: torch.Tensor | None = None,
           compute_dtype: torch.dtype = F32) -> Routing:
    """Sigmoid router with a selection-only bias and renormalised weights.

    logits = h @ w_gate.T (fp32 output); s = sigmoid(logits); select top_k of s + bias;
    w_k = s_k / (sum of selected s + 1e-20) * scale. Pass `ids` to pin the selection (the oracle
    reuses the bf16 path's selection so that a near-tie cannot flip an expert between them).
    """
    _check_compute(compute_dtype)
    logits = linear(h, w_gate, out_dtype=F32, compute_dtype=compute_dtype)
    sel = route_logits(logits, bias, top_k, scale=scale, ids=ids, compute_dtype=compute_dtype)
    return Routing(ids=sel.ids, weights=sel.weights, logits=logits)


@dataclass(frozen=True)
class Selection:
    """The router's choice from given logits: expert ids [T, k] (int32) and weights [T, k]."""

    ids: torch.Tensor
    weights: torch.Tensor


def route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, *, scale: float = 1.0,
                 ids: torch.Tensor | None = None, compute_dtype: torch.dtype = F32) -> Selection:
    """The router after its logits (`router`'s rule): s = sigmoid(logits); top_k of s + bias
    (ties to the lower index); w_k = s_k / (sum of selected s + 1e-20) * scale. `ids` pins the
    selection, as in `router`."""
    _check_compute(compute_dtype)
    s = torch.sigmoid(logits.to(compute_dtype))
    if ids is None:
        ids = select_experts(s, bias, top_k)
    sel = torch.gather(s, 1, ids.long())
    weights = sel / (sel.sum(dim=-1, keepdim=True) + 1e-20) * scale
    return Selection(ids=ids.to(torch.int32), weights=weights)


def expert_ffn(z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, gate_limit: float = 4.0,
               up_limit: float = 25.0, compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """One expert on rows z [R, latent]: [g|u] = z @ w13.T, a = SiTU(g, u), o = a @ w2.T.

    w13 [2I, latent] (first half gate, second half up), w2 [latent, I]. Returns o in fp32
    (float64 in the oracle): expert outputs are combined before any rounding.
    """
    _check_compute(compute_dtype)
    gu = z.to(compute_dtype) @ w13.to(compute_dtype).T
    inter = w13.shape[0] // 2
    a = situ(gu[:, :inter], gu[:, inter:], gate_limit, up_limit)
    if compute_dtype != F64:
        a = a.to(z.dtype).to(compute_dtype)  # `a` is stored in bf16 between the two GEMMs
    return a @ w2.to(compute_dtype).T


def expert_outputs(z: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                   gate_limit: float = 4.0, up_limit: float = 25.0,
                   compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """o [T, k, latent]: each token's selected experts, grouped by expert (each expert runs once
    over all tokens that chose it)."""
    _check_compute(compute_dtype)
    T, k = ids.shape
    out = torch.empty(T, k, w2.shape[1], dtype=compute_dtype, device=z.device)
    flat = ids.reshape(-1).long()
    for e in torch.unique(flat).tolist():
        slots = (flat == e).nonzero(as_tuple=True)[0]
        tok = slots // k
        o = expert_ffn(z[tok], w13[e], w2[e], gate_limit=gate_limit, up_limit=up_limit,
                       compute_dtype=compute_dtype)
        out.view(T * k, -1)[slots] = o
    return out


def combine(o: torch.Tensor, weights: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
            compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """c [T, latent] = sum_k weights[:, k] * o[:, k, :], in `compute_dtype`."""
    _check_compute(compute_dtype)
    c = (o.to(compute_dtype) * weights.to(compute_dtype).unsqueeze(-1)).sum(dim=1)
    return _out(c, out_dtype, compute_dtype)


def routed_experts(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, *, gate_limit: float = 4.0, up_limit: float = 25.0,
                   compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """Expert FFNs for every (token, selected expert) and their weighted combine: c [T, latent]."""
    o = expert_outputs(z, ids, w13, w2, gate_limit=gate_limit, up_limit=up_limit,
                       compute_dtype=compute_dtype)
    return combine(o, weights, out_dtype=z.dtype, compute_dtype=compute_dtype)


def latent_norm_up(c: torch.Tensor, gamma_latent: torch.Tensor, w_up: torch.Tensor,
                   eps: float = 1e-5, *, compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """r = RMSNorm(c) * gamma_latent @ w_up.T (w_up [hidden, latent])."""
    n = rmsnorm(c, gamma_latent, eps, compute_dtype=compute_dtype)
    return linear(n, w_up, compute_dtype=compute_dtype)


def shared_expert(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
                  gate_limit: float = 4.0, up_limit: float = 25.0,
                  compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """Shared expert on the normalised hidden h: SiTU FFN, w_gate_up [2S, hidden], w_down [hidden, S]."""
    o = expert_ffn(h, w_gate_up, w_down, gate_limit=gate_limit, up_limit=up_limit,
                   compute_dtype=compute_dtype)
    return _out(o, h.dtype, compute_dtype)


def gated_situ(gu: torch.Tensor, *, gate_limit: float = 4.0, up_limit: float = 25.0,
               compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """a = SiTU(g, u) of the halves of gu = [g | u] ([T, 2S], fp32 accumulators of a gate/up
    projection), in `compute_dtype`; the bf16 path rounds once."""
    _check_compute(compute_dtype)
    g = gu.to(compute_dtype)
    S = g.shape[-1] // 2
    return _out(situ(g[..., :S], g[..., S:], gate_limit, up_limit), torch.bfloat16, compute_dtype)


def residual(x: torch.Tensor, r: torch.Tensor, shared: torch.Tensor, *,
             compute_dtype: torch.dtype = F32) -> torch.Tensor:
    """out = x + r + shared, summed in `compute_dtype`."""
    _check_compute(compute_dtype)
    y = x.to(compute_dtype) + r.to(compute_dtype) + shared.to(compute_dtype)
    return _out(y, x.dtype, compute_dtype)


# ---------------------------------------------------------------------------------------------
# Weights and the whole block
# ---------------------------------------------------------------------------------------------


@dataclass
class BlockWeights:
    gamma_pre: torch.Tensor  # [hidden]
    w_gate: torch.Tensor  # [n_experts, hidden]   router
    bias: torch.Tensor  # [n_experts] fp32, selection only
    w_down: torch.Tensor  # [latent, hidden]
    w13: torch.Tensor  # [n_experts, 2*expert_inter, latent]
    w2: torch.Tensor  # [n_experts, latent, expert_inter]
    gamma_latent: torch.Tensor  # [latent]
    w_up: torch.Tensor  # [hidden, latent]
    w_shared_gate_up: torch.Tensor  # [2*shared_inter, hidden]
    w_shared_down: torch.Tensor  # [hidden, shared_inter]

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    # One stream per tensor: adding a tensor never perturbs the others.
    sub = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
    g = torch.Generator(device=device)
    g.manual_seed(sub)
    return g


def _randn_into(out: torch.Tensor, std: float, gen: torch.Generator, chunk_rows: int = 1) -> None:
    """Fill `out` (any dtype) with N(0, std^2) in fp32 chunks, so a 60 GB bf16 tensor never needs
    a 120 GB fp32 temporary."""
    flat = out.view(out.shape[0], -1) if out.dim() > 1 else out.view(1, -1)
    rows = flat.shape[0]
    step = max(chunk_rows, 1)
    for r0 in range(0, rows, step):
        blk = flat[r0:r0 + step]
        tmp = torch.randn(blk.shape, generator=gen, device=out.device, dtype=F32)
        blk.copy_(tmp.mul_(std))


def make_weights(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> BlockWeights:
    """Deterministic synthetic weights, fan-in scaled (std 1/sqrt(fan_in)), generated on `device`.

    The same (cfg, seed, device type) always gives the same bytes. The routed experts are filled
    one expert at a time, so k3 (~60 GB in bf16) fits on one H200.
    """
    device = torch.device(device)

    def mat(name, shape, fan_in, chunk_rows):
        t = torch.empty(shape, dtype=dtype, device=device)
        _randn_into(t, fan_in ** -0.5, _generator(seed, name, device), chunk_rows)
        return t

    def gamma(name, n):
        t = torch.empty(n, dtype=F32, device=device)
        _randn_into(t, 0.05, _generator(seed, name, device))
        return (t + 1.0).to(dtype)

    H, L, E, I, S = cfg.hidden, cfg.latent, cfg.n_experts, cfg.expert_inter, cfg.shared_inter
    bias = torch.empty(E, dtype=F32, device=device)
    _randn_into(bias, 0.02, _generator(seed, "bias", device))
    big = 1 << 16  # rows per fp32 chunk for the dense matrices
    return BlockWeights(
        gamma_pre=gamma("gamma_pre", H),
        w_gate=mat("w_gate", (E, H), H, big),
        bias=bias,
        w_down=mat("w_down", (L, H), H, big),
        w13=mat("w13", (E, 2 * I, L), L, 1),
        w2=mat("w2", (E, L, I), I, 1),
        gamma_latent=gamma("gamma_latent", L),
        w_up=mat("w_up", (H, L), L, big),
        w_shared_gate_up=mat("w_shared_gate_up", (2 * S, H), H, big),
        w_shared_down=mat("w_shared_down", (H, S), S, big),
    )


def make_hidden(cfg: ModelConfig, batch: int, device: str | torch.device = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A decode batch of residual-stream inputs x [batch, hidden] (unit variance)."""
    device = torch.device(device)
    x = torch.empty(batch, cfg.hidden, dtype=dtype, device=device)
    _randn_into(x, 1.0, _generator(seed, f"x{batch}", device), 1 << 16)
    return x


@dataclass
class BlockTrace:
    """Every intermediate of one block evaluation (for checking the ops one by one)."""

    h: torch.Tensor
    routing: Routing
    z: torch.Tensor
    c: torch.Tensor
    r: torch.Tensor
    shared: torch.Tensor
    out: torch.Tensor


def moe_block(x: torch.Tensor, w: BlockWeights, cfg: ModelConfig, *,
              compute_dtype: torch.dtype = F32, ids: torch.Tensor | None = None,
              trace: bool = False):
    """The decode step of the LatentMoE block: x [T, hidden] -> x + r + shared.

    `ids` pins the expert selection (see `router`). Returns the output, or a BlockTrace of all
    intermediates when `trace`.
    """
    _check_compute(compute_dtype)
    kw = dict(gate_limit=cfg.situ_gate_limit, up_limit=cfg.situ_up_limit, compute_dtype=compute_dtype)
    h = rmsnorm(x, w.gamma_pre, cfg.eps, compute_dtype=compute_dtype)
    routing = router(h, w.w_gate, w.bias, cfg.top_k, scale=cfg.routed_scale, ids=ids,
                     compute_dtype=compute_dtype)
    z = linear(h, w.w_down, compute_dtype=compute_dtype)
    c = routed_experts(z, routing.ids, routing.weights, w.w13, w.w2, **kw)
    r = latent_norm_up(c, w.gamma_latent, w.w_up, cfg.eps, compute_dtype=compute_dtype)
    shared = shared_expert(h, w.w_shared_gate_up, w.w_shared_down, **kw)
    out = residual(x, r, shared, compute_dtype=compute_dtype)
    if trace:
        return BlockTrace(h=h, routing=routing, z=z, c=c, r=r, shared=shared, out=out)
    return out


# Reference ops by name: what `fasttrack check --op NAME` and the manifest's `reference` use.
REFERENCE_OPS = {
    "rmsnorm": rmsnorm,
    "linear": linear,
    "router": router,
    "route_logits": route_logits,
    "latent_down": linear,
    "expert_ffn": expert_ffn,
    "expert_outputs": expert_outputs,
    "combine": combine,
    "routed_experts": routed_experts,
    "latent_norm_up": latent_norm_up,
    "shared_expert": shared_expert,
    "gated_situ": gated_situ,
    "residual": residual,
    "moe_block": moe_block,
}
