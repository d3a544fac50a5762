"""Every defence against a planted attack: the attack must fail, an honest implementation pass.

All on CPU tensors (the attacks are device-independent: buffer reuse, caching, threads).
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from kernels import reference as R
from kernels.config import get_config
from validation import defences as D
from validation.check import check_callable, judge, matrix_for
from validation.opinputs import op_def


def honest_linear(x, w, *, out_dtype=None):
    return R.linear(x, w, out_dtype=out_dtype)


def honest_rmsnorm(x, gamma, eps=1e-5):
    return R.rmsnorm(x, gamma, eps)


def defence(report, name) -> D.DefenceResult:
    return next(d for d in report.checks if d.name == name)


@pytest.fixture(scope="module")
def honest_report():
    return check_callable("linear", honest_linear, quick=True)


def test_honest_candidate_passes_every_defence(honest_report):
    assert honest_report.passed, honest_report.failure_reasons()
    assert {d.name for d in honest_report.checks} == set(D.DEFENCE_NAMES)
    assert all(d.applicable for d in honest_report.checks)


# -- poisoned outputs ---------------------------------------------------------------------------


def _rmsnorm_destination(write_rows):
    """A 'kernel' writing into harness-allocated outputs, but only `write_rows(batch)` rows."""

    def launch(inputs, outs):
        y = R.rmsnorm(inputs["x"], inputs["gamma"], inputs["eps"])
        n = write_rows(y.shape[0])
        outs["out"][:n].copy_(y[:n])

    def specs(inputs):
        return {"out": (tuple(inputs["x"].shape), torch.bfloat16)}

    return D.DestinationSubject(launch, specs, "dest", "cpu")


def _judge_destination(subject):
    op = op_def("rmsnorm")
    cfg = get_config("tiny")
    return judge(subject, op, cfg, matrix_for(op, cfg, "cpu", quick=True), unseen_reason="cubin")


def test_poisoning_catches_a_kernel_that_leaves_rows_unwritten():
    honest = _judge_destination(_rmsnorm_destination(lambda b: b))
    assert honest.passed, honest.failure_reasons()
    attack = _judge_destination(_rmsnorm_destination(lambda b: max(1, b // 2)))
    cov = defence(attack, "poisoned_outputs")
    assert not cov.passed and "never written" in cov.detail
    assert not attack.passed


def test_poisoning_catches_a_stale_output_buffer():
    """The attack: skip the work and return the buffer an earlier (correct) call filled. Without
    poisoning a stale buffer holding the right values would pass; poisoned, it shows NaN."""
    stale = {}

    def launch(inputs, outs):
        key = tuple(inputs["x"].shape)
        if key not in stale:  # the first call of a shape computes honestly ...
            outs["out"].copy_(R.rmsnorm(inputs["x"], inputs["gamma"], inputs["eps"]))
            stale[key] = True
        # ... later calls write nothing, trusting the buffer to still hold a result

    subject = D.DestinationSubject(launch, lambda i: {"out": (tuple(i["x"].shape), torch.bfloat16)},
                                   "stale", "cpu")
    report = _judge_destination(subject)
    assert not report.passed
    assert not defence(report, "poisoned_outputs").passed


def test_callable_writing_half_of_an_empty_output_fails():
    def attack(x, gamma, eps=1e-5):
        y = torch.empty_like(x)
        y[: max(1, x.shape[0] // 2)] = R.rmsnorm(x, gamma, eps)[: max(1, x.shape[0] // 2)]
        return y

    report = check_callable("rmsnorm", attack, quick=True)
    assert not report.passed
    assert any(not c.passed for c in report.cases if c.case.batch >= 2)


# -- input mutation -------------------------------------------------------------------------------


def test_input_mutation_is_caught():
    def attack(x, w, *, out_dtype=None):
        y = R.linear(x, w, out_dtype=out_dtype)
        x.mul_(0.5)  # e.g. scratch space taken from an input buffer
        return y

    report = check_callable("linear", attack, quick=True)
    d = defence(report, "input_mutation")
    assert not d.passed and "modified input(s) x" in d.detail


def test_weight_mutation_is_caught():
    def attack(x, gamma, eps=1e-5):
        y = R.rmsnorm(x, gamma, eps)
        gamma[0] = 0  # a "static" weight written
        return y

    assert not defence(check_callable("rmsnorm", attack, quick=True), "input_mutation").passed


# -- both orders / output reuse -------------------------------------------------------------------


def _live_tensor_like(shape, dtype, exclude):
    """The attack's tool: find a live tensor of the right shape and dtype (the reference's output)."""
    ids = {id(t) for t in exclude}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor and id(obj) not in ids and tuple(obj.shape) == shape \
                and obj.dtype == dtype and obj.device.type == "cpu":
            return obj
    return None


def test_reusing_the_reference_output_fails_in_candidate_first_order():
    def attack(x, w, *, out_dtype=None):
        found = _live_tensor_like((x.shape[0], w.shape[0]), out_dtype or x.dtype, (x, w))
        return found.clone() if found is not None else torch.zeros(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype)

    report = check_callable("linear", attack, quick=True)
    d = defence(report, "both_orders")
    assert not d.passed and "candidate_first" in d.detail
    assert "reference_first" not in d.detail  # the attack works when the reference runs first ...


def test_returning_the_reference_buffer_itself_is_aliasing():
    def attack(x, w, *, out_dtype=None):
        found = _live_tensor_like((x.shape[0], w.shape[0]), out_dtype or x.dtype, (x, w))
        return found if found is not None else torch.zeros(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype)

    report = check_callable("linear", attack, quick=True)
    assert not defence(report, "output_aliasing").passed


# -- reshuffled inputs (caching) ----------------------------------------------------------------


def test_caching_by_pointer_fails():
    cache = {}

    def attack(x, w, *, out_dtype=None):
        key = (x.data_ptr(), w.data_ptr(), tuple(x.shape), tuple(w.shape))
        if key not in cache:
            cache[key] = R.linear(x, w, out_dtype=out_dtype)
        return cache[key].clone()

    report = check_callable("linear", attack, quick=True)
    d = defence(report, "reshuffled_inputs")
    assert not d.passed and "same buffers" in d.detail


def test_caching_by_a_weak_value_key_fails():
    cache = {}

    def attack(x, w, *, out_dtype=None):
        # Keyed by shape and a permutation-invariant summary: cheap, and wrong on reordered rows.
        key = (tuple(x.shape), tuple(w.shape), round(float(x.float().sum()), 3), round(float(w.float().sum()), 3))
        if key not in cache:
            cache[key] = R.linear(x, w, out_dtype=out_dtype)
        return cache[key].clone()

    d = defence(check_callable("linear", attack, quick=True), "reshuffled_inputs")
    assert not d.passed and "rows permuted" in d.detail


def test_caching_keyed_by_the_first_row_fails():
    cache = {}

    def attack(x, w, *, out_dtype=None):
        key = (tuple(x.shape), x[0].float().sum().item(), w[0].float().sum().item())
        if key not in cache:
            cache[key] = R.linear(x, w, out_dtype=out_dtype)
        return cache[key].clone()

    d = defence(check_callable("linear", attack, quick=True), "reshuffled_inputs")
    assert not d.passed and "last row changed" in d.detail


# -- unseen shapes --------------------------------------------------------------------------------


def test_shape_specialisation_fails_on_unseen_shapes():
    declared = {1, 8}  # the quick matrix's batches (boundary cases reuse them)

    def attack(x, w, *, out_dtype=None):
        y = R.linear(x, w, out_dtype=out_dtype)
        if x.shape[0] not in declared:  # the "fast path" only exists for shapes it was shown
            y = y * 0.9
        return y

    report = check_callable("linear", attack, quick=True)
    assert all(c.passed for c in report.cases if "unseen" not in c.case.tags)
    d = defence(report, "unseen_shapes")
    assert not d.passed
    assert not report.passed


# -- precision downgrade --------------------------------------------------------------------------


def test_bf16_accumulation_is_caught_against_the_oracle():
    def attack(x, w, *, out_dtype=None):
        # fp32 products, but the running sum rounded to bf16 after every 8-wide chunk of K.
        acc = torch.zeros(x.shape[0], w.shape[0])
        for k0 in range(0, x.shape[1], 8):
            part = x[:, k0:k0 + 8].float() @ w[:, k0:k0 + 8].float().T
            acc = (acc + part).to(torch.bfloat16).float()
        return acc.to(out_dtype or x.dtype)

    report = check_callable("linear", attack, quick=True)
    d = defence(report, "precision_vs_oracle")
    assert not d.passed and "relative error" in d.detail


def test_fp16_inputs_are_caught_on_large_values():
    def attack(x, gamma, eps=1e-5):
        # fp16 overflows (x*x beyond 65504) on large-magnitude inputs
        xf = x.to(torch.float16)
        inv = torch.rsqrt((xf * xf).float().mean(-1, keepdim=True) + eps)
        return (xf.float() * inv * gamma.float()).to(x.dtype)

    report = check_callable("rmsnorm", attack, quick=True)
    failed = [c for c in report.cases if not c.passed]
    assert failed and all(c.case.distribution in ("large", "beyond_fp16") for c in failed)


# -- determinism ----------------------------------------------------------------------------------


def test_nondeterministic_output_fails():
    def attack(x, w, *, out_dtype=None):
        y = R.linear(x, w, out_dtype=torch.float32)
        y = y * (1 + 1e-3 * torch.randn_like(y))  # like racing atomics: small, run-dependent
        return y.to(out_dtype or x.dtype)

    d = defence(check_callable("linear", attack, quick=True), "determinism")
    assert not d.passed


# -- work after return ----------------------------------------------------------------------------


def test_background_thread_finishing_the_output_fails():
    def attack(x, gamma, eps=1e-5):
        y = torch.zeros_like(x)
        full = R.rmsnorm(x, gamma, eps)

        def finish():
            time.sleep(0.002)
            y.copy_(full)

        threading.Thread(target=finish).start()
        return y

    report = check_callable("rmsnorm", attack, quick=True)
    d = defence(report, "work_after_return")
    assert not d.passed and "changed after the call returned" in d.detail


def test_thread_left_running_fails():
    stop = threading.Event()

    def attack(x, gamma, eps=1e-5):
        threading.Thread(target=stop.wait, args=(5,), daemon=True).start()
        return R.rmsnorm(x, gamma, eps)

    try:
        d = defence(check_callable("rmsnorm", attack, quick=True), "work_after_return")
        assert not d.passed and "thread" in d.detail
    finally:
        stop.set()


# -- a raising candidate is a verdict, not a crash --------------------------------------------------


def test_raising_candidate_fails_with_its_message():
    def attack(x, gamma, eps=1e-5):
        raise RuntimeError("illegal memory access (simulated)")

    report = check_callable("rmsnorm", attack, quick=True)
    assert not report.passed
    assert "illegal memory access" in report.failure_reasons()[0] or any(
        "illegal memory access" in r for c in report.cases for r in c.reasons)


# -- issue 23: the dishonest corpus (tests/fixtures/dishonest/impls.py) --------------------------

from tests.fixtures.dishonest import impls as X  # noqa: E402
from validation.numerics import Case, DECODE_BATCHES  # noqa: E402
from validation.check import CHECK_BATCHES, sampled_unseen, unseen_for  # noqa: E402

CFG = get_config("tiny")


def _policy():
    from validation.numerics import load_policy

    return load_policy()


def _case(op, batch, dist="normal", seed=0, routing=None):
    return Case(op, {}, batch, seed, dist, routing, {"gpu": "cpu", "gpu_count": 0, "sm_count": 0})


def _run(fn, case):
    op = op_def(case.op)
    subject = D.CallableSubject(fn, fn.__name__, "cpu")
    return D.evaluate(subject, op, case, D.build_inputs(op, case, CFG, "cpu"), _policy())[0]


def test_matrix_checks_every_decode_batch_and_unpredictable_shapes():
    op = op_def("linear")
    batches = {c.batch for c in matrix_for(op, CFG, torch.device("cpu"))}
    assert set(DECODE_BATCHES) <= batches and set(CHECK_BATCHES) <= batches
    gpu = {"gpu": "cpu", "gpu_count": 0, "sm_count": 0}
    draws = {tuple(c.batch for c in sampled_unseen(op, gpu)) for _ in range(6)}
    assert len(draws) > 1  # drawn per run
    assert all(c.batch not in CHECK_BATCHES for c in unseen_for(op, torch.device("cpu")))


def test_every_drawn_unseen_config_is_a_model_config():
    """The drawn widths respect ModelConfig's rules (a latent above hidden was refused, so a
    drawn shape failed the check at random): 2,000 seeded draws, each built."""
    import random

    from kernels.config import get_config
    from validation.opinputs import _cfg

    op = op_def("moe_block")
    gpu = {"gpu": "cpu", "gpu_count": 0, "sm_count": 0}
    rng = random.Random(0)
    for _ in range(2000):
        for c in sampled_unseen(op, gpu, rng):
            _cfg(c, get_config("tiny"))  # raises ConfigError for an impossible config


def test_batch_specialised_candidate_fails_at_a_decode_batch():
    assert _run(X.honest_linear, _case("linear", 2)).passed
    assert _run(X.linear_only_checked_batches, _case("linear", 8)).passed  # the old matrix's batches
    for b in (2, 4, 16, 32):
        assert not _run(X.linear_only_checked_batches, _case("linear", b)).passed, b


def test_refill_through_an_unversioned_alias_keeps_pointer_and_version():
    t = torch.randn(4, 8).to(torch.bfloat16)
    ptr, ver = t.data_ptr(), t._version
    D.refill_unversioned(t, torch.ones(4, 8))
    assert (t.data_ptr(), t._version) == (ptr, ver) and bool((t == 1).all())


def test_version_keyed_cache_fails_reshuffled_inputs():
    op = op_def("linear")
    probe = _case("linear", 3)
    X._CACHE.clear()
    bad = D.check_reshuffled(D.CallableSubject(X.linear_version_cache, "cache", "cpu"), op, probe, CFG, _policy())
    assert not bad.passed and "new values in the same buffers" in bad.detail
    good = D.check_reshuffled(D.CallableSubject(X.honest_linear, "honest", "cpu"), op, probe, CFG, _policy())
    assert good.passed, good.detail


def test_input_used_as_scratch_and_restored_is_caught():
    res = _run(X.linear_scratch_input, _case("linear", 3))
    assert not res.passed
    assert any("input_mutation" in d and "restored before return" in d for d in res.defects), res.defects
    assert _run(X.honest_linear, _case("linear", 3)).defects == []


def test_values_past_fp16_range_fail_an_fp16_path():
    assert _run(X.linear_fp16_accumulate, _case("linear", 4)).passed  # ordinary values hide it
    assert not _run(X.linear_fp16_accumulate, _case("linear", 4, "beyond_fp16")).passed
    assert _run(X.honest_linear, _case("linear", 4, "beyond_fp16")).passed
    assert any(c.distribution == "beyond_fp16" for c in matrix_for(op_def("linear"), CFG, torch.device("cpu")))


def test_exact_ties_broken_toward_the_higher_index_fail():
    case = _case("route_logits", 16, "ties", routing="uniform")
    assert _run(X.honest_route_logits, case).passed
    bad = _run(X.route_logits_ties_high, case)
    assert not bad.passed and any("exact tie" in r for r in bad.reasons), bad.reasons
    assert any(c.distribution == "ties" for c in matrix_for(op_def("route_logits"), CFG, torch.device("cpu")))


def test_non_finite_scores_are_minus_infinity():
    case = _case("route_logits", 16, "nonfinite", routing="uniform")
    assert _run(X.honest_route_logits, case).passed
    assert not _run(X.route_logits_nan_first, case).passed
    assert any(c.distribution == "nonfinite" for c in matrix_for(op_def("route_logits"), CFG, torch.device("cpu")))


def test_a_candidate_that_always_raises_gets_no_measurement_reported():
    rep = check_callable("linear", X.linear_raises, quick=True)
    assert not rep.passed
    for name in ("precision_vs_oracle", "input_mutation", "output_aliasing", "work_after_return"):
        d = defence(rep, name)
        assert not d.passed and "not measured" in d.detail, (name, d.detail)
    assert "within the policy" not in defence(rep, "precision_vs_oracle").detail
