"""Output side (kernels/ops/latent_out.py): shared_gate_up and latent_out references compose with
the latent RMSNorm to the project's block on the mini preset (tiny's widths are not multiples of the
ops' 32-wide k step); manifest contract; k3 builds."""

from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.config import get_config
from kernels.manifest import load_manifest
from kernels.ops import latent_out as LO

CFG = get_config("mini")


@pytest.mark.parametrize("T", [1, 3])
def test_references_compose_to_the_block_output(T):
    w = reference.make_weights(CFG)
    x = reference.make_hidden(CFG, T)
    tr = reference.moe_block(x, w, CFG, trace=True)
    sgu = LO.SharedGateUpOp({"batch": T, "hidden": CFG.hidden, "shared_inter": CFG.shared_inter},
                           warps_per_cta=4, row_tiles=2)
    lo = LO.LatentOutOp({"batch": T, "hidden": CFG.hidden, "latent": CFG.latent, "shared_inter": CFG.shared_inter},
                        warps_per_cta=4, row_tiles=1)
    a = sgu.reference(h=tr.h, w_gate_up=w.w_shared_gate_up)["a"]
    n = reference.rmsnorm(tr.c, w.gamma_latent, CFG.eps)
    out = lo.reference(x=x, n=n, w_up=w.w_up, a=a, w_down=w.w_shared_down)["out"]
    torch.testing.assert_close(out.float(), tr.out.float(), rtol=0, atol=0)


def test_params_follow_the_manifest():
    for name, cls in (("shared_gate_up", LO.SharedGateUpOp), ("latent_out", LO.LatentOutOp)):
        spec = load_manifest().kernel(name)
        for shape in spec.shapes:
            assert list(cls(shape).tensor_specs()) == [p.name for p in spec.params]
        assert set(cls.TUNABLES) == set(spec.tunable_defaults())
        assert cls(spec.shapes[0]).tunables == spec.tunable_defaults()


K3_SGU = {"hidden": 7168, "shared_inter": 6144}
K3_LO = {"hidden": 7168, "latent": 3584, "shared_inter": 6144}


def test_rejects_what_it_cannot_compute():
    with pytest.raises(ValueError, match="even"):
        LO.SharedGateUpOp({"batch": 2, **K3_SGU}, row_tiles=1)
    with pytest.raises(ValueError, match="missing"):
        LO.LatentOutOp({"batch": 1, "hidden": 7168})
    with pytest.raises(ValueError, match="power of two"):
        LO.SharedGateUpOp({"batch": 1, **K3_SGU}, stream_rows=3)
    with pytest.raises(ValueError, match="multiple of 32"):
        LO.LatentOutOp({"batch": 1, **K3_LO}, stream_up_threads=48)
    with pytest.raises(ValueError, match="1024"):  # 4 rows x (64 + 256) threads
        LO.LatentOutOp({"batch": 1, **K3_LO}, stream_rows=4, stream_down_threads=256)
    with pytest.raises(ValueError, match="shared memory"):  # 2 x 4 rows + 16 tokens of 14 KB
        LO.SharedGateUpOp({"batch": 16, **K3_SGU}, stream_max_batch=16, stream_rows=4, stream_threads=64)
    with pytest.raises(ValueError, match="unknown tunables"):
        LO.LatentOutOp({"batch": 1, **K3_LO}, stream_threads=128)


def test_stream_plans_at_batch_1():
    """Batch 1 (stream_max_batch 1): shared_gate_up CTAs own one gate row and its up row (128
    threads each, 7 vectors per thread), latent_out CTAs one output row (64 threads on its 7 KB
    of W_up, 128 on its 12 KB of W_sd); both hold their rows and activations in shared memory."""
    sgu = LO.SharedGateUpOp({"batch": 1, **K3_SGU})
    assert sgu.stream and (sgu.sp.rows, sgu.sp.row_threads, sgu.sp.vectors) == (1, 128, 7)
    lc = sgu.launch_config()
    assert lc.grid == (6144, 1, 1) and lc.block == (256, 1, 1)
    assert lc.smem_bytes >= (2 + 1) * 7168 * 2 + 2 * 4 * 4
    lo = LO.LatentOutOp({"batch": 1, **K3_LO})
    assert lo.stream and (lo.sp_up.row_threads, lo.sp_up.vectors, lo.sp_down.row_threads, lo.sp_down.vectors) == (64, 7, 128, 6)
    lc = lo.launch_config()
    assert lc.grid == (7168, 1, 1) and lc.block == (192, 1, 1)
    assert lc.smem_bytes >= 2 * (3584 + 6144) * 2
    two = LO.LatentOutOp({"batch": 1, **K3_LO}, stream_rows=2, stream_down_threads=96)
    assert two.launch_config().grid == (3584, 1, 1) and two.launch_config().block == (2 * (64 + 96), 1, 1)
    assert two.sp_down.vectors == 8
    assert LO.SharedGateUpOp({"batch": 1, **K3_SGU}, stream_rows=2).launch_config().grid == (3072, 1, 1)


def test_other_batches_keep_the_mma_design():
    """Past stream_max_batch nothing changes: the mma plans and grids of round 2."""
    for T in (2, 8, 64):
        sgu = LO.SharedGateUpOp({"batch": T, **K3_SGU})
        lo = LO.LatentOutOp({"batch": T, **K3_LO})
        assert not sgu.stream and not lo.stream
        assert sgu.launch_config().grid == (6144 // 8, 1, 1) and sgu.launch_config().block == (256, 1, 1)
        assert lo.launch_config().grid == (7168 // 16, 1, 1) and lo.launch_config().block == (256, 1, 1)
    assert not LO.LatentOutOp({"batch": 1, **K3_LO}, stream_max_batch=0).stream
    assert LO.SharedGateUpOp({"batch": 2, **K3_SGU}, stream_max_batch=2).stream


def _sass_ops(path) -> list[str]:
    return [l.split("*/", 1)[1].split(";")[0].strip() for l in Path(path).read_text().splitlines()
            if l.strip().startswith("/*") and "*/" in l and ";" in l]


@pytest.mark.slow
@pytest.mark.parametrize("kernel, shape, w_copies, x_copies", [
    ("shared_gate_up", {"batch": 1, **K3_SGU}, 7 + 7, 7),  # gate and up row; h by the gate section
    ("latent_out", {"batch": 1, **K3_LO}, 7 + 6, 7 + 6),  # W_up and W_sd row; n and a_s
])
def test_stream_sass_issues_every_copy_before_the_first_use(tmp_path, kernel, shape, w_copies, x_copies):
    """Through the real build, batch 1: the SASS issues every weight copy (LDGSTS, 16 bytes, L2
    only) and every activation copy of both sections before the one wait (DEPBAR) and the first
    shared load or FMA; no register load comes before the wait (latent_out reads its residual
    element afterwards)."""
    pytest.importorskip("cutlass")
    from kernels.build import build_variant

    flat = _sass_ops(build_variant(kernel, shape, {}, root=tmp_path).paths["sass"])
    copies = [i for i, o in enumerate(flat) if "LDGSTS" in o]
    bypass = [i for i in copies if "BYPASS" in flat[i]]
    waits = [i for i, o in enumerate(flat) if o.startswith("DEPBAR")]
    first_use = min(i for i, o in enumerate(flat) if o.split()[0].startswith(("LDS", "FFMA")))
    assert (len(bypass), len(copies) - len(bypass)) == (w_copies, x_copies), [flat[i] for i in copies]
    assert len(waits) == 1 and max(copies) < waits[0] < first_use
    assert not any(o.split()[0].startswith("LDG.") for o in flat[: waits[0]])


@pytest.mark.slow
@pytest.mark.parametrize("cls, shape", [
    (LO.SharedGateUpOp, {"batch": 2, "hidden": 7168, "shared_inter": 6144}),
    (LO.LatentOutOp, {"batch": 64, "hidden": 7168, "latent": 3584, "shared_inter": 6144}),
])
def test_k3_build_ptx(tmp_path, cls, shape):
    cute = pytest.importorskip("cutlass.cute")
    op = cls(shape)
    cute.compile(op, *op.fake_args(), options=f"--keep-ptx --gpu-arch sm_90a --dump-dir {tmp_path}")
    ptx = next(Path(tmp_path).glob("*.ptx")).read_text()
    assert "mma.sync.aligned.m16n8k16" in ptx and "ld.global.nc.v4" in ptx
