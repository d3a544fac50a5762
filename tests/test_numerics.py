"""Numerics: metrics with known answers, the tolerance policy, the case matrix, and the yardstick
(the bf16 reference and the oracle itself pass; an error beyond the policy fails)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference as R
from validation import numerics as N
from validation.check import check_callable
from validation.defences import SELECTING_OPS
from validation.opinputs import OP_DEFS, build_inputs, op_def
from kernels.config import get_config

POLICY = N.load_policy()


def test_policy_is_read_from_one_file_with_every_output_dtype():
    assert POLICY.source == "validation/tolerances.toml"
    for dt in (torch.bfloat16, torch.float32, torch.float16):
        p = POLICY.for_dtype(dt)
        assert p.max_error_ratio >= 1 and p.rel_fro_floor > 0
    with pytest.raises(N.PolicyError):
        POLICY.for_dtype(torch.int8)


def test_malformed_policy_is_rejected(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text("[dtype.bfloat16]\nmax_error_ratio = 0.5\n")
    with pytest.raises(N.PolicyError):
        N.load_policy(p)
    p.write_text("not toml [")
    with pytest.raises(N.PolicyError, match="cannot read"):
        N.load_policy(p)


def test_ulp_distance_known_values():
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    nxt = torch.tensor([1.0078125], dtype=torch.bfloat16)  # 1 + 2^-7: the next bf16 after 1
    assert N.ulp_distance(nxt, one.double()).item() == 1
    assert N.ulp_distance(one, one.double()).item() == 0
    # Across zero: the smallest positive and negative subnormals are 2 ulps apart.
    tiny = torch.tensor([9.18355e-41], dtype=torch.bfloat16)
    assert N.ulp_distance(tiny, -tiny.double()).item() == 2
    f = torch.tensor([1.0], dtype=torch.float32)
    assert N.ulp_distance(torch.nextafter(f, torch.tensor([2.0])), f.double()).item() == 1


def test_rel_fro_known_value():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)  # norm 5
    assert N.rel_fro(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)


def _lin_case():
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) / 16).bfloat16()
    return x, w, R.linear(x, w), R.linear(x, w, compute_dtype=torch.float64)


def test_bf16_reference_and_rounded_oracle_pass():
    x, w, ref, oracle = _lin_case()
    m = N.compare_output("out", ref, oracle, ref, POLICY)
    assert m.passed and m.ratio == pytest.approx(1.0)
    m = N.compare_output("out", oracle.to(torch.bfloat16), oracle, ref, POLICY)
    assert m.passed and m.ratio <= 1.0 + 1e-9
    assert m.ulp_max <= 1  # the oracle rounded is within an ulp of itself by construction


def test_error_beyond_the_factor_fails_and_below_passes():
    x, w, ref, oracle = _lin_case()
    ref_err = N.rel_fro(ref, oracle)
    noise = torch.randn(oracle.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    noise = noise / noise.norm() * oracle.norm()
    bad = (oracle + 4 * ref_err * noise).to(torch.bfloat16)
    m = N.compare_output("out", bad, oracle, ref, POLICY)
    assert not m.passed and "exceeds" in m.reasons[0]
    assert m.ratio > POLICY.for_dtype(torch.bfloat16).max_error_ratio


def test_one_wrong_element_fails_through_the_mismatch_fraction():
    x, w, ref, oracle = _lin_case()
    bad = ref.clone()
    bad[3, 7] = bad[3, 7] * 1.5 + 0.5  # Frobenius barely moves; one element is plainly wrong
    m = N.compare_output("out", bad, oracle, ref, POLICY)
    assert not m.passed and any("mismatch" in r for r in m.reasons)


def test_nan_inf_shape_and_dtype_fail():
    x, w, ref, oracle = _lin_case()
    bad = ref.clone()
    bad[0, 0] = float("nan")
    bad[1, 1] = float("inf")
    m = N.compare_output("out", bad, oracle, ref, POLICY)
    assert not m.passed and m.nan == 1 and m.inf == 1
    assert not N.compare_output("out", ref[:4], oracle, ref, POLICY).passed
    m = N.compare_output("out", ref.float(), oracle, ref, POLICY)
    assert not m.passed and "dtype" in m.reasons[0]


def test_expert_ids_accept_near_ties_and_reject_wrong_choices():
    scores = torch.tensor([[0.9, 0.8, 0.80002, 0.1]], dtype=torch.float64)
    ref = torch.tensor([[0, 2]], dtype=torch.int32)
    assert N.compare_expert_ids("ids", torch.tensor([[1, 0]]), scores, ref, POLICY).passed  # near-tie 1 ~ 2
    m = N.compare_expert_ids("ids", torch.tensor([[0, 3]]), scores, ref, POLICY)
    assert not m.passed and m.mismatch_fraction == 1.0
    assert not N.compare_expert_ids("ids", torch.tensor([[0, 0]]), scores, ref, POLICY).passed  # duplicate
    assert not N.compare_expert_ids("ids", torch.tensor([[0, 9]]), scores, ref, POLICY).passed  # out of range


def test_case_matrix_spans_every_axis():
    gpu = N.gpu_configuration("cpu")
    assert gpu == {"gpu": "cpu", "gpu_count": 0, "sm_count": 0}
    cases = N.case_matrix("routed_experts", [{}], moe=True, gpu=gpu, boundary=[{"hidden": 24}])
    assert {c.batch for c in cases} == set(N.DEFAULT_BATCHES)
    assert {c.distribution for c in cases} == set(N.DISTRIBUTIONS)
    assert {c.routing for c in cases} == set(N.ROUTINGS)
    assert {c.seed for c in cases} == set(N.DEFAULT_SEEDS)
    assert any("boundary" in c.tags for c in cases)
    assert len({c.case_id for c in cases}) == len(cases)  # ids are unique
    pinned = N.case_matrix("rmsnorm", [{"width": 64, "batch": 4}], moe=False, gpu=gpu)
    assert {c.batch for c in pinned} == {4}


@pytest.mark.parametrize("pattern", N.ROUTINGS)
def test_routing_patterns(pattern):
    ids = N.routing_ids(8, 16, 4, pattern, torch.Generator().manual_seed(0), "cpu")
    assert ids.shape == (8, 4) and ids.dtype == torch.int32
    assert all(len(set(r.tolist())) == 4 for r in ids)  # distinct within a token
    if pattern == "same":
        assert (ids == ids[0]).all()
    if pattern == "distinct":
        assert len(set(ids.flatten().tolist())) == 16  # 8 tokens x 4 covers all 16 experts
    if pattern == "hot":
        assert (ids[:, :2] == torch.tensor([0, 1], dtype=torch.int32)).all()


@pytest.mark.parametrize("dist", N.DISTRIBUTIONS)
def test_distributions_are_never_zero(dist):
    t = N.fill_distribution((64, 64), dist, torch.Generator().manual_seed(0), "cpu")
    assert t.dtype == torch.bfloat16 and torch.isfinite(t).all() and (t != 0).float().mean() > 0.99
    scale = t.float().abs().max().item()
    assert {"large": scale > 1000, "near_zero": scale < 0.01}.get(dist, 0.5 < scale < 500)


def test_inputs_are_deterministic_per_case():
    op, cfg = op_def("linear"), get_config("tiny")
    c = N.Case("linear", {}, 3, 0, "normal", None, N.gpu_configuration("cpu"))
    a, b = build_inputs(op, c, cfg, "cpu"), build_inputs(op, c, cfg, "cpu")
    assert torch.equal(a["x"], b["x"]) and torch.equal(a["w"], b["w"])
    c2 = N.Case("linear", {}, 3, 1, "normal", None, c.gpu)
    assert not torch.equal(a["x"], build_inputs(op, c2, cfg, "cpu")["x"])


@pytest.mark.parametrize("name", sorted(OP_DEFS))
def test_the_oracle_rounded_to_the_output_dtype_passes_every_op(name):
    """The most accurate candidate possible must pass: the policy never rejects correctness."""
    ref = R.REFERENCE_OPS[name]

    def oracle(**kw):
        bf = ref(**kw)
        hi = ref(**kw, **({"ids": bf.ids} if name in SELECTING_OPS else {}), compute_dtype=torch.float64)
        if isinstance(bf, torch.Tensor):
            return hi.to(bf.dtype)
        if name == "route_logits":
            return type(bf)(ids=bf.ids, weights=hi.weights.to(bf.weights.dtype))
        return type(bf)(ids=bf.ids, weights=hi.weights.to(bf.weights.dtype), logits=hi.logits.to(bf.logits.dtype))

    rep = check_callable(name, oracle, quick=True)
    assert all(c.passed for c in rep.cases), rep.failure_reasons()


def test_exact_ties_go_to_the_lower_index_and_the_tolerance_does_not_forgive_them():
    scores = torch.tensor([[0.9, 0.8, 0.8, 0.1], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    ref = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    assert N.compare_expert_ids("ids", torch.tensor([[1, 0], [1, 0]]), scores, ref, POLICY).passed
    m = N.compare_expert_ids("ids", torch.tensor([[2, 0], [0, 1]]), scores, ref, POLICY)  # 2 over tied 1
    assert not m.passed and "exact tie" in m.reasons[0] and m.mismatch_fraction == 0.5
    assert not N.compare_expert_ids("ids", torch.tensor([[0, 1], [2, 3]]), scores, ref, POLICY).passed


def test_non_finite_scores_count_as_minus_infinity():
    """vLLM's rule: a NaN (or inf) score is never chosen ahead of a finite one."""
    scores = torch.tensor([[float("nan"), 0.8, 0.7, 0.1], [0.9, float("inf"), 0.2, 0.3]], dtype=torch.float64)
    ref = torch.tensor([[1, 2], [0, 3]], dtype=torch.int32)
    assert N.compare_expert_ids("ids", ref, scores, ref, POLICY).passed
    assert not N.compare_expert_ids("ids", torch.tensor([[0, 1], [0, 3]]), scores, ref, POLICY).passed
    assert not N.compare_expert_ids("ids", torch.tensor([[1, 2], [1, 0]]), scores, ref, POLICY).passed


def test_beyond_fp16_distribution_exceeds_65504_and_fits_bf16():
    g = torch.Generator().manual_seed(0)
    t = N.fill_distribution((64, 64), "beyond_fp16", g, "cpu", torch.bfloat16)
    assert torch.isfinite(t).all() and t.abs().max().item() > 65504
    assert (t.abs() > 65504).double().mean().item() > 0.1
    assert torch.isinf(t.to(torch.float16)).any()  # an fp16 path overflows on it
    ties = N.fill_distribution((8, 16), "ties", torch.Generator().manual_seed(0), "cpu", torch.float32)
    assert all(len(set(r.tolist())) < 16 for r in ties)  # exact ties in every row
