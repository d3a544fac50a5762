"""The block's elementwise epilogues (kernels/ops/epilogue.py) on CPU: with the foundation GEMM's
outputs they give the block's output exactly as the fused kernels' references do (mini preset);
manifest contract; what they refuse; k3 builds load activations through plain coherent loads
only, and the static race audit passes them."""

from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.config import get_config
from kernels.manifest import load_manifest
from kernels.ops import epilogue as EP
from kernels.ops import latent_out as LO

CFG = get_config("mini")


@pytest.mark.parametrize("T", [1, 5])
def test_gemv_chain_references_equal_the_fused_ones_bitwise(T):
    """gemv (fp32 out) + gated_situ is shared_gate_up; gemv + gemv + residual is latent_out."""
    w = reference.make_weights(CFG)
    x = reference.make_hidden(CFG, T)
    tr = reference.moe_block(x, w, CFG, trace=True)
    S, H = CFG.shared_inter, CFG.hidden
    sgu = LO.SharedGateUpOp({"batch": T, "hidden": H, "shared_inter": S}, warps_per_cta=4, row_tiles=2)
    a_fused = sgu.reference(h=tr.h, w_gate_up=w.w_shared_gate_up)["a"]
    gu = reference.linear(tr.h, w.w_shared_gate_up, out_dtype=torch.float32)
    a = EP.SituOp({"batch": T, "width": S}).reference(gu=gu)["a"]
    assert a.dtype == torch.bfloat16 and torch.equal(a, a_fused)
    n = reference.rmsnorm(tr.c, w.gamma_latent, CFG.eps)
    r, s = reference.linear(n, w.w_up), reference.linear(a, w.w_shared_down)
    out = EP.ResidualOp({"batch": T, "width": H}).reference(x=x, r=r, shared=s)["out"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, tr.out)
    # the oracle stays float64
    assert EP.SituOp({"batch": T, "width": S}).reference(gu=gu, compute_dtype=torch.float64)["a"].dtype == torch.float64


def test_gated_situ_reference_is_situ_of_the_halves():
    gu = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) * 4
    a = reference.gated_situ(gu, compute_dtype=torch.float64)
    want = reference.situ(gu[:, :8].double(), gu[:, 8:].double())
    # (torch's vectorised and scalar tanh may differ in the last bit between a strided and a
    # contiguous operand)
    assert a.dtype == torch.float64
    torch.testing.assert_close(a, want, rtol=1e-14, atol=1e-14)
    b = reference.gated_situ(gu)
    assert b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), reference.situ(gu[:, :8], gu[:, 8:]).to(torch.bfloat16).float(),
                               rtol=2 ** -8, atol=0)
    # the halves are not interchangeable: g is the first
    assert not torch.equal(b, reference.gated_situ(torch.cat([gu[:, 8:], gu[:, :8]], 1)))


def test_params_and_tunables_follow_the_manifest():
    man = load_manifest()
    for name, cls in (("gated_situ", EP.SituOp), ("residual", EP.ResidualOp)):
        spec = man.kernel(name)
        assert cls.kernel_name == name
        for shape in spec.shapes:
            op = cls(dict(shape))
            assert list(op.tensor_specs()) == [p.name for p in spec.params]
            lc = op.launch_config()
            # a thread per 8 outputs, every output covered once
            assert lc.grid[1] == shape["batch"] and lc.grid[0] * lc.block[0] * 8 >= shape["width"] > (lc.grid[0] - 1) * lc.block[0] * 8
        assert set(cls.TUNABLES) == set(spec.tunable_defaults())
        assert cls(dict(spec.shapes[0])).tunables == spec.tunable_defaults()


def test_rejects_what_it_cannot_compute():
    with pytest.raises(ValueError, match="multiple of 8"):
        EP.SituOp({"batch": 1, "width": 12})
    with pytest.raises(ValueError, match="outside 1..64"):
        EP.ResidualOp({"batch": 65, "width": 64})
    with pytest.raises(ValueError, match="multiple of 32"):
        EP.ResidualOp({"batch": 1, "width": 64}, threads=48)
    with pytest.raises(ValueError, match="unknown tunables"):
        EP.SituOp({"batch": 1, "width": 64}, warps=4)
    with pytest.raises(ValueError, match="missing"):
        EP.SituOp({"batch": 1})


@pytest.mark.parametrize("kernel, shape", [("gated_situ", {"batch": 64, "width": 6144}),
                                           ("residual", {"batch": 64, "width": 7168})])
def test_k3_builds_use_coherent_loads_and_audit_clean(tmp_path, kernel, shape):
    pytest.importorskip("cutlass.cute")
    from validation.race.artifacts import audit_kernel

    rep = audit_kernel(kernel, shape=shape, root=tmp_path)
    assert rep.clean, [str(f) for f in rep.findings]
    ptx = next(Path(tmp_path).rglob("kernel.ptx")).read_text()
    loads = [ln for ln in ptx.splitlines() if "ld.global" in ln]
    # every operand is an activation: 16-byte plain loads, never the read-only path
    assert loads and all("ld.global.v4" in ln and ".nc" not in ln for ln in loads), loads
    assert len(loads) == (4 if kernel == "gated_situ" else 3)
