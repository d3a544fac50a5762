"""Routed experts (kernels/ops/moe_experts.py): the two ops' references compose to the project's
routed_experts for every routing pattern on the mini preset (tiny's widths are not multiples of
the 32-wide k step the ops are planned for); contract with the manifest; plans;
k3 builds (64-bit expert offsets, both batch paths)."""

from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.config import get_config
from kernels.manifest import load_manifest
from kernels.ops import moe_experts as MX
from validation.numerics import ROUTINGS, routing_ids

CFG = get_config("mini")
K3 = {"batch": 1, "n_experts": 896, "latent": 3584, "expert_inter": 3072, "top_k": 16}


def _shape(T):
    return {"batch": T, "n_experts": CFG.n_experts, "latent": CFG.latent, "expert_inter": CFG.expert_inter,
            "top_k": CFG.top_k}


@pytest.mark.parametrize("pattern", ROUTINGS)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_up_then_down_references_equal_routed_experts(pattern, T):
    w = reference.make_weights(CFG)
    g = torch.Generator().manual_seed(T)
    ids = routing_ids(T, CFG.n_experts, CFG.top_k, pattern, g, "cpu")
    z = torch.randn(T, CFG.latent, generator=g).to(torch.bfloat16)
    wts = torch.rand(T, CFG.top_k, generator=g) + 0.05
    wts = wts / wts.sum(-1, keepdim=True)
    up = MX.ExpertsUpOp(_shape(T), warps_per_cta=4, row_tiles=2)
    down = MX.ExpertsDownOp(_shape(T), warps_per_cta=4, row_tiles=1)
    meta = up.routing_tensors(ids)
    act = up.reference(z=z, w13=w.w13, ids=ids, **meta)["act"]
    c = down.reference(act=act, w2=w.w2, weights=wts, ids=ids, **meta)["c"]
    want = reference.routed_experts(z, ids, wts, w.w13, w.w2)
    torch.testing.assert_close(c.float(), want.float(), rtol=0, atol=0)


def test_default_tunables_and_params_follow_the_manifest():
    for name, cls in (("moe_w13", MX.ExpertsUpOp), ("moe_w2", MX.ExpertsDownOp)):
        spec = load_manifest().kernel(name)
        assert MX.DEFAULT_TUNABLES == spec.tunable_defaults()
        for shape in spec.shapes:
            op = cls(shape)
            assert list(op.tensor_specs()) == [p.name for p in spec.params]
            assert op.launch_config().grid[0] <= 2 * MX.SMS  # persistent


def test_plans_add_a_one_tile_path_past_batch_16():
    assert list(MX.make_plans(8, 3584, 8, 2, 8)) == [8]
    plans = MX.make_plans(64, 3584, 8, 2, 8)
    assert sorted(plans) == [16, 64]
    assert plans[16].batch_tiles == 1 and plans[64].batch_tiles == 4


@pytest.mark.parametrize("steps, cap, want", [(14, 5, 2), (14, 7, 7), (12, 5, 4), (12, 8, 6), (7, 1, 1), (96, 4, 4)])
def test_largest_unroll_divides_the_steps(steps, cap, want):
    from kernels.ops.decode_mma import largest_unroll

    assert largest_unroll(steps, cap) == want


@pytest.mark.parametrize("cls", [MX.ExpertsUpOp, MX.ExpertsDownOp])
@pytest.mark.parametrize("batch", [1, 8, 16, 32])
def test_pipelined_path_takes_equal_load_groups_up_to_one_tile(cls, batch):
    op = cls({**K3, "batch": batch}, pipeline=1, row_tiles=4, warps_per_cta=4, k_unroll=8)
    assert op.pipelined == (batch <= 16)
    plan = op.plans[batch]
    if op.pipelined:
        assert list(op.plans) == [batch] and plan.batch_tiles == 1
        assert plan.steps_per_warp % plan.k_unroll == 0  # no tail: the flattened loop is uniform
        vectors = plan.row_tiles + (2 if batch > 8 else 1)
        assert 2 * plan.k_unroll * vectors <= MX.PIPELINE_VECTORS


def _chunks(n_items, grid):
    """The pipelined path's split of the items over the CTAs (the kernel's integer arithmetic)."""
    return [(b * n_items // grid, (b + 1) * n_items // grid) for b in range(grid)]


@pytest.mark.parametrize("n_items, grid", [(6144, 396), (1792, 264), (5, 264), (264, 264), (1000, 7)])
def test_pipelined_chunks_cover_every_item_once_in_order(n_items, grid):
    chunks = _chunks(n_items, grid)
    items = [i for a, b in chunks for i in range(a, b)]
    assert items == list(range(n_items))
    sizes = [b - a for a, b in chunks]
    assert max(sizes) - min(sizes) <= 1  # balanced to one item


@pytest.mark.parametrize("cls, shape, tunables, fragment", [
    (MX.ExpertsUpOp, {**K3, "batch": 0}, {}, "batch 0"),
    (MX.ExpertsUpOp, K3, {"row_tiles": 3}, "even"),
    (MX.ExpertsDownOp, {**K3, "latent": 3580}, {}, "multiple of 16"),
    (MX.ExpertsDownOp, K3, {"splits": 2}, "unknown tunables"),
])
def test_rejects_what_it_cannot_compute(cls, shape, tunables, fragment):
    with pytest.raises(ValueError, match=fragment):
        cls(shape, **tunables)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [MX.ExpertsUpOp, MX.ExpertsDownOp])
@pytest.mark.parametrize("batch", [1, 64])
def test_k3_build_ptx(tmp_path, cls, batch):
    cute = pytest.importorskip("cutlass.cute")
    op = cls({**K3, "batch": batch})
    cute.compile(op, *op.fake_args(), options=f"--keep-ptx --gpu-arch sm_90a --dump-dir {tmp_path}")
    ptx = next(Path(tmp_path).glob("*.ptx")).read_text()
    assert "mma.sync.aligned.m16n8k16" in ptx and "ld.global.nc.v4" in ptx
    # expert offsets in 64 bits: k3's experts hold 2^34 elements
    per_expert = (2 * 3072 * 3584 if cls is MX.ExpertsUpOp else 3584 * 3072) * 2
    assert f"mul.wide.s32" in ptx and str(per_expert) in ptx
