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
    assert LO.SHARED_GATE_UP_TUNABLES == load_manifest().kernel("shared_gate_up").tunable_defaults()
    assert LO.LATENT_OUT_TUNABLES == load_manifest().kernel("latent_out").tunable_defaults()


def test_rejects_what_it_cannot_compute():
    with pytest.raises(ValueError, match="even"):
        LO.SharedGateUpOp({"batch": 1, "hidden": 7168, "shared_inter": 6144}, row_tiles=1)
    with pytest.raises(ValueError, match="missing"):
        LO.LatentOutOp({"batch": 1, "hidden": 7168})


@pytest.mark.slow
@pytest.mark.parametrize("cls, shape", [
    (LO.SharedGateUpOp, {"batch": 1, "hidden": 7168, "shared_inter": 6144}),
    (LO.LatentOutOp, {"batch": 64, "hidden": 7168, "latent": 3584, "shared_inter": 6144}),
])
def test_k3_build_ptx(tmp_path, cls, shape):
    cute = pytest.importorskip("cutlass.cute")
    op = cls(shape)
    cute.compile(op, *op.fake_args(), options=f"--keep-ptx --gpu-arch sm_90a --dump-dir {tmp_path}")
    ptx = next(Path(tmp_path).glob("*.ptx")).read_text()
    assert "mma.sync.aligned.m16n8k16" in ptx and "ld.global.nc.v4" in ptx
