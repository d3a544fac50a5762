"""The torch baseline of the LatentMoE block: what plain torch on an H200 does, under one CUDA graph.

Dense projections through cuBLAS (`F.linear`, bf16), the router with `torch.topk`, and the routed
experts grouped by expert with `torch._grouped_mm` (CUTLASS grouped GEMM; tokens sorted by
expert, one offset per expert: a selected expert's weights are read once, an unselected one not
at all, with static shapes, so the whole block is capturable). SiTU and the combine in fp32
elementwise torch. Numerically it is a bf16 serving path (gate/up rounded to bf16 by the grouped
GEMM), not the reference; it is the yardstick for time, the reference's fp32 path for error.

Runs on the GPU host (torch with CUDA); imports nothing of the DSL.
"""

from __future__ import annotations


def _rmsnorm(x, gamma, eps):
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).to(x.dtype)


def _situ(g, u, gl, ul):
    import torch

    return gl * torch.tanh(g / gl) * torch.sigmoid(g) * (ul * torch.tanh(u / ul))


def grouped_mm_available() -> str | None:
    """None when `torch._grouped_mm` runs here, else why not."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm does not exist in this torch"
    try:
        a = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([8, 8, 24, 32], device="cuda", dtype=torch.int32)
        y = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
        ref = torch.cat([a[:8] @ b[0].T, a[8:24] @ b[2].T, a[24:] @ b[3].T])
        if not torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-1):
            return "torch._grouped_mm gave a wrong result on a known case"
    except Exception as e:  # an unsupported GPU or layout: report, do not crash the proof
        return f"torch._grouped_mm failed: {type(e).__name__}: {e}"
    return None


def torch_block(x, w, cfg):
    """out = block(x) in plain torch (see the module docstring); capturable in a CUDA graph."""
    import torch
    import torch.nn.functional as F

    T = x.shape[0]
    K, I, E = cfg.top_k, cfg.expert_inter, cfg.n_experts
    gl, ul = cfg.situ_gate_limit, cfg.situ_up_limit
    h = _rmsnorm(x, w.gamma_pre, cfg.eps)
    logits = F.linear(h, w.w_gate).float()
    s = torch.sigmoid(logits)
    ids = torch.topk(s + w.bias, K, dim=-1).indices
    sel = torch.gather(s, 1, ids)
    weights = sel / (sel.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scale
    z = F.linear(h, w.w_down)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)  # bincount would sync (data-dependent size)
    zs = z[order // K]
    gu = torch._grouped_mm(zs, w.w13.transpose(1, 2), offs=offs)
    a = _situ(gu[:, :I].float(), gu[:, I:].float(), gl, ul).to(torch.bfloat16)
    o_sorted = torch._grouped_mm(a, w.w2.transpose(1, 2), offs=offs)
    o = torch.empty_like(o_sorted)
    o[order] = o_sorted
    c = (o.view(T, K, -1).float() * weights.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    n = _rmsnorm(c, w.gamma_latent, cfg.eps)
    r = F.linear(n, w.w_up)
    gus = F.linear(h, w.w_shared_gate_up)
    S = cfg.shared_inter
    a_s = _situ(gus[:, :S].float(), gus[:, S:].float(), gl, ul).to(torch.bfloat16)
    sh = F.linear(a_s, w.w_shared_down)
    return (x.float() + r.float() + sh.float()).to(x.dtype)
