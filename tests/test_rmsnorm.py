"""The RMSNorm op (kernels/ops/rmsnorm.py): its contract with the manifest, the build and the
reference on CPU; its PTX; and, on a GPU host with a carried build, its numerics."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.manifest import load_manifest
from kernels.ops import rmsnorm as RN

REPO = Path(__file__).resolve().parent.parent
SPEC = load_manifest().kernel("rmsnorm")


def test_default_tunables_are_the_manifest_defaults():
    """The op knows the manifest's tunables by name and takes their defaults from it (declared once)."""
    assert set(RN.RMSNormOp.TUNABLES) == set(SPEC.tunable_defaults())
    assert RN.RMSNormOp(SPEC.shapes[0]).tunables == SPEC.tunable_defaults()
    assert not hasattr(RN, "DEFAULT_TUNABLES")


def test_every_manifest_variant_and_tunable_choice_is_valid():
    assert len(SPEC.shapes) == 14
    for shape in SPEC.shapes:
        for threads in SPEC.tunables[0].choices:
            op = RN.RMSNormOp(shape, threads=threads)
            lc = op.launch_config()
            assert lc.grid == (shape["batch"], 1, 1) and lc.block == (threads, 1, 1)
            assert op.vectors_per_thread * threads >= shape["width"] // 8


def test_tensor_specs_follow_the_manifest_parameters():
    specs = RN.RMSNormOp({"batch": 5, "width": 3584}).tensor_specs()
    assert list(specs) == [p.name for p in SPEC.params]
    assert specs["x"].shape == (5, 3584) and specs["gamma"].shape == (3584,) and specs["y"].shape == (5, 3584)
    assert {s.dtype for s in specs.values()} == {"bfloat16"}


@pytest.mark.parametrize("shape, tunables, fragment", [
    ({"batch": 1, "width": 3580}, {}, "multiple of 8"),
    ({"batch": 0, "width": 3584}, {}, "batch 0"),
    ({"batch": 1, "width": 3584}, {"threads": 100}, "multiple of 32"),
    ({"batch": 1, "width": 3584}, {"block": 128}, "unknown tunables"),
    ({"width": 3584}, {}, "missing"),
])
def test_rejects_what_it_cannot_compute(shape, tunables, fragment):
    with pytest.raises(ValueError, match=fragment):
        RN.RMSNormOp(shape, **tunables)


def test_reference_is_the_projects_rmsnorm_with_eps_1e_5():
    op = RN.RMSNormOp({"batch": 2, "width": 64})
    x = torch.randn(2, 64).to(torch.bfloat16)
    g = (1 + torch.rand(64)).to(torch.bfloat16)
    assert torch.equal(op.reference(x=x, gamma=g)["y"], reference.rmsnorm(x, g, 1e-5))
    oracle = op.reference(x=x, gamma=g, compute_dtype=torch.float64)["y"]
    xd = x.double()
    assert torch.allclose(oracle, xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * g.double())


def test_op_module_imports_without_the_dsl():
    code = (
        "import sys; sys.modules['cutlass'] = None; sys.modules['cutlass.cute'] = None\n"
        "from kernels.ops.rmsnorm import RMSNormOp\n"
        "print(RMSNormOp({'batch': 3, 'width': 7168}).launch_config().block[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(SPEC.tunable_defaults()["threads"])


@pytest.mark.slow
def test_ptx_loads_gamma_read_only_and_x_coherent(tmp_path):
    """width 1000 with 64 threads: 125 vectors, two per thread, the second predicated. gamma (a
    static weight) goes through ld.global.nc, x through plain loads, y through 16-byte stores."""
    pytest.importorskip("cutlass")
    import cutlass.cute as cute

    op = RN.RMSNormOp({"batch": 2, "width": 1000}, threads=64)
    cute.compile(op, *op.fake_args(), options=f"--keep-ptx --gpu-arch sm_90a --dump-dir {tmp_path}")
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    ops = [l.split()[0] for l in ptx.splitlines() if l.strip().startswith(("ld.global", "st.global"))]
    assert ops.count("ld.global.nc.v4.b32") == 2
    assert ops.count("ld.global.v4.b32") == 2
    assert ops.count("st.global.v4.b32") == 2
    assert "shfl.sync.bfly.b32" in ptx and "rsqrt" in ptx


def _plan_cases(kernel):
    plan = REPO / "build" / "proof_plan.json"
    if not plan.exists():
        return []
    return [c for c in json.loads(plan.read_text())["cases"] if c["kernel"] == kernel and c["default_tunables"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", _plan_cases("rmsnorm")[::3] or [None])
def test_numerics_on_gpu(case):
    if case is None:
        pytest.skip("no build/proof_plan.json: run `scripts/gpu_proof.py plan` and carry build/")
    from benchmarks.benchmark_rmsnorm import RMSNormCase
    from benchmarks.common import check_numerics
    from kernels.launch import CubinKernel

    res = check_numerics(CubinKernel.from_dir(REPO / case["dir"]), RMSNormCase(case["shape"]))
    assert res["passed"], res
