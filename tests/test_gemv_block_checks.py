"""scripts/gemv_block_checks.py's judgement on CPU: outputs equal to the reference pass, one wrong
element, a grouping entry or a counter left non-zero fails; its variants are manifest kernels."""

import sys

import pytest
import torch

from kernels.manifest import load_manifest
from kernels.manifest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gemv_block_checks as G  # noqa: E402


def _op_and_bufs(kernel, shape, seed=1):
    spec = load_manifest().kernel(kernel)
    mod, _, cls = spec.op.partition(":")
    op = getattr(__import__(mod, fromlist=[cls]), cls)(shape)
    g = torch.Generator().manual_seed(seed)
    specs = op.tensor_specs()
    bufs = {}
    for p in spec.params:
        sp = specs[p.name]
        dt = getattr(torch, sp.dtype)
        bufs[p.name] = torch.randn(sp.shape, generator=g).to(dt) if p.direction == "in" else torch.zeros(sp.shape, dtype=dt)
    want = op.reference(**{p.name: bufs[p.name] for p in spec.params if p.direction == "in"})
    for n, v in want.items():  # what a correct kernel writes (entries past n_groups left as they were)
        bufs[n].view(-1)[: v.numel()] = v.reshape(-1)[: bufs[n].numel()].to(bufs[n].dtype)
    return op, spec, bufs


@pytest.mark.parametrize("kernel, shape, out", [
    ("router_select", {"batch": 21, "n_experts": 64, "top_k": 8}, "sorted_slots"),
    ("router_select", {"batch": 21, "n_experts": 64, "top_k": 8}, "weights"),
    ("gated_situ", {"batch": 5, "width": 1032}, "a"),
    ("residual", {"batch": 5, "width": 1032}, "out"),
])
def test_correct_outputs_pass_and_one_wrong_element_fails(kernel, shape, out):
    op, spec, bufs = _op_and_bufs(kernel, shape)
    assert G._check(op, spec, bufs)["passed"]
    bufs[out].view(-1)[3] += 1
    r = G._check(op, spec, bufs)
    assert not r["passed"] and not r[out]


def test_a_counter_left_nonzero_or_a_wrong_group_fails():
    op, spec, bufs = _op_and_bufs("router_select", {"batch": 3, "n_experts": 64, "top_k": 8})
    bufs["counter"][0] = 1
    assert not G._check(op, spec, bufs)["passed"]
    bufs["counter"][0] = 0
    bufs["group_start"][1] += 1
    assert not G._check(op, spec, bufs)["passed"]


def test_variants_are_manifest_kernels_with_valid_shapes():
    man = load_manifest()
    for ident, kernel, shape, tun in G.VARIANTS:
        spec = man.kernel(kernel)
        mod, _, cls = spec.op.partition(":")
        getattr(__import__(mod, fromlist=[cls]), cls)(shape, **tun)  # raises on a shape it refuses
    assert len(set(G.IDS)) == len(G.IDS)
