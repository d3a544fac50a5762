"""Routed experts (kernels/ops/moe_experts.py): the two ops' references compose to the project's
routed_experts for every routing pattern on the mini preset (tiny's widths are not multiples of
the 32-wide k step the ops are planned for); contract with the manifest; plans (stream,
warpgroup); k3 builds (64-bit expert offsets); the stream path's SASS issues
every copy before its one wait and, with pdl, reads no routing before griddepcontrol.wait (the
audit flags a planted mutant that does)."""

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
    up = MX.ExpertsUpOp(_shape(T))
    down = MX.ExpertsDownOp(_shape(T), wg=1, wg_stages=2)  # mini's 384: no stream plan
    meta = up.routing_tensors(ids)
    act = up.reference(z=z, w13=w.w13, ids=ids, **meta)["act"]
    c = down.reference(act=act, w2=w.w2, weights=wts, ids=ids, **meta)["c"]
    want = reference.routed_experts(z, ids, wts, w.w13, w.w2)
    torch.testing.assert_close(c.float(), want.float(), rtol=0, atol=0)


def test_default_tunables_and_params_follow_the_manifest():
    for name, cls in (("moe_w13", MX.ExpertsUpOp), ("moe_w2", MX.ExpertsDownOp)):
        spec = load_manifest().kernel(name)
        assert set(cls.TUNABLES) == set(spec.tunable_defaults())
        assert cls(spec.shapes[0]).tunables == spec.tunable_defaults()
        for shape in spec.shapes:
            op = cls(shape)
            assert list(op.tensor_specs()) == [p.name for p in spec.params]
            lc = op.launch_config()
            assert not op.wg and lc.pdl  # the defaults: the stream path, which waits
            wg = cls(shape, wg=1)
            assert wg.wg and not wg.launch_config().pdl  # pdl only where the kernel waits


def test_stream_plans_at_batch_1():
    """moe_w13: a CTA per (expert, block of act columns): their gate rows and up rows (7 KB
    each), 32 threads per row by default (2 pairs), 64 with one pair; moe_w2: a CTA per (expert,
    block of W2 rows), 4 rows by default, one counter per row block."""
    up = MX.ExpertsUpOp(K3)
    P = up.stream_plan
    assert (P.rows, P.row_threads, P.vectors, up.stream_cols) == (4, 32, 14, 2)
    assert up.launch_config().grid == (16 * 1536, 1, 1) and up.threads == 128
    assert up.smem_bytes >= 5 * 3584 * 2  # four weight rows and z
    one = MX.ExpertsUpOp(K3, stream_cta_kib=8)
    assert (one.stream_plan.rows, one.stream_plan.row_threads, one.stream_cols, one.ctas) == (2, 64, 1, 16 * 3072)
    down = MX.ExpertsDownOp(K3)
    assert (down.stream_plan.rows, down.stream_plan.vectors, down.ctas) == (4, 12, 16 * 896)
    assert down.tensor_specs()["counters"].shape == (896,)  # one per row block, as the block allocates
    narrow = MX.ExpertsDownOp(K3, stream_cta_kib=8)
    assert (narrow.rows_per_cta, narrow.row_blocks, narrow.ctas) == (1, 3584, 16 * 3584)
    assert narrow.tensor_specs()["counters"].shape == (3584,)


def test_stream_plans_past_batch_1_keep_the_cta_and_add_activation_slots():
    """Batch 8: the same CTAs as batch 1 (rows, threads), one per (possible group, block), and
    `stream_slots` activation rows (at most the batch) in shared memory beside the weights."""
    b8 = {**K3, "batch": 8}
    groups = 8 * 16  # every (token, expert) pair its own group at most: the grid's bound
    up, down = MX.ExpertsUpOp(b8), MX.ExpertsDownOp(b8)
    assert up.x_slots == down.x_slots == 1
    assert (up.stream_plan.rows, up.threads, up.ctas) == (4, 128, groups * 1536)
    assert (down.stream_plan.rows, down.threads, down.ctas) == (4, 128, groups * 896)
    two = MX.ExpertsUpOp(b8, stream_slots=2)
    assert two.smem_bytes - up.smem_bytes == 3584 * 2 + 4 * 4  # one more z row, one more partial per warp
    assert MX.ExpertsDownOp({**K3, "batch": 2}, stream_slots=4).x_slots == 2  # never more slots than tokens
    assert up.smem_bytes <= 228 * 1024 // 6  # six CTAs per SM by shared memory


def test_the_token_chunks_cover_each_group_once():
    """The kernel's chunk loop: chunk 0 with the weights, then c0 = S, 2S, ... < cnt; slot s of a
    chunk holds position min(c0 + s, cnt - 1) and is stored only when c0 + s < cnt."""
    for S in (1, 2, 4):
        for cnt in range(1, 17):
            stored = [c0 + s for c0 in range(0, cnt, S) for s in range(S) if c0 + s < cnt]
            assert stored == list(range(cnt))
            assert all(min(c0 + s, cnt - 1) < cnt for c0 in range(0, cnt, S) for s in range(S))


@pytest.mark.parametrize("cls, shape, tunables, fragment", [
    (MX.ExpertsUpOp, {**K3, "batch": 0}, {}, "batch 0"),
    (MX.ExpertsDownOp, K3, {"splits": 2}, "unknown tunables"),
    (MX.ExpertsUpOp, K3, {"stream_threads": 32}, "at least 64 threads"),
    (MX.ExpertsDownOp, K3, {"pdl": 2}, "pdl must be 0 or 1"),
    (MX.ExpertsDownOp, {**K3, "expert_inter": 384}, {}, "the stream path"),  # 48 vectors: no whole warps
    (MX.ExpertsUpOp, {**K3, "batch": 8}, {"stream_max_batch": 16}, "unknown tunables"),
    (MX.ExpertsDownOp, {**K3, "batch": 8}, {"stream_slots": 0}, "at least 1"),
])
def test_rejects_what_it_cannot_compute(cls, shape, tunables, fragment):
    with pytest.raises(ValueError, match=fragment):
        cls(shape, **tunables)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [MX.ExpertsUpOp, MX.ExpertsDownOp])
def test_k3_build_ptx(tmp_path, cls):
    cute = pytest.importorskip("cutlass.cute")
    op = cls(K3)  # the stream path
    cute.compile(op, *op.fake_args(), options=f"--keep-ptx --gpu-arch sm_90a --dump-dir {tmp_path}")
    ptx = next(Path(tmp_path).glob("*.ptx")).read_text()
    assert "cp.async.cg.shared.global" in ptx
    # expert offsets in 64 bits: k3's experts hold 2^34 elements
    per_expert = (2 * 3072 * 3584 if cls is MX.ExpertsUpOp else 3584 * 3072) * 2
    assert f"mul.wide.s32" in ptx and str(per_expert) in ptx


def _sass_ops(art):
    """The SASS instructions in order, each without its guard predicate (`@!P0 LDGSTS ...` ->
    `LDGSTS ...`: the token loop's copies are predicated on the copying row)."""
    text = Path(art.paths["sass"]).read_text()
    ops = [l.split("*/", 1)[1].split(";")[0].strip() for l in text.splitlines()
           if l.strip().startswith("/*") and "*/" in l and ";" in l]
    return [o.split(None, 1)[1] if o.startswith("@") else o for o in ops]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kernel, w_copies", [("moe_w13", 14), ("moe_w2", 12)])
def test_stream_sass_waits_for_the_routing_then_issues_every_copy_before_the_first_use(tmp_path, kernel, w_copies,
                                                                                       batch):
    """Through the real build with pdl, batch 1 and 8 on k3: griddepcontrol.wait (ACQBULK) precedes
    every global load (the routing, z and act are earlier kernels' outputs); every 16-byte copy
    of W (L2 only) and of the activation row is issued before the one wait (DEPBAR) and the first
    shared load; 64-bit expert offsets; the static audit is clean."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant
    from kernels.manifest import load_manifest
    from validation.race.artifacts import audit_artifact

    art = build_variant(kernel, {**K3, "batch": batch}, {"pdl": 1}, root=tmp_path)
    ops = _sass_ops(art)
    acq = [i for i, o in enumerate(ops) if o.startswith("ACQBULK")]
    loads = [i for i, o in enumerate(ops) if o.split()[0].startswith(("LDG", "LDGSTS"))]
    copies = [i for i, o in enumerate(ops) if o.startswith("LDGSTS")]
    w = [i for i in copies if "BYPASS" in ops[i]]
    wait = min(i for i, o in enumerate(ops) if o.startswith("DEPBAR"))
    first_use = min(i for i, o in enumerate(ops) if o.split()[0].startswith(("LDS", "FFMA")) and "RZ, [RZ]" not in o)
    assert len(acq) == 1 and acq[0] < min(loads)
    before = [i for i in copies if i < wait]
    after = [i for i in copies if i > wait]
    # every W copy and the first chunk's activation row before the first wait and first use;
    # past batch 1 the token loop's activation copies (one slot: one row) come after it
    assert len(w) == w_copies and len(before) == 2 * w_copies and max(w) < wait < first_use
    assert len(after) == (0 if batch == 1 else w_copies) and not set(after) & set(w)
    assert "mul.wide.s32" in Path(art.paths["ptx"]).read_text()
    assert audit_artifact(art, load_manifest().kernel(kernel)).clean


@pytest.mark.slow
def test_audit_flags_a_routing_read_before_the_pdl_wait():
    """The planted mutant reads group_expert before griddepcontrol.wait: the static audit must
    name that load (the unmutated kernel is clean in the test above)."""
    pytest.importorskip("cutlass")
    from validation.race.artifacts import audit_kernel

    rep = audit_kernel("moe_w13", mutant="routing_before_wait")
    assert not rep.clean and "load-before-griddep-wait" in rep.rules_hit()
    assert "group_expert" in str([f for f in rep.findings if f.rule == "load-before-griddep-wait"])


def test_warpgroup_path_plan_and_contract():
    """`wg` 1: a CTA per possible (group,
    64-row block) item, one warpgroup; act and w2 reach the kernel as TMA descriptors (one
    64-k swizzle line per box: wg_n act rows; 64 rows of one expert); the ring's shared memory;
    what it cannot do is refused with the reason."""
    shape = {**K3, "batch": 64}
    op = MX.ExpertsDownOp(shape, wg=1)
    assert op.wg
    assert (op.rows_per_cta, op.row_blocks, op.stage_k, op.k_tiles, op.wg_n, op.stages) == (64, 56, 128, 24, 8, 4)
    lc = op.launch_config()
    assert lc.grid == (896 * 56, 1, 1) and lc.block == (128, 1, 1)
    # 4 stages x (64 W rows + 8 act rows) x 128 k x 2 B, 2 KB of swizzle alignment, 8 mbarriers, the verdict
    assert lc.smem_bytes == 4 * 72 * 128 * 2 + 2048 + 8 * 8 + 8 + 16 + 16
    specs = op.tensor_specs()
    assert specs["act"].tma.box == (64, 8) and specs["w2"].tma.box == (64, 64, 1)
    assert specs["w2"].tma.l2_promotion == 0 and specs["counters"].shape == (56,)
    assert specs["w2"].to_dict()["tma"]["box"] == [64, 64, 1]
    # wg off: the stream path, no descriptors
    assert MX.ExpertsDownOp({**K3, "batch": 8}, wg=1).wg
    assert MX.ExpertsDownOp(shape).tensor_specs()["w2"].tma is None
    # moe_w13's form: 32 gate + 32 up rows per CTA, its gathered tokens by cp.async (no TMA maps)
    up = MX.ExpertsUpOp(shape, wg=1)
    assert up.wg and (up.half_rows, up.row_blocks, up.k_tiles, up.wg_n) == (32, 96, 28, 8)
    assert up.launch_config().grid == (896 * 96, 1, 1) and up.tensor_specs()["z"].shape == (64, 3584)
    assert up.launch_config().smem_bytes == 4 * 72 * 128 * 2 + 2048 + 8 * 8 + 8 + 64 * 8 * 4 + 16
    with pytest.raises(ValueError, match="wg_n must be one of 8, 16 and"):
        MX.ExpertsUpOp(shape, wg=1, wg_n=32)
    with pytest.raises(ValueError, match="wg_stages must be 2..24"):
        MX.ExpertsDownOp(shape, wg=1, wg_stages=25)
    with pytest.raises(ValueError, match="wg_n must be one of 8, 16, 32, 64"):
        MX.ExpertsDownOp(shape, wg=1, wg_n=12)
    with pytest.raises(ValueError, match="wg_k must be 64 or 128"):
        MX.ExpertsDownOp(shape, wg=1, wg_k=256)
    with pytest.raises(ValueError, match="shared memory"):
        MX.ExpertsDownOp(shape, wg=1, wg_n=64, wg_stages=8)


@pytest.mark.slow
def test_warpgroup_path_sass(tmp_path):
    """Through the real build, k3 batch 64 with `wg` 1: W2 arrives only by 3-D TMA boxes and act
    only by 2-D ones (two 64-k boxes of each per stage: 4 prologue stages + the loop's refill),
    the tensor cores are HGMMA 64x8x16 (8 per 128-k stage), nothing of W or act is read into a
    register, and the combine's arrival is the gpu-scope atomic of the other paths."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant

    art = build_variant("moe_w2", {**K3, "batch": 64}, {"wg": 1}, root=tmp_path)
    assert [(p["name"], p["size"]) for p in art.meta["params"][:2]] == [("act", 128), ("w2", 128)]
    assert art.meta["params"][1]["spec"]["tma"] == {"box": [64, 64, 1], "swizzle": 128, "l2_promotion": 0}
    assert art.meta["resources"]["spill_store_bytes"] == 0 and art.meta["resources"]["local_bytes"] == 0
    ops = _sass_ops(art)
    assert sum(o.startswith("UTMALDG.3D") for o in ops) == 2 * 4 + 2
    assert sum(o.startswith("UTMALDG.2D") for o in ops) == 2 * 4 + 2
    mmas = [o.split()[0] for o in ops if o.startswith("HGMMA")]
    assert len(mmas) == 8 and set(mmas) == {"HGMMA.64x8x16.F32.BF16"}
    assert not any(o.startswith("LDGSTS") for o in ops) and not any(".CONSTANT" in o for o in ops)
    assert sum(o.startswith("ATOMG.E.ADD.STRONG.GPU") for o in ops) == 1


@pytest.mark.slow
def test_up_warpgroup_path_sass(tmp_path):
    """moe_w13's warpgroup path, k3 batch 64: W by 16-byte L2-only cp.async (8 per thread and
    stage: 3 prologue stages + the loop's), the gathered z rows by cp.async through L1 (one per
    thread and stage), HGMMA 64x8x16 (8 per 128-k stage), the async-proxy fence once in the loop;
    the race audit is clean."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant
    from validation.race.artifacts import audit_kernel

    shape = {**K3, "batch": 64}
    art = build_variant("moe_w13", shape, {"wg": 1}, root=tmp_path)
    ops = _sass_ops(art)
    assert sum(o.startswith("LDGSTS.E.BYPASS.128") for o in ops) == 8 * 4
    assert sum(o.startswith("LDGSTS.E.128") for o in ops) == 4
    mmas = [o.split()[0] for o in ops if o.startswith("HGMMA")]
    assert len(mmas) == 8 and set(mmas) == {"HGMMA.64x8x16.F32.BF16"}
    assert sum(o.startswith("FENCE.VIEW.ASYNC.S") for o in ops) == 1
    assert art.meta["resources"]["spill_store_bytes"] == 0
    assert not audit_kernel("moe_w13", shape=shape, tunables={"wg": 1}).findings
