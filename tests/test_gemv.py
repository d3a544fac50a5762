"""The decode GEMM op (kernels/ops/gemv.py): its contract with the manifest, the build and the
reference on CPU; its PTX (tensor-core mmas, 16-byte loads, the read-only path only for W); and,
on a GPU host with a carried build, its numerics against the float64 oracle."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.manifest import load_manifest
from kernels.ops import gemv as G

REPO = Path(__file__).resolve().parent.parent
SPEC = load_manifest().kernel("gemv")


def test_default_tunables_are_the_manifest_defaults():
    """The op knows the manifest's tunables by name and takes their defaults from it (declared once)."""
    assert set(G.GemvOp.TUNABLES) == set(SPEC.tunable_defaults())
    assert G.GemvOp(SPEC.shapes[0]).tunables == SPEC.tunable_defaults()
    assert not hasattr(G, "DEFAULT_TUNABLES")


def test_every_manifest_variant_is_valid_with_default_tunables():
    assert len(SPEC.shapes) == 35
    for shape in SPEC.shapes:
        op = G.GemvOp(shape)
        lc = op.launch_config()
        assert lc.block == (32 * op.warps, 1, 1)
        if op.stream:  # whole rows per CTA; the threads of a row cover it in equal 16-byte strides
            assert shape["batch"] == 1 and lc.grid[0] * op.rows_per_cta == shape["n"]
            assert op.plan.row_threads * op.plan.vectors * 8 == shape["k"] and op.plan.row_threads % 32 == 0
            assert lc.smem_bytes <= G.SMEM_LIMIT
        elif op.wg:  # grid (splits, row blocks), the splits one cluster; whole stages; one wave
            assert shape["batch"] >= 8 and shape["batch"] % 8 == 0
            assert lc.grid[1] * op.rows_per_cta == shape["n"] and lc.grid[0] == op.splits
            assert op.splits * op.groups * op.stage_k == shape["k"] and 2 <= op.stages <= op.groups + 1
            assert lc.cluster == ((op.splits, 1, 1) if op.splits > 1 else None) and op.splits <= G.MAX_CLUSTER
            assert lc.smem_bytes <= G.WG_SMEM_LIMIT
            per_sm = min(G.SM_SMEM // (lc.smem_bytes + G.CTA_SMEM_RESERVED), G.SM_THREADS // op.threads)
            assert lc.grid[0] * lc.grid[1] <= G.FILL_CTAS * per_sm
        else:  # the warp-split design: batches 2 and 4
            assert shape["batch"] in (2, 4) and lc.grid[0] * op.rows_per_cta == shape["n"]
            assert lc.smem_bytes <= G.SMEM_LIMIT
        partials = (1, 1, 1) if op.wg and op.cluster else (op.splits, shape["batch"], shape["n"])
        assert op.tensor_specs()["partials"].shape == partials  # a cluster reduces without them
        assert op.tensor_specs()["counters"].shape == (shape["n"] // op.rows_per_cta,)


def test_tensor_specs_follow_the_manifest_parameters():
    op = G.GemvOp({"batch": 4, "n": 896, "k": 7168, "out_dtype": "float32"})
    specs = op.tensor_specs()
    assert list(specs) == [p.name for p in SPEC.params]
    assert specs["x"].shape == (4, 7168) and specs["x"].dtype == "bfloat16"
    assert specs["w"].shape == (896, 7168) and specs["w"].dtype == "bfloat16"
    assert specs["y"].shape == (4, 896) and specs["y"].dtype == "float32"
    assert specs["partials"].dtype == "float32" and specs["counters"].dtype == "int32"


@pytest.mark.parametrize("shape, tunables, fragment", [
    ({"batch": 2, "n": 100, "k": 512}, {}, "rows per CTA"),
    ({"batch": 2, "n": 64, "k": 520}, {}, "multiple of 32"),
    ({"batch": 1, "n": 64, "k": 516}, {}, "multiple of 8"),
    ({"batch": 1, "n": 7, "k": 56}, {}, "7 16-byte vectors per row"),
    ({"batch": 1, "n": 64, "k": 512}, {"stream_threads": 48}, "threads must be a multiple of 32"),
    ({"batch": 0, "n": 64, "k": 512}, {}, "batch 0"),
    ({"batch": 65, "n": 64, "k": 512}, {}, "batch 65"),
    ({"batch": 1, "n": 64, "k": 512, "out_dtype": "float16"}, {}, "out_dtype"),
    ({"batch": 1, "n": 64}, {}, "missing"),
    ({"batch": 1, "n": 64, "k": 512}, {"rows_per_warp": 2}, "unknown tunables"),
    ({"batch": 1, "n": 64, "k": 512}, {"prefetch": 1}, "unknown tunables"),
    ({"batch": 1, "n": 64, "k": 512}, {"pdl": 2}, "pdl must be"),
    ({"batch": 16, "n": 128, "k": 576}, {}, "multiple of 128 \\(wg_k\\)"),
    ({"batch": 16, "n": 128, "k": 512}, {"wg_k": 96}, "wg_k must be"),
    ({"batch": 16, "n": 128, "k": 512}, {"wg_stages": 1}, "at least 2"),
])
def test_rejects_what_it_cannot_compute(shape, tunables, fragment):
    with pytest.raises(ValueError, match=fragment):
        G.GemvOp(shape, **tunables)


def test_tunables_adapt_to_the_batch():
    """One tunable setting serves every batch: row tiles double past batch 16 and halve to keep
    >= 132 CTAs, load groups shrink with the vectors per step, warps halve to fit shared memory."""
    b2 = G.GemvOp({"batch": 2, "n": 3584, "k": 7168})
    assert (b2.warps, b2.row_tiles, b2.k_unroll) == (8, 2, 5)  # 3 vectors per step, 16 per group
    assert not b2.stream and not b2.wg
    router = G.GemvOp({"batch": 2, "n": 896, "k": 7168})
    assert router.row_tiles == 1 and router.launch_config().grid[0] == 112
    b16 = G.GemvOp({"batch": 16, "n": 7168, "k": 3584}, wg_from_batch=65)
    assert not b16.wg and (b16.row_tiles, b16.k_unroll, b16.warps) == (2, 4, 8)
    b64 = G.GemvOp({"batch": 64, "n": 7168, "k": 3584}, wg_from_batch=65)  # the warp-split design
    assert (b64.row_tiles, b64.k_unroll, b64.warps) == (4, 1, 4)  # 8 warps' partials: 64 KB > 48 KB
    assert b64.smem_bytes == 4 * 64 * 32 * 4


def test_stream_design_at_batch_1():
    """Batch 1 (stream_max_batch): CTAs of whole rows, at most stream_cta_kib (8) KiB but at least one row; 128
    threads when they divide the row's 16-byte vectors (7168: 896 = 7 x 128), else fewer whole
    warps (3584: 448 = 7 x 64); all of W and x copied to shared memory, nothing else."""
    wide = G.GemvOp({"batch": 1, "n": 3584, "k": 7168})
    assert wide.stream and (wide.rows_per_cta, wide.threads, wide.plan.vectors) == (1, 128, 7)
    assert wide.launch_config().grid == (3584, 1, 1)
    assert wide.smem_bytes == (1 + 1) * 7168 * 2 + 4 * 4 + 64
    narrow = G.GemvOp({"batch": 1, "n": 7168, "k": 3584})
    assert (narrow.rows_per_cta, narrow.threads, narrow.plan.vectors) == (1, 64, 7)
    router = G.GemvOp({"batch": 1, "n": 896, "k": 7168, "out_dtype": "float32"})
    assert router.launch_config().grid == (896, 1, 1)
    # Larger CTAs hold several whole rows, the row's threads whole warps.
    big = G.GemvOp({"batch": 1, "n": 7168, "k": 3584}, stream_cta_kib=32, stream_threads=256)
    assert (big.rows_per_cta, big.plan.row_threads, big.threads, big.plan.vectors) == (4, 64, 256, 7)
    assert big.launch_config().grid == (1792, 1, 1)
    assert not G.GemvOp({"batch": 1, "n": 3584, "k": 7168}, stream_max_batch=0).stream
    assert G.GemvOp({"batch": 2, "n": 3584, "k": 7168}, stream_max_batch=2).stream


@pytest.mark.slow
def test_stream_sass_issues_every_copy_before_the_first_use(tmp_path):
    """Through the real build, batch 1: the SASS issues all 7 weight copies (LDGSTS, 16 bytes,
    L2 only) and x's 7 before the one wait (DEPBAR) and the first shared load, so every byte a
    thread needs is in flight at once; with pdl every weight copy precedes ACQBULK
    (griddepcontrol.wait) and every x copy follows it."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant

    shape = {"batch": 1, "n": 3584, "k": 7168, "out_dtype": "bfloat16"}
    for pdl in (0, 1):
        art = build_variant("gemv", shape, {"pdl": pdl}, root=tmp_path)
        flat = [l.split("*/", 1)[1].split(";")[0].strip() for l in Path(art.paths["sass"]).read_text().splitlines()
                if l.strip().startswith("/*") and "*/" in l and ";" in l]
        copies = [i for i, o in enumerate(flat) if "LDGSTS" in o]
        w_copies = [i for i in copies if "BYPASS" in flat[i]]
        first_use = min(i for i, o in enumerate(flat) if "LDS" in o.split()[0] or "FFMA" in o.split()[0])
        wait = min(i for i, o in enumerate(flat) if o.startswith("DEPBAR"))
        assert len(w_copies) == 7 and len(copies) == 14, [flat[i] for i in copies]
        assert max(copies) < wait < first_use
        assert not any(o.split()[0].startswith("LDG.") for o in flat)  # no register loads at all
        if pdl:
            acq = [i for i, o in enumerate(flat) if "ACQBULK" in o]
            assert len(acq) == 1 and max(w_copies) < acq[0] < min(set(copies) - set(w_copies))


def _sass_copies(art):
    """The SASS opcodes of a build (predicates dropped) and the indices of its 16-byte cp.async
    copies: W's (LDGSTS...BYPASS, L2 only) and x's (LDGSTS, kept in L1)."""
    flat = [l.split("*/", 1)[1].split(";")[0].strip() for l in Path(art.paths["sass"]).read_text().splitlines()
            if l.strip().startswith("/*") and "*/" in l and ";" in l]
    opc = [o.split()[1] if o.startswith("@") else o.split()[0] for o in flat]
    w_copies = [i for i, o in enumerate(opc) if o.startswith("LDGSTS") and "BYPASS" in o]
    x_copies = [i for i, o in enumerate(opc) if o.startswith("LDGSTS") and "BYPASS" not in o]
    return opc, w_copies, x_copies


def test_warpgroup_design_plan():
    """From wg_from_batch (8), batches that are a multiple of 8: 64-row CTAs (one warpgroup), 128
    rows (two) from batch 32 where the 64-row blocks are more than one per SM and the wider
    blocks still fill half the SMs (only 12288 rows); k split into as many CTAs as are resident in one wave, at most 8, one cluster per
    row block; 6-slot rings of 64 k, clamped to the CTA's stages + 1 and to shared memory."""
    b8 = G.GemvOp({"batch": 8, "n": 3584, "k": 7168}, wg_k=64)
    assert b8.wg and not b8.stream
    assert (b8.rows_per_cta, b8.threads, b8.splits, b8.groups, b8.stages) == (64, 128, 4, 28, 6)
    lc = b8.launch_config()  # 57 KB: 3 CTAs per SM, 224 CTAs; 8 splits (448) would not fit 396
    assert lc.grid == (4, 56, 1) and lc.cluster == (4, 1, 1) and lc.to_dict()["cluster"] == [4, 1, 1]
    # rings + alignment + verdict + the reduction's slots: 4 splits x 8 batch rows x (16 + 4) fp32
    # ... + the TMA path's full and empty mbarriers (6 + 6, 8 bytes each, + 8 of slack)
    assert b8.smem_bytes == 6 * (64 + 8) * 64 * 2 + 2 * 1024 + 16 + 4 * 8 * 20 * 4 + 16 + 13 * 8
    assert b8.tensor_specs()["w"].tma.box == (64, 64) and b8.tensor_specs()["x"].tma.box == (64, 8)
    assert b8.tensor_specs()["w"].tma.l2_promotion == 0
    with pytest.raises(ValueError, match="wg_k must be 64 or 128"):
        G.GemvOp({"batch": 8, "n": 3584, "k": 7168}, wg_k=256)
    assert b8.tensor_specs()["partials"].shape == (1, 1, 1)  # the cluster reduces in shared memory
    # From batch 32, 128-row CTAs only where the 64-row blocks alone are more than one per SM:
    # 7168 rows stay at 64 (112 blocks, no split), 12288 widen (192 narrow blocks -> 96, no split)
    b64 = G.GemvOp({"batch": 64, "n": 7168, "k": 3584}, wg_k=64)
    assert (b64.rows_per_cta, b64.threads, b64.splits) == (64, 128, 1)  # 112 CTAs, one per SM
    assert b64.launch_config().cluster is None
    assert (G.GemvOp({"batch": 64, "n": 7168, "k": 3584}, wg_k=64, wg_rows=128).rows_per_cta,
            G.GemvOp({"batch": 64, "n": 7168, "k": 3584}, wg_k=64, wg_rows=128).splits) == (128, 2)
    # 3584 rows: 56 blocks of 64, k split over a cluster of 2 (112 CTAs), not 28 of 128 split 4 ways
    down = G.GemvOp({"batch": 64, "n": 3584, "k": 7168})
    assert (down.rows_per_cta, down.splits, down.cluster) == (64, 2, (2, 1, 1))
    # the boundary: 132 narrow blocks (one per SM) stay narrow, 136 widen
    assert G.GemvOp({"batch": 32, "n": 132 * 64, "k": 3584}).rows_per_cta == 64
    assert G.GemvOp({"batch": 32, "n": 136 * 64, "k": 3584}).rows_per_cta == 128
    router = G.GemvOp({"batch": 64, "n": 896, "k": 7168, "out_dtype": "float32"}, wg_k=64)
    assert (router.rows_per_cta, router.splits) == (64, 8)  # 14 blocks: stays at 64
    whole = G.GemvOp({"batch": 64, "n": 12288, "k": 7168})
    assert whole.rows_per_cta == 128 and G.GemvOp({"batch": 16, "n": 12288, "k": 7168}).rows_per_cta == 64
    assert whole.splits == 1 and whole.launch_config().cluster is None and "cluster" not in whole.launch_config().to_dict()
    # Fixed split counts
    clustered = G.GemvOp({"batch": 16, "n": 3584, "k": 7168}, wg_min_ctas=264, wg_k=64)
    assert clustered.splits == 8  # a cluster's split count also divides the rows into float4 shares
    deep = G.GemvOp({"batch": 64, "n": 3584, "k": 7168}, wg_rows=256, wg_stages=8, wg_k=64)
    assert deep.splits == 8 and deep.stages == 3  # 3 x 40 KB of ring + 74 KB of slots (8 x 64 x 36 fp32)
    assert deep.smem_bytes <= G.WG_SMEM_LIMIT
    # The defaults: 128 k per stage (two TMA boxes per operand), 64 from n = 12288 on
    d64 = G.GemvOp({"batch": 64, "n": 7168, "k": 3584})
    # batch 64's stages are 32 KB (64 W rows + 64 x rows of 128 k): 5 fit `wg_ring_kib` (160)
    assert (d64.stage_k, d64.rows_per_cta, d64.splits, d64.stages) == (128, 64, 1, 5)
    assert G.GemvOp({"batch": 64, "n": 7168, "k": 3584}, wg_ring_kib=192).stages == 6
    assert G.GemvOp({"batch": 32, "n": 7168, "k": 3584}).stages == 6  # 24 KB stages: 144 KB
    assert G.GemvOp({"batch": 64, "n": 12288, "k": 7168}).stages == 6  # 128 rows of 64 k: 24 KB
    assert G.GemvOp({"batch": 64, "n": 7168, "k": 3584}, wg_ring_kib=96).stages == 3
    assert d64.tensor_specs()["w"].tma.box == (64, 64)  # a box stays one 128-byte line of k
    wide = G.GemvOp({"batch": 64, "n": 7168, "k": 3584}, wg_rows=128)
    assert (wide.stage_k, wide.rows_per_cta, wide.splits, wide.stages) == (128, 128, 2, 3)
    assert wide.tensor_specs()["w"].tma.box == (64, 128)
    assert G.GemvOp({"batch": 64, "n": 12288, "k": 7168}).stage_k == 64
    assert G.GemvOp({"batch": 64, "n": 12288, "k": 7168}, wg_k64_from_n=65536).stage_k == 128
    assert G.GemvOp({"batch": 20, "n": 3584, "k": 7168}).wg is False  # not a multiple of 8
    assert G.GemvOp({"batch": 8, "n": 3584, "k": 7168}, wg_from_batch=16).wg is False
    with pytest.raises(ValueError, match="wg_rows must be"):
        G.GemvOp({"batch": 16, "n": 3584, "k": 7168}, wg_rows=96)
    with pytest.raises(ValueError, match="multiple of 128 \\(wg_k\\)"):
        G.GemvOp({"batch": 16, "n": 3584, "k": 7232})


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_reference_is_the_projects_linear(out_dtype):
    op = G.GemvOp({"batch": 3, "n": 64, "k": 256, "out_dtype": out_dtype})
    x = torch.randn(3, 256).to(torch.bfloat16)
    w = (torch.randn(64, 256) / 16).to(torch.bfloat16)
    got = op.reference(x=x, w=w)["y"]
    assert got.dtype == getattr(torch, out_dtype)
    assert torch.equal(got, reference.linear(x, w, out_dtype=getattr(torch, out_dtype)))
    oracle = op.reference(x=x, w=w, compute_dtype=torch.float64)["y"]
    assert oracle.dtype == torch.float64
    assert torch.allclose(oracle, x.double() @ w.double().T)


def test_op_module_imports_without_the_dsl():
    """The GPU host has no nvidia-cutlass-dsl: specs, launch config and reference must still work."""
    code = (
        "import sys; sys.modules['cutlass'] = None; sys.modules['cutlass.cute'] = None\n"
        "from kernels.ops.gemv import GemvOp\n"
        "op = GemvOp({'batch': 2, 'n': 3584, 'k': 7168})\n"
        "print(op.launch_config().grid[0], op.tensor_specs()['w'].shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["224", "(3584,", "7168)"]


@pytest.mark.slow
def test_ptx_uses_tensor_cores_and_16_byte_loads(tmp_path):
    """Batch 3 (a partly filled batch tile), two row tiles, a k-step tail: the PTX must hold the
    bf16 m16n8k16 mma, 16-byte loads only, read-only (nc) loads for W and plain loads for x,
    and no local memory."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    op = G.GemvOp({"batch": 3, "n": 2112, "k": 1408}, warps_per_cta=2, row_tiles=2, k_unroll=4)
    assert (op.row_tiles, op.k_unroll, op.steps_per_warp) == (2, 4, 22)
    cute.compile(op, *op.fake_args(), options=f"--keep-ptx --gpu-arch sm_90a --dump-dir {tmp_path}")
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    loads = [l.split()[0] for l in ptx.splitlines() if l.strip().startswith("ld.global")]
    assert loads and all(l.endswith(".v4.b32") for l in loads), set(loads)
    # 5 groups of 4 steps + a 2-step tail per warp: the first group, one in the loop body, the tail
    w_loads = (2 * 4 + 2) * 2  # steps x 2 row tiles
    assert sum(l.startswith("ld.global.nc") for l in loads) == w_loads
    assert sum(not l.startswith("ld.global.nc") for l in loads) == w_loads // 2  # one x vector per step
    assert ".local" not in ptx


def test_pdl_is_recorded_in_the_launch_config():
    """pdl=1 asks the launcher for programmatic dependent launch in every design; pdl=0 (the
    default) launches plainly; the op's launch dict (meta.json "launch") says which."""
    for shape in ({"batch": 1, "n": 3584, "k": 7168}, {"batch": 16, "n": 3584, "k": 7168},
                  {"batch": 32, "n": 3584, "k": 7168}, {"batch": 64, "n": 7168, "k": 6144}):
        plain = G.GemvOp(shape).launch_config()
        assert plain.pdl is False and "pdl" not in plain.to_dict()
        lc = G.GemvOp(shape, pdl=1).launch_config()
        assert lc.pdl is True and lc.to_dict()["pdl"] is True and not lc.cooperative


@pytest.mark.slow
def test_pdl_sass_keeps_the_first_weight_group_ahead_of_the_wait(tmp_path):
    """Through the real build (batch 2, the warp-split design): with pdl the SASS issues the first group's 10 weight loads (5
    steps x 2 row tiles) before ACQBULK (griddepcontrol.wait) and every x load and store after
    it; launch_dependents (PREEXIT) comes once. ptxas would sink nc loads below the wait, so
    these are plain loads; every later weight load stays nc."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant

    art = build_variant("gemv", {"batch": 2, "n": 3584, "k": 7168, "out_dtype": "bfloat16"},
                        {"pdl": 1}, root=tmp_path)
    assert art.meta["launch"]["pdl"] is True
    sass = Path(art.paths["sass"]).read_text()
    ops = [l.split(";")[0].split("*/")[-1].split()[0:2] for l in sass.splitlines() if "/*" in l and "*/" in l]
    ops = [o for o in ops if o and o[0] and not o[0].startswith("@") or (o and len(o) > 1)]
    flat = [" ".join(o) for o in ops]
    wait = [i for i, o in enumerate(flat) if "ACQBULK" in o]
    assert len(wait) == 1 and sum("PREEXIT" in o for o in flat) == 1
    before, after = flat[:wait[0]], flat[wait[0]:]
    assert sum("LDG" in o for o in before) == 10 and not any("CONSTANT" in o for o in before)
    assert not any(o.split()[0] in ("STG", "STG.E", "ATOMG", "RED") or "STG" in o for o in before)
    assert any("LDG.E.128.CONSTANT" in o for o in after)


def _plan_cases(kernel):
    plan = REPO / "build" / "proof_plan.json"
    if not plan.exists():
        return []
    return [c for c in json.loads(plan.read_text())["cases"] if c["kernel"] == kernel and c["default_tunables"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", _plan_cases("gemv")[::5] or [None])
def test_numerics_on_gpu(case):
    """Prebuilt cubins (scripts/gpu_proof.py plan, carried in build/) against the float64 oracle."""
    if case is None:
        pytest.skip("no build/proof_plan.json: run `scripts/gpu_proof.py plan` and carry build/")
    from benchmarks.benchmark_gemv import GemvCase
    from benchmarks.common import check_numerics
    from kernels.launch import CubinKernel

    res = check_numerics(CubinKernel.from_dir(REPO / case["dir"]), GemvCase(case["shape"]))
    assert res["passed"], res


@pytest.mark.slow
def test_warpgroup_tma_sass(tmp_path):
    """The TMA path with 128-row CTAs (`wg_rows` 128; the default there is 64, no split),
    batch 64 on 3584 -> 7168: x and w are by-value tensor maps; the
    slots (128 k) are filled only by TMA (UTMALDG, 4 per stage: two 64-k boxes of W, two of x), nothing global is
    read into a register or by cp.async; every stage waits on its full mbarrier before its
    wgmmas and there is no CTA barrier in the loop; the copies carry the eviction policies
    (W evict-first, x evict-last); with pdl every prologue W tile precedes griddepcontrol.wait
    (ACQBULK) and every x tile follows it."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant

    shape = {"batch": 64, "n": 7168, "k": 3584, "out_dtype": "bfloat16"}
    for pdl in (0, 1):
        art = build_variant("gemv", shape, {"pdl": pdl, "wg_rows": 128}, root=tmp_path)
        assert [(p["name"], p["size"], p["align"]) for p in art.meta["params"][:2]] == [("x", 128, 64), ("w", 128, 64)]
        assert art.meta["params"][1]["spec"]["tma"] == {"box": [64, 128], "swizzle": 128, "l2_promotion": 0}
        assert art.meta["resources"]["spill_store_bytes"] == 0 and art.meta["resources"]["local_bytes"] == 0
        opc, w_copies, x_copies = _sass_copies(art)
        assert not w_copies and not x_copies  # no cp.async
        assert not any(o.startswith("LDG") for o in opc)
        tma = [i for i, o in enumerate(opc) if o.startswith("UTMALDG")]
        # 128 k per stage: two 64-k boxes each of W and x; 3 prologue stages + the loop's refill
        assert len(tma) == 4 * 3 + 4
        mmas = [i for i, o in enumerate(opc) if o.startswith("HGMMA")]
        assert len(mmas) == 8 and all(opc[i] == "HGMMA.64x64x16.F32.BF16" for i in mmas)
        # the loop: the full barrier's wait (SYNCS try-wait) before the wgmmas, no BAR.SYNC
        # between the first and the last wgmma's stage
        loop_waits = [i for i, o in enumerate(opc) if o.startswith("SYNCS.PHASECHK") and i < min(mmas)]
        assert loop_waits
        assert not any(o.startswith("BAR.SYNC") for o in opc[max(loop_waits):max(mmas)])
        if pdl:
            acq = [i for i, o in enumerate(opc) if o.startswith("ACQBULK")]
            assert len(acq) == 1
            assert sum(i < acq[0] for i in tma) == 6 and sum(i > acq[0] for i in tma) == 10  # W: 3 x 2 | x: 3 x 2 + refill
    ptx = Path(art.paths["ptx"]).read_text()
    assert ptx.count("cp.async.bulk.tensor.2d") == 16 and "cp.async.cg" not in ptx
    # each copy's policy operand: W's map (parameter 1) evict-first, x's (parameter 0) evict-last
    defs = dict(re.findall(r"(?:mov\.b64|cvta\.param\.u64)\s+(%rd\d+), ([^;]+);", ptx))
    policies = {}
    for m in re.finditer(r"cp\.async\.bulk\.tensor\.2d\S* \[[^\]]+\], \[(%rd\d+), \{[^}]+\}\], \[[^\]]+\], (%rd\d+);", ptx):
        param = defs[defs[m.group(1)]].rsplit("_param_", 1)[1]  # map register <- cvta.param <- mov
        policies.setdefault(param, set()).add(int(defs[m.group(2)]))
    assert policies == {"0": {G.TMA_EVICT_LAST}, "1": {G.TMA_EVICT_FIRST}}, policies
