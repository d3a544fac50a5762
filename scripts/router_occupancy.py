"""CTAs per SM of carried router variants, as the driver computes them for each variant's
launch (registers, dynamic shared memory and, where the launch sets one, the preferred
shared-memory carveout): `PYTHONPATH=. python3 scripts/router_occupancy.py [SUBSTRING ...]`
on the GPU host, over the explorer's carry folder (scripts/router_explore.py plan). Round 10
(evidence_reports/moe_block/round10/, occ.txt) used it to check which variants hold four CTAs
per SM."""

from __future__ import annotations

import sys
from pathlib import Path

CARRY = Path(".devcarry/router_x")


def main(argv: list[str]) -> int:
    from cuda.bindings import driver

    from kernels.launch import CubinKernel

    if not CARRY.is_dir():
        print(f"router_occupancy: no {CARRY}; run scripts/router_explore.py plan and carry it", file=sys.stderr)
        return 2
    for d in sorted(p for p in CARRY.iterdir() if p.is_dir()):
        if argv and not any(s in d.name for s in argv):
            continue
        k = CubinKernel.from_dir(d)
        _, fn = k._function()  # loads the module and sets the launch's function attributes
        smem = int(k.launch.get("smem_bytes", 0))
        err, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, int(k.launch["block"][0]), smem)
        if err != driver.CUresult.CUDA_SUCCESS:
            print(f"router_occupancy: {d.name}: {err}", file=sys.stderr)
            return 1
        print(f"{d.name:40s} smem {smem:6d} carveout {k.launch.get('smem_carveout')} ctas/SM {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
