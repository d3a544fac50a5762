"""Launch chosen (moe_w13, moe_w2) pairs of a carried experts plan on the GPU host, under a tool
that attaches to the process (a profiler), on the k3 model and one routing.

    # after `python scripts/experts_batch_explore.py plan ...` on the CPU host, carrying
    # .devcarry/experts_bx; ids are the plan's (b<batch>_w13_<tag>, b<batch>_w2_<tag>)
    PYTHONPATH=. ncu --kernel-name regex:kernel_cutlass --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --csv --page details \\
        python scripts/experts_cases.py b64_w13_blk b64_w2_blk > ncu.csv

Each pair runs `--launches` times on the same "uniform" routing (moe_w13, then moe_w2 on its
output); each line printed says which pair ran and the routing's group count, so the tool's
output can be matched to it. Outputs are checked against the references once: exit 1 when a
pair is wrong.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ids", nargs="+", help="moe_w13 and moe_w2 ids, in pairs")
    ap.add_argument("--carry", type=Path, default=REPO / ".devcarry" / "experts_bx")
    ap.add_argument("--pattern", default="uniform", help="routing pattern (validation.numerics.routing_ids)")
    ap.add_argument("--launches", type=int, default=1)
    args = ap.parse_args(argv)
    if len(args.ids) % 2:
        ap.error("ids come in (moe_w13, moe_w2) pairs")

    import torch

    from explore_common import entries

    try:
        ents = entries(args.carry)
    except (OSError, ValueError, KeyError) as e:
        print(f"experts_cases: cannot read the carried plan in {args.carry}: {e} "
              "(run `experts_batch_explore.py plan` first)", file=sys.stderr)
        return 2
    missing = [i for i in args.ids if i not in ents]
    if missing:
        print(f"experts_cases: not in {args.carry}: {missing}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("experts_cases: no CUDA device: run this on the GPU host", file=sys.stderr)
        return 2

    from block_explore import _meta_of, _rel
    from explore_common import ExpertsPair, routing_inputs
    from kernels import reference as R
    from kernels.config import get_config
    cfg = get_config("k3")
    w = R.make_weights(cfg, "cuda", seed=0)
    ok = True
    for a_id, b_id in zip(args.ids[::2], args.ids[1::2]):
        x = ExpertsPair(args.carry, ents[a_id], ents[b_id])
        shape = ents[a_id]["shape"]
        g = torch.Generator(device="cpu").manual_seed(300 + shape["batch"])
        ids, z, wts = routing_inputs(shape, args.pattern, g)
        m = _meta_of(ids, cfg.n_experts, x.up.groups)
        act = torch.empty(x.up.slots, cfg.expert_inter, dtype=torch.bfloat16, device="cuda")
        c = torch.empty(shape["batch"], cfg.latent, dtype=torch.bfloat16, device="cuda")
        for _ in range(args.launches):
            x.w13(z, w.w13, m, act)
            x.w2(act, w.w2, wts, m, c)
        torch.cuda.synchronize()
        want = R.routed_experts(z, ids, wts, w.w13, w.w2, gate_limit=cfg.situ_gate_limit,
                                up_limit=cfg.situ_up_limit)
        err = _rel(c, want)
        good = bool(torch.isfinite(c.float()).all()) and err < 1e-2
        ok &= good
        print(f"pair {a_id} {b_id}: {args.pattern} routing, {int(m['n_groups'].item())} groups, "
              f"{args.launches} launch(es) each, c rel err {err:.2e} {'ok' if good else 'WRONG'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
