"""The GPU stages of `fasttrack validate`, over prebuilt cubins: numerics (+ defences, stress) and
benchmarks. Each runs in a child process (`validation.isolate`), started as

    python -m validation.gpu_stages numerics --kernel K --build-dir D [--build-dir D ...] --out R.json
    python -m validation.gpu_stages bench    --kernel K --build-dir D ... [--base torch] --out R.json
    python -m validation.gpu_stages bench    --build-dir D ... --base revision --base-build-dir B ... --out R.json

Runs on the GPU host, which has torch, cuda-bindings and triton but no nvidia-cutlass-dsl,
gitpython or cryptography: nothing here imports those. A cubin is judged through a
`DestinationSubject` whose launch maps the reference op's tensors to the kernel's parameters by
name (the manifest's params are named like the reference function's arguments), so it meets
exactly the defences a Python callable meets in `fasttrack check`. Parameters the reference lacks
are allocated by their manifest role: `scratch` once per variant, NaN-poisoned before every judged
launch (a kernel that reads scratch it did not write shows it); `sync` counters zeroed once, as
the kernels' contract says (the last CTA resets its counter), and checked back at zero after
every launch: a counter left set is a failed case with that reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kernels.config import get_config
from kernels.manifest import load_manifest

from . import defences as D
from .check import judge
from .kernel_checks import OP_CLASS_KERNELS, MultiKernel, is_multi_output, judge_variant
from .numerics import DEFAULT_SEEDS, DISTRIBUTIONS, Case, case_matrix, gpu_configuration, load_policy
from .opinputs import OP_DEFS, OpDef, build_inputs, map_tensors, op_def

BASE_CONFIG = "k3"  # eps and widths of the model the kernels serve
STRESS_RUNS = 32
KERNEL_OWNED_ROLES = ("scratch", "sync")


class StageError(RuntimeError):
    """A build folder or kernel that this stage cannot judge (bad metadata, unknown reference)."""


def read_meta(build_dir) -> dict:
    try:
        return json.loads((Path(build_dir) / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise StageError(f"{build_dir}: cannot read meta.json ({e})") from None


class KernelAdapter:
    """One prebuilt kernel variant, seen as an implementation of its manifest reference op."""

    def __init__(self, build_dir, device="cuda"):
        from kernels.launch import CubinKernel

        self.dir = Path(build_dir)
        self.meta = read_meta(build_dir)
        self.kernel = CubinKernel.from_dir(build_dir)
        spec = load_manifest().kernel(self.meta["kernel"])
        ref_name = spec.reference.partition(":")[2]
        try:
            self.op: OpDef = op_def(ref_name)
        except KeyError as e:
            raise StageError(f"kernel {spec.name}: reference {spec.reference} has no input builder ({e})") from None
        self.variant = dict(self.meta["variant"])
        self.batch = int(self.variant["batch"])
        self.problem = {k: v for k, v in self.variant.items() if k != "batch"}
        self.params = self.meta["params"]
        self.owned_params = [p for p in self.params
                             if p.get("role") in KERNEL_OWNED_ROLES and p["spec"]["kind"] == "tensor"]
        outs = [p for p in self.params if p.get("direction") in ("out", "inout")
                and not any(p is q for q in self.owned_params)]
        if len(outs) != 1 or outs[0]["direction"] != "out":
            raise StageError(f"kernel {spec.name}: exactly one 'out' parameter is supported, found "
                             f"{[p['name'] for p in outs]}")
        self.out_param = outs[0]
        self.device = torch.device(device)
        self.owned = self._allocate_owned()
        self.subject = D.DestinationSubject(self.launch, self.output_specs,
                                            f"{spec.name} {self.dir.name}", self.device)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.variant.items())

    def output_specs(self, inputs: dict) -> dict:
        s = self.out_param["spec"]
        return {"out": (tuple(s["shape"]), getattr(torch, s["dtype"]))}

    def _allocate_owned(self) -> dict[str, torch.Tensor]:
        """This variant's scratch (poisoned) and sync (zeroed) buffers, shaped as meta.json says."""
        owned = {}
        for p in self.owned_params:
            spec = p["spec"]
            try:
                shape, dtype = tuple(int(n) for n in spec["shape"]), getattr(torch, spec["dtype"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise StageError(f"{self.dir}: parameter {p['name']!r} ({p['role']}) has no usable tensor spec "
                                 f"in meta.json ({e!r})") from None
            t = torch.empty(shape, dtype=dtype, device=self.device)
            owned[p["name"]] = t.zero_() if p["role"] == "sync" else D._poison_fill(t, D.NAN_POISON)
        return owned

    def poison_scratch(self) -> None:
        """Refill every scratch buffer with the poison (before a judged launch)."""
        for p in self.owned_params:
            if p["role"] == "scratch":
                D._poison_fill(self.owned[p["name"]], D.NAN_POISON)

    def check_sync(self) -> None:
        """Raise StageError when a sync counter is not back at zero after the launches so far.

        The kernels' contract is that counters start at zero and the last CTA resets its own, so
        the next launch (a graph replay, the next decode step) starts clean. A counter left set
        is the kernel's failure; the counters are re-zeroed so later cases are judged on their own.
        """
        syncs = [(p["name"], self.owned[p["name"]]) for p in self.owned_params if p["role"] == "sync"]
        if not syncs:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the launch's stream only
        left = [(n, int(torch.count_nonzero(t)), t.numel()) for n, t in syncs]
        left = [x for x in left if x[1]]
        if left:
            for _, t in syncs:
                t.zero_()
            raise StageError("sync " + "; ".join(f"buffer {n!r}: {k} of {total} counter(s) left non-zero"
                                                 for n, k, total in left)
                             + " after the launch (the contract: counters start at zero and the last CTA "
                               "resets its own)")

    def args(self, inputs: dict, out: torch.Tensor) -> list:
        """Launch arguments in parameter order: inputs by name, the output, the kernel's own
        scratch and sync buffers, scalars from the spec."""
        args = []
        for p in self.params:
            if p is self.out_param:
                args.append(out)
            elif p["name"] in self.owned and any(p is q for q in self.owned_params):
                args.append(self.owned[p["name"]])
            elif p["spec"]["kind"] == "scalar":
                args.append(p["spec"]["value"])
            elif p["name"] in inputs:
                args.append(inputs[p["name"]])
            else:
                raise StageError(f"kernel parameter {p['name']!r} has no input of that name in "
                                 f"reference op {self.op.name} (inputs: {', '.join(inputs)})")
        return args

    def launch(self, inputs: dict, outs: dict) -> None:
        """One judged launch: scratch poisoned first, sync counters checked back at zero after."""
        self.poison_scratch()
        self.kernel(*self.args(inputs, outs["out"]))
        self.check_sync()

    def cases(self, seeds=DEFAULT_SEEDS, distributions=DISTRIBUTIONS) -> list[Case]:
        gpu = gpu_configuration(self.device)
        return [Case(c.op, c.problem, c.batch, c.seed, c.distribution, c.routing, c.gpu, c.tags)
                for c in case_matrix(self.op.name, [{**self.problem, "batch": self.batch}],
                                     moe=self.op.moe, gpu=gpu, seeds=seeds, distributions=distributions)]

    def binary(self, side: str = "head") -> dict:
        return {"kernel": self.meta["kernel"], "side": side, "variant": self.variant,
                "tunables": self.meta.get("tunables", {}), "build_key": self.meta.get("key"),
                "cubin_sha256": self.kernel.sha256}


def judged_by_op_class(meta: dict) -> bool:
    """Whether a build is judged by validation.kernel_checks (on its op class's own reference):
    several outputs, a kernel of kernel_checks.OP_CLASS_KERNELS (the routed experts among them:
    the generic path would clone their weights), or a reference op without an input builder here
    (prodcons, splitk_gemv)."""
    if is_multi_output(meta) or meta.get("kernel") in OP_CLASS_KERNELS:
        return True
    try:
        ref = load_manifest().kernel(meta["kernel"]).reference
    except Exception:  # noqa: BLE001 - an unknown kernel fails later with its own message
        return False
    return ref.partition(":")[2] not in OP_DEFS or not ref.startswith("kernels.reference:")


def stress(adapter: KernelAdapter, case: Case, runs: int = STRESS_RUNS) -> dict:
    """`runs` back-to-back launches on identical inputs: every output bitwise equal to the first."""
    cfg = get_config(BASE_CONFIG)
    inputs = build_inputs(adapter.op, case, cfg, adapter.device)
    outs = []
    for _ in range(runs):
        outs.append(adapter.subject.run(inputs, D.NAN_POISON))
    D._sync(adapter.device)
    first = outs[0]["out"]
    differ = sum(1 for o in outs[1:] if not D.same_bits(o["out"], first))
    return {"runs": runs, "differing": differ, "passed": differ == 0}


def _failed_variant(build_dir, err: BaseException) -> dict:
    """A variant whose judging raised: a failed entry with the error, so the others still count."""
    import traceback

    meta = {}
    try:
        meta = read_meta(build_dir)
    except StageError:
        pass
    label = " ".join(f"{k}={v}" for k, v in (meta.get("variant") or {}).items()) or str(build_dir)
    msg = f"{type(err).__name__}: {err}"
    print(f"numerics {label}: ERROR {msg}\n{traceback.format_exc()}", flush=True)
    check = {"name": "poisoned_outputs", "passed": False, "applicable": True, "detail": f"not judged: {msg}",
             "cases": []}
    return {"binary": None, "label": label, "passed": False, "error": msg,
            "cases": [{"case_id": f"{meta.get('kernel', '?')}/{label}", "passed": False, "reasons": [msg],
                       "outputs": [], "kernel": meta.get("kernel"), "variant": meta.get("variant")}],
            "checks": [check], "stress": {"runs": 0, "differing": 0, "passed": False}, "seconds": 0}


def numerics_stage(build_dirs: list[str], *, quick: bool = False, device: str = "cuda",
                   seeds=DEFAULT_SEEDS) -> dict:
    """Correctness matrix, every defence and the stress test, per prebuilt variant. A variant
    that raises is recorded as failed with its error; the others are still judged."""
    policy = load_policy()
    cfg = get_config(BASE_CONFIG)
    variants = []
    for d in build_dirs:
        t0 = time.time()
        try:
            if judged_by_op_class(read_meta(d)):  # several outputs: judged on the op class's reference
                v = judge_variant(MultiKernel(d, device=device), seeds=seeds[:1] if quick else seeds, policy=policy)
                variants.append(v)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # the next variant draws its own weights
                print(f"numerics {v['label']}: {'pass' if v['passed'] else 'FAIL'} ({len(v['cases'])} cases, "
                      f"{v['seconds']} s)", flush=True)
                continue
            a = KernelAdapter(d, device)
            cases = a.cases(seeds=seeds[:1] if quick else seeds)
            rep = judge(a.subject, a.op, cfg, cases, policy=policy,
                        unseen_reason="a cubin is built for one declared shape (static layouts); the "
                                      "gate binds evidence to each variant's cubin hash instead")
            st = stress(a, cases[0])
        except Exception as e:  # noqa: BLE001 - recorded as this variant's failure
            variants.append(_failed_variant(d, e))
            continue
        variants.append({
            "binary": a.binary(), "label": a.label, "passed": rep.passed and st["passed"],
            "cases": [{**c.to_dict(), "kernel": a.meta["kernel"], "variant": a.variant} for c in rep.cases],
            "checks": [d_.to_dict() for d_ in rep.checks], "stress": st,
            "seconds": round(time.time() - t0, 2),
        })
        print(f"numerics {a.label}: {'pass' if variants[-1]['passed'] else 'FAIL'} "
              f"({len(rep.cases)} cases, {variants[-1]['seconds']} s)", flush=True)
    return {"stage": "numerics", "policy": policy.to_dict(), "variants": variants,
            "gpu": gpu_configuration(device)}


def torch_baseline(op: OpDef):
    """The path an H200 user gets today for the op (cuBLAS / torch), as `fn(inputs)`, and its name."""
    import torch.nn.functional as F

    from kernels import reference as R

    if op.name in ("linear", "latent_down"):
        return (lambda i: F.linear(i["x"], i["w"]).to(i["out_dtype"])), "torch F.linear (cuBLAS)"
    if op.name == "rmsnorm":
        return (lambda i: R.rmsnorm(i["x"], i["gamma"], i["eps"])), "torch reference rmsnorm (fp32 stats)"
    return (lambda i: op.reference(**i)), f"torch reference {op.name}"


def _noise(summary: dict) -> float:
    return (summary["p90_us"] - summary["p10_us"]) / (2 * summary["median_us"]) if summary["median_us"] else 0.0


def bench_stage(build_dirs: list[str], *, base: str | None, base_dirs: list[str] | None = None) -> dict:
    """Ceilings, then per variant head (and base) interleaved, verdicts and bandwidth fractions.

    `base`: None, "torch" (the torch path) or "revision": then `base_dirs[i]` is the base
    revision's build of the same variant as `build_dirs[i]`, timed interleaved with it."""
    if base == "revision" and len(base_dirs or []) != len(build_dirs):
        raise StageError(f"--base revision needs one --base-build-dir per --build-dir "
                         f"({len(base_dirs or [])} for {len(build_dirs)})")
    from benchmarks.common import copy_bandwidth, gpu_environment, read_bandwidth

    env = gpu_environment()
    read = read_bandwidth()
    copy = copy_bandwidth()
    best = read["readers"][read["kernel"]]
    ceilings = {"read_tbps": read["tbps"], "read_noise": _noise(best), "read_kernel": read["kernel"],
                "read_readers": read["readers"], "copy_tbps": copy["tbps"], "copy_noise": _noise(copy),
                "copy_kernel": copy["kernel"]}
    print(f"ceilings: read {read['tbps']:.2f} TB/s ({read['kernel']}), copy {copy['tbps']:.2f} TB/s", flush=True)
    cfg = get_config(BASE_CONFIG)
    cases = []
    base_name = None
    for i, d in enumerate(build_dirs):
        try:
            bench_one = _bench_multi if judged_by_op_class(read_meta(d)) else _bench_variant
            cases.append(bench_one(d, cfg, ceilings, base, base_dirs[i] if base == "revision" else None))
            base_name = cases[-1].pop("base_name", None) or base_name
        except Exception as e:  # noqa: BLE001 - a failed variant is recorded, the rest still run
            import traceback

            meta = read_meta(d)
            label = " ".join(f"{k}={v}" for k, v in meta.get("variant", {}).items())
            print(f"bench {label}: ERROR {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
            cases.append({"case_id": f"{meta.get('kernel')}/{label}", "name": f"{meta.get('kernel')} {label}",
                          "kernel": meta.get("kernel"), "variant": meta.get("variant"),
                          "batch": (meta.get("variant") or {}).get("batch"), "bytes": 0, "base": None,
                          "head": None, "verdict": "AMBIGUOUS", "error": f"{type(e).__name__}: {e}",
                          "reason": f"not measured: {type(e).__name__}: {e}", "graph": False, "l2_rotated": False,
                          "copies": 0, "head_bandwidth": {}, "base_bandwidth": None})
        torch.cuda.empty_cache()
    return {"stage": "bench", "environment": env, "ceilings": ceilings, "cases": cases,
            "base_name": base_name}


def _same_signature(a: KernelAdapter, b: KernelAdapter) -> str | None:
    """Why base `b` cannot be launched on head `a`'s inputs, or None when it can."""
    # Each side brings its own scratch and sync buffers (their sizes may follow the tunables).
    sig = lambda k: [(p["name"], p["direction"], p["spec"]) for p in k.params  # noqa: E731
                     if not any(p is q for q in k.owned_params)]
    if a.meta["kernel"] != b.meta["kernel"] or a.variant != b.variant:
        return f"base is {b.meta['kernel']} {b.variant}, head {a.meta['kernel']} {a.variant}"
    if sig(a) != sig(b):
        return "base and head take different parameters (names, directions or tensor specs)"
    return None


def _bench_variant(d, cfg, ceilings: dict, base: str | None, base_dir: str | None = None) -> dict:
    """One variant: head (and base) interleaved, the verdict and both bandwidth fractions."""
    from .bench import rotation_copies

    base_name = None
    a = KernelAdapter(d)
    case = a.cases(seeds=(0,), distributions=("normal",))[0]
    inputs = build_inputs(a.op, case, cfg, a.device)
    nbytes = sum(t.nbytes for t in (inputs[p["name"]] for p in a.params  # the op's bytes, not scratch
                                     if p["spec"]["kind"] == "tensor" and p is not a.out_param
                                     and not any(p is q for q in a.owned_params)))
    shape, dtype = a.output_specs(inputs)["out"]
    nbytes += torch.empty(shape, dtype=dtype, device="meta").nbytes
    copies, past_l2 = rotation_copies(nbytes)
    sets = [inputs] + [map_tensors(inputs, lambda t: t.clone()) for _ in range(copies - 1)]
    outs = [torch.empty(shape, dtype=dtype, device=a.device) for _ in range(copies)]
    argsets = [a.args(s, o) for s, o in zip(sets, outs)]

    def head(i, argsets=argsets, k=a.kernel):
        k(*argsets[i % len(argsets)])

    base_fn = None
    base_binary = None
    if base == "revision":
        b = KernelAdapter(base_dir)
        why = _same_signature(a, b)
        if why:
            raise StageError(why)
        # the same input and output buffers as head: an A/B of identical code must read SAME,
        # and separate buffers at other addresses measured a 4% difference on a 2 us kernel
        base_argsets = [b.args(s, o) for s, o in zip(sets, outs)]
        base_name = "the kernel at the base revision"
        base_binary = b.binary("base")

        def base_fn(i, argsets=base_argsets, k=b.kernel):
            k(*argsets[i % len(argsets)])
    elif base == "torch":
        fn, base_name = torch_baseline(a.op)

        def base_fn(i, sets=sets, fn=fn):
            fn(sets[i % len(sets)])

    def check_sync():  # every timed launch must have left the counters as it found them
        a.check_sync()
        if base == "revision":
            b.check_sync()

    return _ab_row(a.meta["kernel"], a.variant, a.label, base_fn, head, check_sync, nbytes, ceilings,
                   past_l2=past_l2, copies=copies, binary=a.binary(), base_binary=base_binary, base_name=base_name)


def _bench_multi(d, cfg, ceilings: dict, base: str | None, base_dir: str | None = None) -> dict:
    """A multi-output kernel: head (and the base revision's build) interleaved on rotated inputs.
    Routed experts rotate routings (their weights are shared: tens of GB), the others rotate
    copies of every input past the L2 (at most MAX_ROTATION)."""
    from .bench import rotation_copies
    from .kernel_checks import EXPERT_KERNELS, KCase, bytes_moved, mean_bytes_moved

    a = MultiKernel(d)
    b = MultiKernel(base_dir, cache=a.cache) if base == "revision" else None
    if b is not None and (b.name != a.name or b.variant != a.variant or b.ins != a.ins or b.outs != a.outs):
        raise StageError(f"base is {b.name} {b.variant} with other parameters than head {a.name} {a.variant}")
    case0 = KCase(a.name, a.variant, 0, "uniform" if a.name in EXPERT_KERNELS else "normal")
    ins, extra = a.inputs(case0)
    nbytes = bytes_moved(a, ins, extra)
    copies, past_l2 = rotation_copies(nbytes)
    if a.name in EXPERT_KERNELS:
        pairs = [a.inputs(KCase(a.name, a.variant, s, "uniform")) for s in range(min(copies, 8))]
        sets = [p[0] for p in pairs]
        # the timed launches cycle through these routings, which select different numbers of
        # experts: the bytes are their mean, not case 0's (at batch 32 case 0 selects 397 experts,
        # case 1 379, and case 0's count alone put the kernel 2.3% above what it read)
        nbytes = mean_bytes_moved(a, pairs)
        past_l2 = True  # each launch reads other experts' weights (uniform routings)
    else:
        sets = [ins] + [{n: t.clone() for n, t in ins.items()} for _ in range(copies - 1)]
    out_sets = [a.new_outputs() for _ in sets]  # shared with the base: same buffers, same addresses
    h_args = [a.args(s, o) for s, o in zip(sets, out_sets)]

    def head(i, k=a.launcher):
        k(h_args[i % len(h_args)])

    base_fn, base_binary = None, None
    if b is not None:
        b_args = [b.args(s, o) for s, o in zip(sets, out_sets)]
        base_binary = {"kernel": b.name, "side": "base", "variant": b.variant,
                       "tunables": b.meta.get("tunables", {}), "build_key": b.meta.get("key"),
                       "cubin_sha256": b.sha256}

        def base_fn(i, k=b.launcher):
            k(b_args[i % len(b_args)])

    def check_sync():
        left = a.sync_left() + (b.sync_left() if b is not None else [])
        if left:
            raise StageError("after the timed launches: " + "; ".join(left))

    binary = {"kernel": a.name, "side": "head", "variant": a.variant, "tunables": a.meta.get("tunables", {}),
              "build_key": a.meta.get("key"), "cubin_sha256": a.sha256}
    try:
        return _ab_row(a.name, a.variant, a.label, base_fn, head, check_sync, nbytes, ceilings,
                       past_l2=past_l2, copies=len(sets), binary=binary, base_binary=base_binary,
                       base_name="the kernel at the base revision" if b is not None else None)
    finally:
        a.cache.clear()


def _ab_row(kernel: str, variant: dict, label: str, base_fn, head, check_sync, nbytes: int, ceilings: dict, *,
            past_l2: bool, copies: int, binary: dict, base_binary: dict | None, base_name: str | None) -> dict:
    """Time `head` (and `base_fn`, interleaved), check the sync words with `check_sync()` (it raises
    StageError), and return the case row: both summaries, the A/B comparison, both bandwidth
    fractions of the read ceiling and the verdict."""
    from .bench import bandwidth_check, case_verdict, compare_samples, measure_interleaved, summarize

    m = measure_interleaved(base_fn, head)
    check_sync()
    comp = compare_samples(m["base"], m["head"]) if m["base"] else None
    hs = summarize(m["head"])
    head_bw = bandwidth_check(nbytes, hs["median"], hs["rel_iqr"], ceilings["read_tbps"], ceilings["read_noise"])
    bs = base_bw = None
    if m["base"]:
        bs = summarize(m["base"])
        base_bw = bandwidth_check(nbytes, bs["median"], bs["rel_iqr"], ceilings["read_tbps"], ceilings["read_noise"])
    verdict, reason = case_verdict(comp, head_bw)
    print(f"bench {label}: head {hs['median']:.2f} us" + (f", base {bs['median']:.2f} us" if bs else "")
          + f", {head_bw['fraction_of_read']:.1%} of read, {verdict}", flush=True)
    return {"case_id": f"{kernel}/{label}", "name": f"{kernel} {label}", "kernel": kernel, "variant": variant,
            "batch": variant.get("batch"), "bytes": nbytes, "base": bs, "head": hs,
            "change": comp.change if comp else None, "speedup": comp.speedup if comp else None,
            "p_value": comp.p_value if comp else None, "noise": comp.noise if comp else hs["rel_iqr"],
            "head_bandwidth": head_bw, "base_bandwidth": base_bw, "graph": m["graph"], "l2_rotated": past_l2,
            "copies": copies, "verdict": verdict, "reason": reason, "binary": binary,
            "base_binary": base_binary, "base_name": base_name}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.gpu_stages")
    p.add_argument("stage", choices=("numerics", "bench"))
    p.add_argument("--build-dir", action="append", required=True)
    p.add_argument("--base", choices=("torch", "revision", "none"), default="none")
    p.add_argument("--base-build-dir", action="append", default=[],
                   help="with --base revision: the base's build of each --build-dir's variant, same order")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS),
                   help="numerics seeds (fewer where the time budget needs it)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 3
    if args.stage == "numerics":
        res = numerics_stage(args.build_dir, quick=args.quick, seeds=tuple(args.seeds))
    else:
        res = bench_stage(args.build_dir, base=None if args.base == "none" else args.base,
                          base_dirs=args.base_build_dir)
    Path(args.out).write_text(json.dumps(res, default=str, allow_nan=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
