"""scripts/explore_common.py: the exploration scripts' shared CPU step (build, audit, carry)."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import explore_common  # noqa: E402


@pytest.mark.slow
def test_build_and_carry_writes_what_a_gpu_call_loads(tmp_path):
    """Two real variants: each carried as kernel.cubin + meta.json (enough for
    CubinKernel.from_dir) with its audit verdict, and a plan naming the commit and the command;
    a second run replaces the carry folder instead of mixing the two."""
    pytest.importorskip("cutlass")
    from kernels.launch import CubinKernel

    carry = tmp_path / "carry"
    variants = [("rms_a", "rmsnorm", {"batch": 1, "width": 3584}, {}),
                ("rms_b", "rmsnorm", {"batch": 2, "width": 3584}, {})]
    assert explore_common.build_and_carry(variants, build_root=tmp_path / "build", carry=carry,
                                          command="python x.py plan", extra={"batches": [1, 2]}) == 0
    plan = explore_common.read_plan(carry)
    assert plan["command"] == "python x.py plan" and plan["batches"] == [1, 2] and len(plan["commit"]) == 40
    ents = explore_common.entries(carry)
    assert set(ents) == {"rms_a", "rms_b"}
    for ident, e in ents.items():
        assert sorted(p.name for p in (carry / ident).iterdir()) == ["kernel.cubin", "meta.json"]
        assert e["static_audit"] == {"clean": True, "rules": []} and e["kernel"] == "rmsnorm"
        assert CubinKernel.from_dir(carry / ident).sha256 == e["cubin_sha256"]
        assert e["grid"] == e["launch"]["grid"]
    explore_common.build_and_carry(variants[:1], build_root=tmp_path / "build", carry=carry, command="again")
    assert set(explore_common.entries(carry)) == {"rms_a"}
    assert json.loads((carry / "plan.json").read_text())["command"] == "again"
