"""The README's headline GPU figures are for the binaries HEAD builds.

Evidence is bound to cubin bytes (ARCHITECTURE decision 2): a figure measured on a cubin that
HEAD no longer builds says nothing about HEAD. These tests rebuild, on this CPU host, every
case of the two current proofs the README cites (the foundation kernels' `final/` run and the
LatentMoE block's) and compare the cubin sha256 with the one the proof recorded. A kernel edit
that changes any cubin fails here until the proof is re-run on a GPU and committed.
"""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROOFS = {
    "foundation": REPO / "evidence_reports" / "foundation" / "final" / "gpu_proof.json",
    "moe_block": REPO / "evidence_reports" / "moe_block" / "round3" / "final" / "block_plan.json",
}


def _cases(proof: str) -> list[dict]:
    doc = json.loads(PROOFS[proof].read_text())
    # the foundation proof also times variants from earlier plans: only HEAD's own cases bind
    return [c for c in doc["cases"] if not c.get("from_plan")]


@pytest.mark.slow
@pytest.mark.parametrize("proof", sorted(PROOFS))
def test_current_proof_binds_the_cubins_head_builds(proof):
    pytest.importorskip("cutlass")
    from kernels.build import build_kernel

    cases = _cases(proof)
    assert cases, f"{PROOFS[proof]} lists no case"
    groups: dict[str, list[dict]] = {}  # one parallel build per (kernel, tunables)
    for c in cases:
        groups.setdefault(json.dumps([c["kernel"], c["tunables"]], sort_keys=True), []).append(c)
    stale = []
    for group in groups.values():
        arts = build_kernel(group[0]["kernel"], shapes=[c["shape"] for c in group], tunables=group[0]["tunables"])
        stale += [f"{c['kernel']} {c['shape']} {c['tunables']}" for c, art in zip(group, arts)
                  if art.meta["hashes"]["cubin_sha256"] != c["cubin_sha256"]]
    assert not stale, (f"{len(stale)} of {len(cases)} cubins differ from {PROOFS[proof].relative_to(REPO)}: "
                       "re-run the proof on a GPU and commit it (first: " + stale[0] + ")")
