"""The router op (kernels/ops/router.py): the grouping it promises (torch model of phase 2), its
contract with the manifest, the reference on the tiny preset, its k3 build (mma logits, read-only
path only for weights, the acq_rel arrival and release reset), and on a GPU its numerics."""

from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.config import get_config
from kernels.manifest import load_manifest
from kernels.ops import router as RT
from validation.numerics import ROUTINGS, routing_ids

SPEC = load_manifest().kernel("router")
K3 = {"batch": 1, "n_experts": 896, "hidden": 7168, "top_k": 16, "latent": 3584}


def _ids(pattern, T=5, E=16, K=4, seed=0):
    return routing_ids(T, E, K, pattern, torch.Generator().manual_seed(seed), "cpu")


@pytest.mark.parametrize("pattern", ROUTINGS)
def test_grouping_lists_each_expert_once_with_its_slots_in_token_order(pattern):
    ids = _ids(pattern)
    g = RT.routing_groups_ref(ids, 16)
    n = int(g["n_groups"][0])
    experts = g["group_expert"][:n].tolist()
    assert experts == sorted(set(ids.flatten().tolist()))  # once each, ascending
    flat = ids.flatten()
    slots = g["sorted_slots"]
    assert sorted(slots.tolist()) == list(range(ids.numel()))  # a permutation of the slots
    for u, e in enumerate(experts):
        grp = slots[g["group_start"][u]:g["group_start"][u + 1]]
        assert (flat[grp.long()] == e).all()  # contiguous, this expert only
        assert grp.tolist() == sorted(grp.tolist())  # token order
    assert int(g["group_start"][n]) == ids.numel()


def counting_sort_groups(ids, n_experts: int):
    """Phase 2's grouping as the kernel computes it: per-expert token bit masks, counts by
    population count, an exclusive scan over experts, ranks by masked population counts."""
    T, K = ids.shape
    masks = [0] * n_experts
    for t in range(T):
        for e in ids[t].tolist():
            masks[e] |= 1 << t
    counts = [bin(m).count("1") for m in masks]
    start, group_expert, group_start, pos = [0] * n_experts, [], [], 0
    for e in range(n_experts):
        start[e] = pos
        if counts[e]:
            group_expert.append(e)
            group_start.append(pos)
        pos += counts[e]
    sorted_slots = [0] * (T * K)
    for p in range(T * K):
        t = p // K
        e = int(ids[t, p % K])
        sorted_slots[start[e] + bin(masks[e] & ((1 << t) - 1)).count("1")] = p
    return len(group_expert), group_expert, group_start + [T * K], sorted_slots


@pytest.mark.parametrize("pattern", ROUTINGS)
@pytest.mark.parametrize("T", [1, 5, 33, 64])
def test_counting_sort_grouping_is_the_reference_grouping(pattern, T):
    ids = routing_ids(T, 64, 8, pattern, torch.Generator().manual_seed(T), "cpu")
    n, experts, starts, slots = counting_sort_groups(ids, 64)
    ref = RT.routing_groups_ref(ids, 64)
    assert n == int(ref["n_groups"][0])
    assert experts == ref["group_expert"][:n].tolist()
    assert starts == ref["group_start"][: n + 1].tolist()
    assert slots == ref["sorted_slots"].tolist()


def test_same_routing_gives_top_k_groups_holding_every_token():
    ids = _ids("same", T=6)
    g = RT.routing_groups_ref(ids, 16)
    assert int(g["n_groups"][0]) == 4
    assert torch.diff(g["group_start"][:5]).tolist() == [6, 6, 6, 6]


def test_reference_selection_breaks_ties_to_the_lower_expert():
    s = torch.tensor([[0.5, 0.7, 0.7, 0.1, 0.7]])
    ids = reference.select_experts(s, torch.zeros(5), 2)
    assert ids.tolist() == [[1, 2]]


def test_reference_outputs_on_tiny_match_the_projects_router():
    cfg = get_config("tiny")
    w = reference.make_weights(cfg)
    h = reference.rmsnorm(reference.make_hidden(cfg, 3), w.gamma_pre)
    op = RT.RouterOp({"batch": 3, "n_experts": 16, "hidden": 64, "top_k": 4, "latent": 32}, warps_per_cta=2)
    out = op.reference(h=h, w_gate=w.w_gate, bias=w.bias, w_down=w.w_down)
    r = reference.router(h, w.w_gate, w.bias, 4)
    assert torch.equal(out["ids"], r.ids) and torch.equal(out["weights"], r.weights)
    assert torch.equal(out["z"], reference.linear(h, w.w_down))
    assert set(out) == {p.name for p in SPEC.params if p.direction == "out"}


def test_default_tunables_and_params_follow_the_manifest():
    assert RT.DEFAULT_TUNABLES == SPEC.tunable_defaults()
    for shape in SPEC.shapes:
        op = RT.RouterOp(shape)
        assert list(op.tensor_specs()) == [p.name for p in SPEC.params]
        assert op.launch_config().grid[0] == 896 // 8 + 3584 // 16


@pytest.mark.parametrize("shape, fragment", [
    ({**K3, "batch": 65}, "batch 65"),
    ({**K3, "top_k": 0}, "top_k 0"),
    ({**K3, "n_experts": 900}, "multiple of 8"),
    ({k: v for k, v in K3.items() if k != "latent"}, "missing"),
])
def test_rejects_what_it_cannot_compute(shape, fragment):
    with pytest.raises(ValueError, match=fragment):
        RT.RouterOp(shape)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 64])
def test_k3_build_ptx(tmp_path, batch):
    cute = pytest.importorskip("cutlass.cute")
    op = RT.RouterOp({**K3, "batch": batch})
    cute.compile(op, *op.fake_args(), options=f"--keep-ptx --gpu-arch sm_90a --dump-dir {tmp_path}")
    ptx = next(Path(tmp_path).glob("*.ptx")).read_text()
    assert "mma.sync.aligned.m16n8k16" in ptx
    assert "ld.global.nc.v4" in ptx  # weights through the read-only path
    assert "atom.global.acq_rel" in ptx and "st.release.gpu" in ptx  # arrival, counter reset
