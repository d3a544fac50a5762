"""The block chain (kernels/block.py), the torch baseline and the proof's byte accounting on CPU;
on a GPU host with a carried build, the chained kernels against the float64 oracle."""

from pathlib import Path

import pytest
import torch

from benchmarks.block_baseline import torch_block
from kernels import reference
from kernels.block import block_tunables, block_variants
from kernels.config import DECODE_BATCH_SIZES, get_config
from kernels.manifest import load_manifest
from validation import block_stage as BP

K3 = get_config("k3")


def test_every_block_variant_is_a_manifest_variant():
    """...but W_sgu's gemv with fp32 output (the foundation proves it in bf16), a shape the gemv op
    plans like its manifest neighbour."""
    from kernels.ops.gemv import GemvOp

    man = load_manifest()
    for T in DECODE_BATCH_SIZES:
        for role, name, shape in block_variants(K3, T):
            if role == "shared_gate_up" and name == "gemv":
                assert shape == {"batch": T, "n": 12288, "k": 7168, "out_dtype": "float32"}
                bf = GemvOp({**shape, "out_dtype": "bfloat16"})
                assert GemvOp(shape).launch_config() == bf.launch_config()
                continue
            assert shape in [dict(s) for s in man.kernel(name).shapes], (name, shape)


def test_dense_projections_are_gemv_launches_at_their_batches():
    from kernels.block import GEMV_DENSE, GEMV_ROUTER

    for T in DECODE_BATCH_SIZES:
        roles = {role: name for role, name, _ in block_variants(K3, T)}
        want = {"norm_pre": "rmsnorm", "router": "router", "w13": "moe_w13", "w2": "moe_w2", "norm_latent": "rmsnorm"}
        if T in GEMV_ROUTER:
            want.update(logits="gemv", router="router_select", down="gemv")
        if T in GEMV_DENSE:
            want.update(shared_gate_up="gemv", shared_situ="gated_situ", shared_down="gemv", up="gemv",
                        residual="residual")
        else:
            want.update(shared_gate_up="shared_gate_up", latent_out="latent_out")
        assert roles == want, T
        assert block_tunables("gemv", T) == {} and block_tunables("residual", T) == {}


def test_block_tunables_are_manifest_choices_and_the_ops_take_the_declared_design():
    from kernels.build import resolve_tunables
    from kernels.ops.moe_experts import ExpertsDownOp, ExpertsUpOp

    man = load_manifest()
    for T in DECODE_BATCH_SIZES:
        for _role, name, shape in block_variants(K3, T):
            tun = block_tunables(name, T)
            resolve_tunables(man.kernel(name), tun)  # raises on a name or value the manifest lacks
            if name in ("moe_w13", "moe_w2"):  # the path the block table declares at this batch
                wg = (name == "moe_w2" and T >= 2) or (name == "moe_w13" and T >= 16)
                op = (ExpertsUpOp if name == "moe_w13" else ExpertsDownOp)(shape, **tun)
                assert op.wg == wg and op.launch_config().pdl == (not wg), (name, T)
    assert block_tunables("router", 16) == {} and block_tunables("moe_w2", 16) == {"wg": 1}
    assert block_tunables("router", 1) == {} and block_tunables("moe_w13", 3) == {}


def test_every_block_plan_tunable_is_a_known_tunable_of_a_kernel_launched_there():
    """kernels/block_plan.toml names, at each batch, only kernels the block launches at that
    batch, and only tunables (and choices) their manifest entry declares and their op knows: a
    stale entry (the tunables of a deleted design, of a kernel the batch does not run) fails."""
    import importlib

    from kernels import block as B
    from kernels.build import resolve_tunables

    man = load_manifest()
    for T, entry in B.block_plan().items():
        launched = {name for _role, name, _shape in block_variants(K3, T)}
        for name, tun in entry["tunables"].items():
            assert name in launched, (T, name)
            spec = man.kernel(name)
            assert set(tun) <= {t.name for t in spec.tunables}, (T, name, tun)
            resolve_tunables(spec, tun)  # a value that is not one of its choices raises
            mod, _, cls = spec.op.partition(":")
            assert set(tun) <= set(getattr(importlib.import_module(mod), cls).TUNABLES), (T, name, tun)


def test_the_router_kernel_is_refused_past_its_batches():
    from kernels import block as B

    assert [r for r, _, _ in B.block_variants(K3, 4, gemv_router=False)][:2] == ["norm_pre", "router"]
    with pytest.raises(ValueError, match="at most 4 tokens"):
        B.block_variants(K3, 8, gemv_router=False)


def test_the_block_plan_is_one_declared_table():
    """kernels/block_plan.toml declares every decode batch; the router and output choices give
    GEMV_ROUTER / GEMV_DENSE, and `block_plan()` hands the validator a copy."""
    from kernels import block as B

    plan = B.block_plan()
    assert sorted(plan) == list(DECODE_BATCH_SIZES)
    assert B.GEMV_ROUTER == (4, 8, 16, 32, 64) and B.GEMV_DENSE == (8, 16, 32, 64)
    assert [B.router_by_gemv(T) for T in (1, 2, 4)] == [False, False, True]
    plan[1]["tunables"]["moe_w2"] = {"wg": 1}  # a copy: the block's own plan is unchanged
    assert B.block_tunables("moe_w2", 1) == {}


@pytest.mark.parametrize("text, fragment", [
    ("[batch.1]\nrouter = 'kernel'\n", "router must be one of"),
    ("[batch.x]\nrouter = 'kernel'\noutput = 'fused'\n", "positive batch size"),
    ("[batch.1]\nrouter = 'kernel'\noutput = 'fused'\nwg = 1\n", "only router, output and tunables"),
    ("[batch.1\n", "Expected"),
    ("", "no \\[batch.N\\] table"),
])
def test_a_bad_block_plan_is_refused_with_one_message(tmp_path, text, fragment):
    from kernels.block import BlockPlanError, load_block_plan

    f = tmp_path / "plan.toml"
    f.write_text(text)
    with pytest.raises(BlockPlanError, match=fragment):
        load_block_plan(f)


def test_block_imports_without_the_dsl():
    import subprocess
    import sys

    code = ("import sys; sys.modules['cutlass'] = None; import kernels.block, kernels.ops.router, "
            "kernels.ops.moe_experts, kernels.ops.latent_out; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("T", [1, 4])
def test_torch_baseline_is_the_block(T):
    cfg = get_config("tiny")
    w = reference.make_weights(cfg)
    x = reference.make_hidden(cfg, T)
    want = reference.moe_block(x, w, cfg)
    got = torch_block(x, w, cfg)
    assert (got.float() - want.float()).norm() / want.float().norm() < 2e-2


class _Fake:
    """A loaded kernel that records its launches (role, argument ids) in `log`."""

    def __init__(self, role, log, params=(), kernel=None):
        self.role, self.log = role, log
        self.meta = {"kernel": kernel or role,
                     "params": [{"name": n, "spec": {"shape": [4], "dtype": "int32"}} for n in params]}

    def __call__(self, *args):
        self.log.append((self.role, args))


@pytest.mark.parametrize("T, router, dense", [(4, False, False), (8, True, False), (64, True, True)])
def test_block_chain_passes_each_launch_its_producers_outputs(T, router, dense, monkeypatch):
    """On CPU with recording kernels (one stream): the launch order and which buffer each
    launch reads and writes, with the fused router and dense ops, with the router's projections
    as gemv launches, and with every dense projection a gemv."""
    from kernels import block as B

    monkeypatch.setattr(B, "GEMV_ROUTER", (T,) if router else ())
    monkeypatch.setattr(B, "GEMV_DENSE", (T,) if dense else ())
    from kernels.block import BlockKernels, MoEBlock

    cfg = get_config("tiny")
    w = reference.make_weights(cfg)
    log = []
    roles = [r for r, _, _ in block_variants(K3, T)]
    kinds = {r: k for r, k, _ in block_variants(K3, T)}
    owned = {"gemv": ("counters", "partials"), "moe_w2": ("counters", "partials"), "router": ("counter",),
             "router_select": ("counter",)}
    ks = BlockKernels(**{r: _Fake(r, log, owned.get(kinds[r], ()), kinds[r]) for r in roles})
    blk = MoEBlock(cfg, T, w, concurrent=False, kernels=ks)
    x, out = torch.zeros(T, cfg.hidden, dtype=torch.bfloat16), torch.zeros(T, cfg.hidden, dtype=torch.bfloat16)
    blk.launch(x, out)
    b = blk.buf
    got = [(r, a) for r, a in log]
    order = [r for r, _ in got]
    args = dict(got)

    def same(t, u):
        return t is u

    assert same(args["norm_pre"][2], b["h"]) and same(args["w13"][0], b["z"]) and same(args["w2"][0], b["act"])
    assert same(args["norm_latent"][0], b["c"]) and same(args["norm_latent"][2], b["n"])
    if "down" in roles:
        assert order[:4] == ["norm_pre", "logits", "router", "down"]
        assert same(args["logits"][0], b["h"]) and same(args["logits"][1], w.w_gate)
        assert same(args["logits"][2], b["logits"]) and same(args["router"][0], b["logits"])
        assert same(args["router"][1], w.bias) and same(args["router"][8], b["router_counter"])
        assert same(args["down"][0], b["h"]) and same(args["down"][1], w.w_down) and same(args["down"][2], b["z"])
        assert same(args["down"][3], b["down_partials"]) and same(args["down"][4], b["down_counters"])
    else:
        assert order[:2] == ["norm_pre", "router"] and same(args["router"][12], b["z"])
    if "residual" in roles:
        assert order[-8:] == ["w13", "w2", "norm_latent", "shared_gate_up", "shared_situ", "shared_down", "up",
                              "residual"]
        assert same(args["shared_gate_up"][2], b["gu"]) and same(args["shared_situ"][0], b["gu"])
        assert same(args["shared_situ"][1], b["a_shared"]) and same(args["shared_down"][0], b["a_shared"])
        assert same(args["shared_down"][2], b["s"]) and same(args["up"][0], b["n"]) and same(args["up"][1], w.w_up)
        assert same(args["up"][2], b["r"])
        assert [id(a) for a in args["residual"]] == [id(x), id(b["r"]), id(b["s"]), id(out)]
        # every gemv launch has its own split-K scratch (two may run at once)
        gemvs = [r for r in ("logits", "down", "shared_gate_up", "shared_down", "up") if r in roles]
        assert len({id(args[r][4]) for r in gemvs}) == len(gemvs) == 5
    else:
        assert order[-4:] == ["w2", "norm_latent", "shared_gate_up", "latent_out"]
        assert same(args["shared_gate_up"][2], b["a_shared"])
        assert [id(a) for a in args["latent_out"]] == [id(x), id(b["n"]), id(w.w_up), id(b["a_shared"]),
                                                       id(w.w_shared_down), id(out)]


def test_block_bytes_count_dense_weights_and_selected_experts():
    dense = K3.dense_params() * 2 + K3.n_experts * 4
    one = K3.routed_expert_params() * 2
    assert BP.block_bytes(K3, 1, 16) == dense + 16 * one + 2 * K3.hidden * 2
    ops = BP.op_bytes(K3, 1, 16)
    assert ops["moe_w13"] + ops["moe_w2"] > 16 * one  # weights plus activations
    assert 1.4e9 < BP.block_bytes(K3, 1, 16) < 1.5e9


def test_judge_applies_the_ratio_and_the_floor():
    o = torch.ones(100, dtype=torch.float64)
    torch_path = o + 1e-2
    assert BP.judge("x", o + 1.5e-2, o, torch_path)["passed"]
    assert not BP.judge("x", o + 3e-2, o, torch_path)["passed"]
    assert BP.judge("x", o + 1e-3, o, o)["passed"]  # under the bf16 floor
    assert not BP.judge("x", o * float("nan"), o, torch_path)["passed"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and a carried build")
@pytest.mark.parametrize("T", [1, 8])
def test_block_on_gpu_matches_the_oracle(T):
    from kernels.block import MoEBlock

    w = reference.make_weights(K3, "cuda")
    blk = MoEBlock(K3, T, w)
    x = reference.make_hidden(K3, T, "cuda")
    out = torch.full_like(x, float("nan"))
    blk.launch(x, out)
    torch.cuda.synchronize()
    ids = blk.buf["ids"]
    row = BP.judge("block", out, reference.moe_block(x, w, K3, compute_dtype=torch.float64, ids=ids),
                   reference.moe_block(x, w, K3, ids=ids))
    assert row["passed"], row


def test_the_block_stage_runs_the_plans_cubins_not_the_checkouts(tmp_path, monkeypatch):
    """validate block loads each variant from the folder its plan recorded (after checking the
    cubin against the plan's sha256), not from this checkout's block_tunables or a rebuild of
    today's sources: the base's block runs as the base built it; a variant the plan lacks is named."""
    from kernels import block as B
    from kernels.launch import CubinKernel

    variants = B.block_variants(K3, 32)
    cases = [{"role": role, "kernel": name, "shape": dict(shape), "dir": f"built/{role}"}
             for role, name, shape in variants]
    pick = BP.plan_dirs(cases, tmp_path, 32)
    at = {role: i for i, (role, _, _) in enumerate(variants)}
    _, name, shape = variants[at["w13"]]  # moe_w13 at batch 32
    assert pick(name, dict(reversed(list(shape.items())))) == tmp_path / "built/w13"  # key order does not matter
    with pytest.raises(BP.BlockError, match=r"the plan has no moe_w2 variant .*batch 32"):
        BP.plan_dirs(cases[:at["w2"]], tmp_path, 32)("moe_w2", dict(variants[at["w2"]][2]))
    assert BP.plan_variants(cases) == variants
    legacy = B.block_variants(K3, 4, gemv_router=False, gemv_dense=False)
    assert [r for r, _, _ in legacy] == ["norm_pre", "router", "w13", "w2", "norm_latent", "shared_gate_up",
                                         "latent_out"]
    # load_block_kernels takes exactly those folders (no lookup under a build root)
    seen = []
    monkeypatch.setattr(CubinKernel, "from_dir", classmethod(lambda cls, d: seen.append(Path(d)) or cls.__new__(cls)))
    monkeypatch.setattr(CubinKernel, "load", lambda self: None)
    monkeypatch.setattr(B, "find_artifact", lambda *a, **k: pytest.fail("looked up a build"))
    B.load_block_kernels(K3, 32, dirs=pick, variants=BP.plan_variants(cases))
    assert seen == [tmp_path / f"built/{r}" for r, _, _ in variants]
