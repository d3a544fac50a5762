"""The reference block: sub-ops against each other, against hand-computed values and against the
float64 oracle, on the tiny preset (CPU, seconds)."""

import math

import pytest
import torch

from kernels import reference as R
from kernels.config import get_config

F64 = torch.float64


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("tiny")
    return cfg, R.make_weights(cfg, "cpu", seed=0)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_rmsnorm_matches_definition():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    g = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
    y = R.rmsnorm(x, g, 1e-5, compute_dtype=F64)
    xd = x.double()
    want = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * g.double()
    assert torch.allclose(y, want, rtol=1e-12, atol=0)
    assert R.rmsnorm(x, g).dtype == torch.bfloat16


def test_linear_fp32_accumulation_and_out_dtype():
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    w = torch.randn(16, 128, dtype=torch.bfloat16)
    y32 = R.linear(x, w, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert rel(y32, R.linear(x, w, compute_dtype=F64)) < 1e-6
    assert R.linear(x, w).dtype == torch.bfloat16


def test_situ_values():
    g = torch.tensor([0.0, 1.0, -3.0, 40.0], dtype=F64)
    u = torch.tensor([2.0, -1.0, 100.0, 0.5], dtype=F64)
    want = [4 * math.tanh(a / 4) / (1 + math.exp(-a)) * 25 * math.tanh(b / 25) for a, b in zip(g.tolist(), u.tolist())]
    assert torch.allclose(R.situ(g, u), torch.tensor(want, dtype=F64), rtol=1e-12)
    # The limits bound the activation: |SiTU| < 4 * 25.
    assert R.situ(torch.tensor([1e6], dtype=F64), torch.tensor([1e6], dtype=F64)).item() <= 100.0


def test_router_selection_uses_bias_but_weights_do_not():
    h = torch.randn(4, 64, dtype=torch.bfloat16)
    wg = torch.randn(16, 64, dtype=torch.bfloat16) * 0.1
    bias = torch.zeros(16)
    bias[7] = 10.0  # forces expert 7 into every token's selection
    r = R.router(h, wg, bias, 4)
    assert (r.ids == 7).any(dim=1).all()
    s = torch.sigmoid(r.logits.double())
    sel = torch.gather(s, 1, r.ids.long())
    assert torch.allclose(r.weights.double(), sel / sel.sum(-1, keepdim=True), rtol=1e-6)
    assert torch.allclose(r.weights.sum(-1), torch.ones(4), atol=1e-6)


def test_router_ties_go_to_lower_index():
    scores = torch.full((2, 8), 0.5)
    ids = R.select_experts(scores, torch.zeros(8), 3)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    scores[1, 5] = 0.9
    assert R.select_experts(scores, torch.zeros(8), 3)[1].tolist() == [5, 0, 1]


def test_grouped_experts_equal_per_token_loop(tiny):
    cfg, W = tiny
    z = torch.randn(5, cfg.latent, dtype=torch.bfloat16)
    # all tokens share expert 3; others distinct
    ids = torch.tensor([[3, 0, 1, 2], [3, 4, 5, 6], [3, 7, 8, 9], [3, 10, 11, 12], [3, 13, 14, 15]],
                       dtype=torch.int32)
    o = R.expert_outputs(z, ids, W.w13, W.w2, compute_dtype=F64)
    for t in range(5):
        for j in range(4):
            e = int(ids[t, j])
            want = R.expert_ffn(z[t:t + 1], W.w13[e], W.w2[e], compute_dtype=F64)[0]
            assert torch.allclose(o[t, j], want, rtol=1e-12, atol=1e-15)


def test_block_composes_sub_ops(tiny):
    cfg, W = tiny
    x = R.make_hidden(cfg, 6)
    tr = R.moe_block(x, W, cfg, trace=True)
    h = R.rmsnorm(x, W.gamma_pre, cfg.eps)
    assert torch.equal(tr.h, h)
    z = R.linear(h, W.w_down)
    assert torch.equal(tr.z, z)
    c = R.combine(R.expert_outputs(z, tr.routing.ids, W.w13, W.w2), tr.routing.weights)
    assert torch.equal(tr.c, c)
    r = R.latent_norm_up(c, W.gamma_latent, W.w_up, cfg.eps)
    s = R.shared_expert(h, W.w_shared_gate_up, W.w_shared_down)
    assert torch.equal(tr.out, R.residual(x, r, s))


@pytest.mark.parametrize("preset", ["tiny", "mini"])
def test_bf16_path_close_to_oracle(preset):
    cfg = get_config(preset)
    W = R.make_weights(cfg, "cpu", seed=1)
    x = R.make_hidden(cfg, 4, seed=1)
    tr = R.moe_block(x, W, cfg, trace=True)
    oracle = R.moe_block(x, W, cfg, compute_dtype=F64, ids=tr.routing.ids)
    assert oracle.dtype == F64
    err = rel(tr.out, oracle)
    # bf16 storage between stages: ~2^-8 relative rounding per stage, a handful of stages.
    assert 1e-4 < err < 2e-2, err


def test_oracle_detects_a_wrong_block(tiny):
    cfg, W = tiny
    x = R.make_hidden(cfg, 4)
    tr = R.moe_block(x, W, cfg, trace=True)
    oracle = R.moe_block(x, W, cfg, compute_dtype=F64, ids=tr.routing.ids)
    wrong = R.residual(x, torch.zeros_like(tr.r), tr.shared)  # drops the routed path
    assert rel(wrong, oracle) > 10 * rel(tr.out, oracle)


def test_weights_are_deterministic_and_fan_in_scaled():
    cfg = get_config("mini")
    a = R.make_weights(cfg, "cpu", seed=3)
    b = R.make_weights(cfg, "cpu", seed=3)
    c = R.make_weights(cfg, "cpu", seed=4)
    assert torch.equal(a.w13, b.w13) and torch.equal(a.w_up, b.w_up)
    assert not torch.equal(a.w13, c.w13)
    assert a.w13.dtype == torch.bfloat16 and a.bias.dtype == torch.float32
    std = a.w_down.float().std().item()
    assert abs(std - cfg.hidden ** -0.5) / cfg.hidden ** -0.5 < 0.05
    assert a.w13.shape == (cfg.n_experts, 2 * cfg.expert_inter, cfg.latent)
    assert a.w2.shape == (cfg.n_experts, cfg.latent, cfg.expert_inter)


def test_k3_block_fits_one_h200():
    cfg = get_config("k3")
    gb = cfg.total_params() * 2 / 1e9
    assert 55 < gb < 64  # ~60 GB of bf16 weights, well inside 141 GB


def test_compute_dtype_is_checked():
    with pytest.raises(ValueError, match="compute_dtype"):
        R.rmsnorm(torch.ones(1, 8), torch.ones(8), compute_dtype=torch.float16)
