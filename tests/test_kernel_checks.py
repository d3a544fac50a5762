"""The multi-output judge (validation/kernel_checks.py) on the CPU: a fake launcher that computes
each op's own reference passes every case; planted defects (a wrong tie-break, an unwritten
output, a counter left set, a mutated input) fail with their reason."""

from __future__ import annotations

import pytest
import torch

from kernels.manifest import load_manifest
from validation import kernel_checks as KC
from validation.numerics import load_policy

MINI_SEL = {"batch": 3, "n_experts": 64, "top_k": 8}
MINI_EXPERTS = {"batch": 3, "n_experts": 16, "latent": 512, "expert_inter": 512, "top_k": 4}


def fake_meta(kernel: str, variant: dict) -> dict:
    spec = load_manifest().kernel(kernel)
    op = KC.op_instance({"variant": variant, "tunables": spec.tunable_defaults()}, spec.op)
    specs = op.tensor_specs()
    params = [{"name": p.name, "role": p.role, "direction": p.direction, "spec": specs[p.name].to_dict()}
              for p in spec.params]
    return {"kernel": kernel, "variant": variant, "tunables": spec.tunable_defaults(), "params": params,
            "hashes": {"cubin_sha256": "0" * 64}, "key": "fake"}


def reference_launcher(mkref, *, tamper=None):
    """A launcher computing the op's reference into the outputs (a correct kernel)."""

    def launch(args):
        mk = mkref[0]
        named = {p["name"]: a for p, a in zip(mk.params, args)}
        ins = {n: named[n] for n in mk.ins}
        extra = {}
        if mk.name in KC.EXPERT_KERNELS:  # the reference needs the routing the grouping came from
            extra["ids"] = mkref[1]["ids"]
        ref = mk.op.reference(**ins, **extra)
        for n in mk.outs:
            named[n].copy_(ref[n].to(named[n].dtype))
        if tamper:
            tamper(named)

    return launch


def make(kernel, variant, tamper=None, ids_box=None):
    box = [None, {}]
    mk = KC.MultiKernel(meta=fake_meta(kernel, variant), device="cpu",
                        launcher=reference_launcher(box, tamper=tamper))
    box[0] = mk
    orig = mk.inputs

    def inputs(case):
        ins, extra = orig(case)
        box[1] = extra
        return ins, extra

    mk.inputs = inputs
    return mk


def test_multi_output_detection():
    assert KC.is_multi_output(fake_meta("router_select", MINI_SEL))
    assert not KC.is_multi_output(fake_meta("residual", {"batch": 2, "width": 64}))


def test_router_select_reference_passes_every_case_ties_included():
    mk = make("router_select", MINI_SEL)
    res = KC.judge_variant(mk, seeds=(0,), stress_runs=3)
    whats = {c["what"] for c in res["cases"]}
    assert {"triples", "all", "mixed", "hot", "same"} <= whats
    assert res["passed"], [c["reasons"] for c in res["cases"] if not c["passed"]]
    assert res["stress"]["passed"]


def test_wrong_tie_break_fails_on_ties():
    """Ties to the higher expert: on "all" (every score equal) the reference picks 0..k-1."""
    def higher(named):
        k = named["ids"].shape[1]
        named["ids"].copy_(torch.arange(k, 0, -1, dtype=named["ids"].dtype).expand_as(named["ids"]))

    mk = make("router_select", MINI_SEL, tamper=higher)
    res = KC.judge_variant(mk, seeds=(0,), stress_runs=2)
    assert not res["passed"]
    all_case = next(c for c in res["cases"] if c["what"] == "all")
    assert any("ties" in r or "grouping" in r or "weights" in r for r in all_case["reasons"])


def test_unwritten_output_and_counter_left_fail():
    def tamper(named):
        named["weights"][0, 0] = float("nan") if torch.isnan(named["weights"][0, 1]) else named["weights"][0, 0]
        named["counter"].fill_(1)

    mk = make("router_select", MINI_SEL, tamper=tamper)
    r = mk.judge_case(KC.kernel_cases("router_select", MINI_SEL, (0,))[0], load_policy())
    assert not r["passed"]
    assert any("sync buffer 'counter'" in x for x in r["reasons"])


def test_input_mutation_is_caught():
    mk = make("router_select", MINI_SEL, tamper=lambda n: n["logits"].mul_(1.0).add_(1e-3))
    r = mk.judge_case(KC.kernel_cases("router_select", MINI_SEL, (0,))[0], load_policy())
    assert any("input_mutation" in x for x in r["reasons"])


@pytest.mark.parametrize("kernel", ["moe_w13", "moe_w2"])
def test_experts_under_every_routing(kernel):
    mk = make(kernel, MINI_EXPERTS)
    res = KC.judge_variant(mk, seeds=(0,), stress_runs=2)
    assert [c["what"] for c in res["cases"]] == list(KC.ROUTINGS)
    assert res["passed"], [c["reasons"] for c in res["cases"] if not c["passed"]]


def test_experts_wrong_values_fail_precision():
    mk = make("moe_w2", MINI_EXPERTS, tamper=lambda n: n["c"].mul_(1.05))
    res = KC.judge_variant(mk, seeds=(0,), stress_runs=2)
    assert not res["passed"]
    assert not next(c for c in res["checks"] if c["name"] == "precision_vs_oracle")["passed"]


@pytest.mark.parametrize("kernel,variant", [
    ("latent_out", {"batch": 2, "hidden": 512, "latent": 512, "shared_inter": 512}),
    ("shared_gate_up", {"batch": 2, "hidden": 512, "shared_inter": 512}),
])
def test_dense_multi_input_kernels_on_their_op_reference(kernel, variant):
    from validation.gpu_stages import judged_by_op_class

    meta = fake_meta(kernel, variant)
    assert judged_by_op_class(meta)
    res = KC.judge_variant(make(kernel, variant), seeds=(0,), stress_runs=2)
    assert res["passed"], [c["reasons"] for c in res["cases"] if not c["passed"]]


def test_grouping_tail_past_n_groups_is_not_required():
    """The kernels leave group_expert / group_start past n_groups as they were (consumers read
    [:n] and [:n + 1]): the two-poison comparison must not call that unwritten."""

    def leave_tail(named):
        n = int(named["n_groups"][0])
        named["group_expert"][n:] = torch.randint(0, 99, named["group_expert"][n:].shape, dtype=torch.int32)

    mk = make("router_select", MINI_SEL, tamper=leave_tail)
    r = mk.judge_case(KC.kernel_cases("router_select", MINI_SEL, (0,))[0], load_policy())
    assert r["passed"], r["reasons"]


def test_big_inputs_are_fingerprinted_not_cloned(monkeypatch):
    t = torch.randn(4, 8, 16).to(torch.bfloat16)
    monkeypatch.setattr(KC, "BIG_INPUT_BYTES", 64)
    fp = KC.fingerprint(t)
    assert fp.shape == (4, 2) and KC.same_fingerprint(t, fp)
    u = t.clone()
    u[2, 3, 1] = u[2, 3, 1] + 1
    assert not KC.same_fingerprint(u, fp)
    v = t.clone()
    v[1] = t[1].flip(0)  # the same values, moved
    assert not KC.same_fingerprint(v, fp)
    w = KC._randn((3, 4, 5), torch.Generator().manual_seed(0), "cpu", 0.5)
    assert w.dtype == torch.bfloat16 and w.shape == (3, 4, 5) and w.float().std() > 0.1


def test_prodcons_flags_are_reset_by_the_host_and_its_single_precision_reference_is_the_oracle():
    variant = {"steps": 8, "width": 1024, "rows": 64, "producers": 2, "consumers": 4}
    mk = make("prodcons", variant, tamper=lambda n: n["flags"].fill_(8))  # the kernel counts steps up
    res = KC.judge_variant(mk, seeds=(0,), stress_runs=2)
    assert res["passed"], [c["reasons"] for c in res["cases"] if not c["passed"]]


# -- a build of another revision (a plan's base) -----------------------------------------------

MINI_ROUTER = {"batch": 2, "n_experts": 64, "hidden": 512, "top_k": 8, "latent": 256}


def test_base_build_with_tunables_this_checkout_does_not_know_is_judged_on_todays_reference():
    """The base revision's meta.json carries tunables today's op class refuses ("unknown
    tunables"): the op is built without them and the build is judged all the same."""
    meta = fake_meta("router", MINI_ROUTER)
    meta["tunables"] = {**meta["tunables"], "arrive": 3, "warps_per_cta": 8}
    box = [None, {}]
    mk = KC.MultiKernel(meta=meta, device="cpu", launcher=reference_launcher(box))
    box[0] = mk
    assert mk.op.dropped_tunables == ["arrive", "warps_per_cta"]
    assert {k: mk.op.tunables[k] for k in load_manifest().kernel("router").tunable_defaults()} == \
        load_manifest().kernel("router").tunable_defaults()
    r = mk.judge_case(KC.kernel_cases("router", MINI_ROUTER, (0,))[0], load_policy())
    assert r["passed"], r["reasons"]


def test_base_build_whose_parameters_differ_from_todays_op_is_refused():
    meta = fake_meta("router", MINI_ROUTER)
    meta["tunables"] = {**meta["tunables"], "arrive": 3}
    z = next(p for p in meta["params"] if p["name"] == "z")
    z["spec"] = {**z["spec"], "shape": [2, 128]}
    with pytest.raises(KC.BuildMismatch, match=r"z: build \[2, 128\] bfloat16, op \[2, 256\].*left out: \['arrive'\]"):
        KC.MultiKernel(meta=meta, device="cpu", launcher=lambda args: None)


def test_the_real_base_router_meta_of_83f6b15_builds_todays_op():
    """tests/fixtures/base_meta: the router's meta.json at 83f6b15 (33 tunables, 16 of them gone
    since) as the GPU host reads it from a plan's carry; its tensors are today's at batch 1."""
    import json
    from pathlib import Path

    meta = json.loads((Path(__file__).parent / "fixtures" / "base_meta" / "router_83f6b15_batch1.json").read_text())
    mk = KC.MultiKernel(meta=meta, device="cpu", launcher=lambda args: None)
    assert "arrive" in mk.op.dropped_tunables and "arrive" not in mk.op.tunables
    assert mk.outs == ["logits", "ids", "weights", "n_groups", "group_expert", "group_start", "sorted_slots", "z"]
    assert mk.owned_bufs["counter"].shape == tuple(next(p for p in meta["params"]
                                                        if p["name"] == "counter")["spec"]["shape"])


# -- the routed experts: judged here, their weights never cloned ---------------------------------

@pytest.mark.parametrize("kernel", ["moe_w13", "moe_w2"])
def test_routed_experts_take_this_judge_not_the_generic_one(kernel, tmp_path, monkeypatch):
    """gpu_stages.numerics_stage sends the experts (one 'out' each, a reference op of
    kernels.reference) to kernel_checks, whose big static inputs are fingerprinted: no clone of a
    weight, where the generic judge (check.judge, defences.invoke) clones every input."""
    import json

    from validation import gpu_stages as GS

    meta = fake_meta(kernel, MINI_EXPERTS)
    assert not KC.is_multi_output(meta)  # one 'out': only the declared table routes it here
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(KC, "BIG_INPUT_BYTES", 1 << 16)  # the mini weights count as big, as k3's do
    weight = "w13" if kernel == "moe_w13" else "w2"
    wbytes = next(p for p in meta["params"] if p["name"] == weight)["spec"]
    wbytes = 2 * int(torch.tensor(wbytes["shape"]).prod())
    clones = []
    real_clone = torch.Tensor.clone

    def counting_clone(self, *a, **k):
        if self.nbytes >= wbytes:
            clones.append(tuple(self.shape))
        return real_clone(self, *a, **k)

    def generic(*a, **k):
        raise AssertionError("the generic judge (KernelAdapter + check.judge) was chosen")

    made = []

    def multi(d, device="cuda"):
        made.append(d)
        return make(kernel, MINI_EXPERTS)

    monkeypatch.setattr(GS, "KernelAdapter", generic)
    monkeypatch.setattr(GS, "MultiKernel", multi)
    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    res = GS.numerics_stage([str(tmp_path)], device="cpu", seeds=(0,))
    monkeypatch.setattr(torch.Tensor, "clone", real_clone)
    (v,) = res["variants"]
    assert made and v["passed"], v.get("error") or [c["reasons"] for c in v["cases"] if not c["passed"]]
    assert clones == [], f"static weights cloned: {clones}"


def test_the_clone_counter_sees_the_generic_judge_clone_the_weights(monkeypatch):
    """The test above can fail: the generic judge's guarded call (defences.invoke, on the inputs
    opinputs builds for kernels.reference:expert_outputs, tiny preset) clones w13 and w2, which
    at k3 is 59 GB more (the CUDA out-of-memory of moe_w13 and moe_w2 on the H200)."""
    from kernels.config import get_config
    from validation import defences as D
    from validation.numerics import Case
    from validation.opinputs import build_inputs, op_def

    op = op_def("expert_outputs")
    cfg = get_config("tiny")
    ins = build_inputs(op, Case(op.name, {}, 2, 0, "normal", "uniform", {"gpu": "cpu"}, ()), cfg, "cpu")
    seen = []
    real_clone = torch.Tensor.clone

    def counting_clone(self, *a, **k):
        if self.dim() == 3 and self.shape[0] == cfg.n_experts:
            seen.append(tuple(self.shape))
        return real_clone(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    D.invoke(D.CallableSubject(lambda **kw: op.reference(**kw), "reference", "cpu"), ins, delay_s=0)
    monkeypatch.setattr(torch.Tensor, "clone", real_clone)
    assert tuple(ins["w13"].shape) in seen and tuple(ins["w2"].shape) in seen


def test_bench_times_a_base_build_with_tunables_this_checkout_does_not_know(tmp_path, monkeypatch):
    """gpu_stages.bench_stage --base revision on a multi-output kernel (stand-in launcher and
    timer): the base build's meta.json carries tunables today's op refuses; both sides are timed
    into the same output buffers and the row names both binaries."""
    import json

    import benchmarks.common as common
    from validation import bench
    from validation import gpu_stages as GS

    dirs = {}
    for side in ("head", "base"):
        meta = fake_meta("router", MINI_ROUTER)
        meta["hashes"] = {"cubin_sha256": side[0] * 64}
        if side == "base":
            meta["tunables"] = {**meta["tunables"], "arrive": 3, "row_tiles": 1}
        (tmp_path / side).mkdir()
        (tmp_path / side / "meta.json").write_text(json.dumps(meta))
        dirs[side] = str(tmp_path / side)
    launched = []

    def multi(d, cache=None):
        box = [None, {}]
        ref = reference_launcher(box)
        mk = KC.MultiKernel(d, device="cpu", cache=cache,
                            launcher=lambda args: (launched.append((d, args[3].data_ptr())), ref(args)))
        box[0] = mk
        return mk

    monkeypatch.setattr(GS, "MultiKernel", multi)
    monkeypatch.setattr(bench, "rotation_copies", lambda nbytes: (2, True))

    def fake_measure(base_fn, head_fn):
        for i in range(2):
            base_fn(i), head_fn(i)
        return {"base": [10.0 + 0.01 * i for i in range(12)], "head": [10.0 + 0.01 * i for i in range(12)],
                "graph": True}

    monkeypatch.setattr(bench, "measure_interleaved", fake_measure)
    monkeypatch.setattr(common, "gpu_environment", lambda: {"gpu": "stand-in"})
    monkeypatch.setattr(common, "read_bandwidth", lambda: {"tbps": 4.5, "kernel": "r", "readers": {
        "r": {"p90_us": 1.0, "p10_us": 1.0, "median_us": 1.0}}})
    monkeypatch.setattr(common, "copy_bandwidth", lambda: {"tbps": 4.2, "kernel": "c", "p90_us": 1.0,
                                                           "p10_us": 1.0, "median_us": 1.0})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    (case,) = GS.bench_stage([dirs["head"]], base="revision", base_dirs=[dirs["base"]])["cases"]
    assert "error" not in case, case.get("error")
    assert case["verdict"] == "SAME" and case["copies"] == 2 and case["batch"] == 2
    assert case["binary"]["cubin_sha256"] == "h" * 64 and case["base_binary"]["cubin_sha256"] == "b" * 64
    assert "arrive" in case["base_binary"]["tunables"]
    ptrs = {d: {p for dd, p in launched if dd == d} for d in dirs.values()}
    assert ptrs[dirs["base"]] and ptrs[dirs["base"]] == ptrs[dirs["head"]]


def test_a_kernel_that_keeps_results_by_input_address_fails_reshuffled_inputs():
    """reshuffled_inputs: new values in the same buffers must give new outputs; a launcher that
    replays what it wrote for an input address it has seen fails it (the honest one passes)."""
    honest = KC.judge_variant(make("router_select", MINI_SEL), seeds=(0,), stress_runs=2)
    assert next(c for c in honest["checks"] if c["name"] == "reshuffled_inputs")["passed"]

    box = [None, {}]
    ref = reference_launcher(box)
    kept = {}

    def by_address(args):
        mk = box[0]
        named = {p["name"]: a for p, a in zip(mk.params, args)}
        key = named["logits"].data_ptr()
        if key in kept:
            for n in mk.outs:
                named[n].copy_(kept[key][n])
            return
        ref(args)
        kept[key] = {n: named[n].clone() for n in mk.outs}

    mk = KC.MultiKernel(meta=fake_meta("router_select", MINI_SEL), device="cpu", launcher=by_address)
    box[0] = mk
    res = mk.same_buffers(KC.kernel_cases("router_select", MINI_SEL, (0,))[0], load_policy())
    assert not res["passed"] and "new values in the previous launch's input buffers" in res["detail"], res


def test_expert_bytes_are_the_mean_over_the_rotated_routings():
    """The routed experts' bench cycles through routings that select different numbers of
    experts; the bytes per launch are their mean, so a routing with more experts than the others
    cannot put the kernel above the read ceiling."""
    from types import SimpleNamespace

    w = torch.zeros(16, 4, 8, dtype=torch.bfloat16)  # 16 experts of 64 bytes
    out = SimpleNamespace(nbytes=lambda: 10)
    mk = SimpleNamespace(name="moe_w13", specs={"out": out}, outs=("out",))
    pairs = [({"w13": w}, {"ids": torch.tensor([[0, 1], [2, 3]])}),  # 4 experts
             ({"w13": w}, {"ids": torch.tensor([[0, 1], [0, 1]])})]  # 2 experts
    assert [KC.bytes_moved(mk, i, e) for i, e in pairs] == [4 * 64 + 10, 2 * 64 + 10]
    assert KC.mean_bytes_moved(mk, pairs) == 3 * 64 + 10
