"""Numerics, defences and stress of a prebuilt kernel with any number of outputs, judged on its op
class's own reference (`OpBase.reference`, float64 oracle and float32-compute path).

`gpu_stages.KernelAdapter` judges kernels with exactly one 'out' parameter through the reference
op's `judge` (every defence of `fasttrack check`). The router, the routed experts, latent_out,
shared_gate_up and router_select write several outputs, some of them integer (the selection and
the grouping), and take inputs the reference ops have no name for (the grouping metadata); they
are judged here, per case of `kernel_cases`:

  * outputs poisoned with NaN (integers with -1) before the launch, then with a finite sentinel
    (-7) before a second launch on the same inputs: every element must be written, and the two
    launches must agree bitwise (poisoned_outputs, determinism);
  * inputs cloned (past BIG_INPUT_BYTES: fingerprinted) before the launch and compared bitwise
    after (input_mutation);
  * another seed's values written into the first case's input buffers, launched again: it must
    match its own reference (reshuffled_inputs; a result kept by address fails);
  * `sync` buffers zeroed once and back at zero after every launch; `scratch` poisoned first;
  * floating outputs against the float64 oracle with the float32-compute path as yardstick
    (`numerics.compare_output`, the policy of validation/tolerances.toml);
  * a selection (router, router_select): ids must be a top-k of the biased scores re-derived from
    the kernel's own logits (`numerics.compare_expert_ids`), exactly the reference rule's (ties
    to the lower expert) on the tie cases; weights from those ids and logits within 1e-5; the
    grouping exactly `routing_groups_ref` of the kernel's own ids.

Input builders per kernel: router cases carry the routing patterns through the selection-only
bias (uniform, hot, same) and the tie cases ("triples", "all", "mixed": scores of both signs
inside the top-k); router_select the same on logits; the routed experts the routings uniform,
hot, same and distinct (`numerics.routing_ids`). Launching goes through `launcher(args)`; the
GPU host passes the cubin, the CPU tests a fake, so every path here runs without a GPU.
"""

from __future__ import annotations

import importlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import defences as D
from .numerics import compare_expert_ids, compare_output, fill_distribution, load_policy, routing_ids

F32, F64 = torch.float32, torch.float64
KERNEL_OWNED_ROLES = ("scratch", "sync")
ROUTER_KERNELS = ("router", "router_select")
EXPERT_KERNELS = ("moe_w13", "moe_w2")
# Every kernel judged here rather than by the reference op's `judge` (validation/check.py): the
# multi-output ones, the routed experts (their inputs carry the grouping the reference ops have no
# name for, and their 59 GB of k3 weights must be drawn once and fingerprinted, never cloned), and
# the kernels that compute a part of their manifest reference op (shared_gate_up, latent_out).
OP_CLASS_KERNELS = (*ROUTER_KERNELS, *EXPERT_KERNELS, "shared_gate_up", "latent_out")
TIE_CASES = ("triples", "all", "mixed")
ROUTINGS = ("uniform", "hot", "same", "distinct")
WEIGHTS_ABS_TOL = 1e-5
STRESS_RUNS = 16
# Kernels whose sync words the host zeroes before every launch (prodcons, the race audit's
# producer/consumer specimen: its flags count steps up and are not reset by the kernel); every
# other kernel leaves its sync words at zero itself, which is checked after every launch.
SYNC_RESET_BY_HOST = ("prodcons",)
INT_POISON = (-1, -7)


@dataclass(frozen=True)
class KCase:
    """One case of a kernel's matrix: a seed and what it varies (value distribution, routing,
    or a tie pattern)."""

    kernel: str
    variant: dict
    seed: int
    what: str  # "normal" | "outliers" | a routing of ROUTINGS | a tie case of TIE_CASES

    @property
    def case_id(self) -> str:
        v = ",".join(f"{k}={x}" for k, x in sorted(self.variant.items()))
        return f"{self.kernel}/{v}/s{self.seed}/{self.what}"

    def to_dict(self) -> dict:
        return {"case_id": self.case_id, "kernel": self.kernel, "variant": self.variant, "seed": self.seed,
                "what": self.what}


def is_multi_output(meta: dict) -> bool:
    """Whether a build's meta.json declares other than exactly one 'out' parameter (besides the
    kernel's own scratch and sync): such a kernel is judged here, not by the reference op's judge."""
    outs = [p for p in meta["params"] if p.get("direction") in ("out", "inout")
            and not (p.get("role") in KERNEL_OWNED_ROLES and p["spec"]["kind"] == "tensor")]
    return not (len(outs) == 1 and outs[0]["direction"] == "out")


def kernel_cases(kernel: str, variant: dict, seeds=(0, 1)) -> list[KCase]:
    """The case matrix of one variant. Fewer `seeds` where the time budget needs it (the bundle
    records which were run)."""
    if kernel == "router" or kernel == "router_select":
        whats = ["normal", "hot", "same", *TIE_CASES]
    elif kernel in EXPERT_KERNELS:
        whats = list(ROUTINGS)
    else:
        whats = ["normal", "outliers"]
    out = []
    for s in seeds:
        for w in whats:
            if w in TIE_CASES and s != seeds[0]:
                continue  # a tie pattern is exact: one seed says it
            out.append(KCase(kernel, dict(variant), int(s), w))
    return out


def _gen(case: KCase, name: str, device) -> torch.Generator:
    import hashlib

    g = torch.Generator(device=torch.device(device))
    key = f"{case.case_id}:{name}".encode()
    g.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)
    return g


def _weight_gen(kernel: str, variant: dict, name: str, device) -> torch.Generator:
    """Weights depend on the variant, not the case: the experts' 59 GB are drawn once."""
    return _gen(KCase(kernel, variant, 0, "weights"), name, device)


class WeightCache:
    """Static inputs by (kernel, variant, name): drawn once per variant (the routed experts' weights
    are tens of GB at k3) and reused across cases; the input-mutation defence guards them."""

    def __init__(self):
        self._d: dict = {}

    def get(self, key, make):
        if key not in self._d:
            self._d[key] = make()
        return self._d[key]

    def clear(self) -> None:
        self._d.clear()


def _randn(shape, g, device, scale=1.0, dtype=torch.bfloat16):
    """N(0, scale^2) in `dtype`, drawn a slice of dim 0 at a time (the experts' 39 GB W13 would
    need twice that again as float32 drawn at once)."""
    shape = tuple(shape)
    out = torch.empty(shape, dtype=dtype, device=device)
    if len(shape) < 3:
        return out.copy_(torch.randn(shape, generator=g, device=device) * scale)
    for i in range(shape[0]):
        out[i].copy_(torch.randn(shape[1:], generator=g, device=device) * scale)
    return out


BIG_INPUT_BYTES = 1 << 30


def fingerprint(t: torch.Tensor):
    """What input_mutation compares: a clone, or for an input past BIG_INPUT_BYTES (the experts'
    weights) per-slice sums of its bits, plain and position-weighted (a change, or a move, of any
    element shows)."""
    if t.nbytes <= BIG_INPUT_BYTES or t.dim() < 2:
        return t.clone()
    iv = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    sums = []
    for i in range(t.shape[0]):
        b = t[i].contiguous().view(iv).reshape(-1).double()
        w = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.float64)
        sums.append(torch.stack([b.sum(), (b * w).sum()]))
    return torch.stack(sums)


def same_fingerprint(t: torch.Tensor, fp) -> bool:
    return D.same_bits(fingerprint(t), fp)


def _tie_router(w_gate, bias, how: str, h, top_k: int):
    """Router weights whose scores tie ("triples": rows and bias repeated in threes; "all": every
    row equal, bias 0: the selection must be experts 0..top_k-1) or change sign inside a token's
    top k ("mixed": the bias shifted so half of token 0's top-k biased scores are negative)."""
    E = w_gate.shape[0]
    if how == "all":
        return w_gate[:1].expand(E, -1).contiguous(), torch.zeros_like(bias)
    if how == "mixed":
        s = torch.sigmoid(h[0].float() @ w_gate.float().T) + bias
        top = s.sort(descending=True).values
        half = max(top_k // 2, 1)
        return w_gate, (bias - (top[half - 1] + top[half]) / 2).contiguous()
    idx = (torch.arange(E, device=w_gate.device) // 3) * 3
    return w_gate[idx].contiguous(), bias[idx].contiguous()


def _bias(case: KCase, E: int, top_k: int, device) -> torch.Tensor:
    b = 0.02 * torch.randn(E, generator=_gen(case, "bias", device), device=device)
    if case.what == "hot":
        b[: max(1, top_k // 2)] += 1.0
    elif case.what == "same":
        b[:top_k] += 10.0
    return b.float()


def build_kernel_inputs(op, kernel: str, case: KCase, specs: dict, in_names: list[str], device,
                        cache: WeightCache | None = None) -> tuple[dict, dict]:
    """(kernel inputs by parameter name, extra reference arguments) of one case."""
    cache = cache or WeightCache()
    dev = torch.device(device)
    var = case.variant
    extra: dict = {}

    def static(name, make):
        return cache.get((kernel, tuple(sorted(var.items())), name), make)

    def weight(name):
        sp = specs[name]
        fan_in = sp.shape[-1]
        return static(name, lambda: _randn(sp.shape, _weight_gen(kernel, var, name, dev), dev, fan_in ** -0.5,
                                           getattr(torch, sp.dtype)))

    def act(name, scale=1.0):
        sp = specs[name]
        dist = "outliers" if case.what == "outliers" else "normal"
        t = fill_distribution(tuple(sp.shape), dist, _gen(case, name, dev), dev, getattr(torch, sp.dtype))
        return t * scale if scale != 1.0 else t

    ins: dict = {}
    if kernel == "router":
        ins["h"] = act("h")
        wg, wd = weight("w_gate"), weight("w_down")
        bias = _bias(case, op.n_experts, op.top_k, dev)
        if case.what in TIE_CASES:
            wg, bias = _tie_router(wg, bias, case.what, ins["h"], op.top_k)
        ins.update(w_gate=wg, bias=bias, w_down=wd)
    elif kernel == "router_select":
        logits = 2.0 * torch.randn(tuple(specs["logits"].shape), generator=_gen(case, "logits", dev), device=dev)
        bias = _bias(case, op.n_experts, op.top_k, dev)
        if case.what == "triples":
            idx = (torch.arange(op.n_experts, device=dev) // 3) * 3
            logits, bias = logits[:, idx].contiguous(), bias[idx].contiguous()
        elif case.what == "all":
            logits, bias = logits[:, :1].expand_as(logits).contiguous(), torch.zeros_like(bias)
        elif case.what == "mixed":
            s = torch.sigmoid(logits[0]) + bias
            top = s.sort(descending=True).values
            half = max(op.top_k // 2, 1)
            bias = (bias - (top[half - 1] + top[half]) / 2).contiguous()
        ins.update(logits=logits.float(), bias=bias)
    elif kernel in EXPERT_KERNELS:
        from kernels.ops.router import routing_groups_ref

        T, E, K = op.batch, op.n_experts, op.top_k
        ids = routing_ids(T, E, K, case.what, _gen(case, "ids", "cpu"), "cpu").to(dev)
        meta = routing_groups_ref(ids, E)
        G = specs["group_expert"].shape[0]
        meta = {"n_groups": meta["n_groups"], "group_expert": meta["group_expert"][:G].contiguous(),
                "group_start": meta["group_start"][: G + 1].contiguous(), "sorted_slots": meta["sorted_slots"]}
        extra["ids"] = ids
        if kernel == "moe_w13":
            ins.update(z=act("z"), w13=weight("w13"), **meta)
        else:
            w = torch.rand(T, K, generator=_gen(case, "weights", dev), device=dev) + 0.05
            ins.update(act=act("act"), w2=weight("w2"), weights=(w / w.sum(-1, keepdim=True)).float(), **meta)
    else:  # dense kernels: activations from the case's distribution, weights fan-in scaled
        for n in in_names:
            sp = specs[n]
            if n.startswith("w") or n.startswith("gamma"):
                ins[n] = weight(n) if n.startswith("w") else static(
                    n, lambda sp=sp, n=n: (1.0 + 0.05 * torch.randn(tuple(sp.shape), generator=_weight_gen(
                        kernel, var, n, dev), device=dev)).to(getattr(torch, sp.dtype)))
            else:
                ins[n] = act(n)
    missing = [n for n in in_names if n not in ins]
    if missing:
        raise ValueError(f"{kernel}: no input builder for parameter(s) {missing}")
    return ins, extra


def defined(name: str, t: torch.Tensor, outs: dict) -> torch.Tensor:
    """The part of output `name` the kernel's contract defines: the grouping's entries past
    n_groups are not (consumers read group_expert[:n] and group_start[:n + 1] only)."""
    if name in ("group_expert", "group_start") and "n_groups" in outs:
        n = int(outs["n_groups"].reshape(-1)[0])
        n = max(0, min(n, t.numel()))
        return t[: n + (name == "group_start")]
    return t


def _poison(t: torch.Tensor, which: int) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan") if which == 0 else D.SENTINEL_POISON)
    return t.fill_(INT_POISON[which])


class BuildMismatch(ValueError):
    """A build whose meta.json this checkout's op class cannot stand for: its parameters' tensor
    specs differ from the op's at the build's variant, or the op refuses the build's tunables."""


def known_tunables(kernel: str) -> set[str] | None:
    """The tunables this checkout's manifest declares for `kernel` (None: not a manifest kernel)."""
    from kernels.manifest import ManifestError, load_manifest

    try:
        return set(load_manifest().kernel(kernel).tunable_defaults())
    except (ManifestError, KeyError):
        return None


def op_instance(meta: dict, op_path: str):
    """This checkout's op class at a build's variant: the judge's reference and tensor layout.

    A build of another revision (a plan's base) may carry tunables today's class no longer has
    (the router's 16 of 83f6b15): the op is built with only the tunables today's manifest
    declares, the others left out (`op.dropped_tunables`). What the judge takes from the op,
    the reference and the parameters' shapes, must then agree with the build's own meta.json:
    `check_specs` refuses the build otherwise."""
    mod, _, cls = op_path.partition(":")
    tun = dict(meta.get("tunables") or {})
    known = known_tunables(meta.get("kernel", ""))
    kept = tun if known is None else {k: v for k, v in tun.items() if k in known}
    try:
        op = getattr(importlib.import_module(mod), cls)(dict(meta["variant"]), **kept)
    except ValueError as e:
        raise BuildMismatch(f"{meta.get('kernel')} {meta.get('variant')}: this checkout's {cls} refuses the "
                            f"build's tunables {kept} ({e})") from None
    op.dropped_tunables = sorted(set(tun) - set(kept))
    return op


def check_specs(meta: dict, op, owned_roles=KERNEL_OWNED_ROLES) -> None:
    """Raise BuildMismatch unless every tensor parameter of the build (besides its own scratch and
    sync buffers, allocated from meta.json as they are) has the shape and dtype `op` gives it."""
    specs = op.tensor_specs()
    bad = []
    for p in meta["params"]:
        sp = p["spec"]
        if sp.get("kind") != "tensor" or p.get("role") in owned_roles:
            continue
        mine = specs.get(p["name"])
        if mine is None or list(mine.shape) != list(sp.get("shape", ())) or mine.dtype != sp.get("dtype"):
            got = None if mine is None else f"{list(mine.shape)} {mine.dtype}"
            bad.append(f"{p['name']}: build {sp.get('shape')} {sp.get('dtype')}, op {got}")
    if bad:
        dropped = getattr(op, "dropped_tunables", [])
        raise BuildMismatch(
            f"{meta.get('kernel')} {meta.get('variant')} (build {meta.get('key', '?')[:16]}): its parameters are "
            f"not those of this checkout's op at that variant ({'; '.join(bad)})"
            + (f"; tunables this checkout does not know, left out: {dropped}" if dropped else "")
            + ": it cannot be judged on this checkout's reference")


class MultiKernel:
    """One prebuilt variant of a kernel judged on its op class's reference. `launcher(args)` runs
    the kernel on positional arguments in parameter order (default: the cubin)."""

    def __init__(self, build_dir=None, *, meta: dict | None = None, device="cuda",
                 launcher: Callable[[list], None] | None = None, op_path: str | None = None,
                 cache: WeightCache | None = None):
        from pathlib import Path

        from .gpu_stages import read_meta

        self.meta = meta if meta is not None else read_meta(build_dir)
        self.dir = Path(build_dir) if build_dir is not None else None
        self.name = self.meta["kernel"]
        if op_path is None:
            from kernels.manifest import load_manifest

            op_path = load_manifest().kernel(self.name).op
        self.op = op_instance(self.meta, op_path)
        check_specs(self.meta, self.op)
        self.specs = self.op.tensor_specs()
        self.params = self.meta["params"]
        self.device = torch.device(device)
        self.variant = dict(self.meta["variant"])
        self.owned = [p for p in self.params if p.get("role") in KERNEL_OWNED_ROLES and p["spec"]["kind"] == "tensor"]
        owned_names = {p["name"] for p in self.owned}
        self.outs = [p["name"] for p in self.params if p.get("direction") in ("out", "inout")
                     and p["name"] not in owned_names]
        self.ins = [p["name"] for p in self.params if p.get("direction", "in") == "in"
                    and p["spec"]["kind"] == "tensor"]
        if launcher is None:
            from kernels.launch import CubinKernel

            self.kernel = CubinKernel.from_dir(build_dir)
            launcher = lambda args: self.kernel(*args)  # noqa: E731
            self.sha256 = self.kernel.sha256
        else:
            self.kernel = None
            self.sha256 = (self.meta.get("hashes") or {}).get("cubin_sha256")
        self.launcher = launcher
        self.cache = cache or WeightCache()
        self.owned_bufs = {}
        for p in self.owned:
            sp = p["spec"]
            t = torch.empty(tuple(sp["shape"]), dtype=getattr(torch, sp["dtype"]), device=self.device)
            self.owned_bufs[p["name"]] = t.zero_() if p["role"] == "sync" else _poison(t, 0)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.variant.items())

    def new_outputs(self) -> dict:
        return {n: torch.empty(tuple(self.specs[n].shape), dtype=getattr(torch, self.specs[n].dtype),
                               device=self.device) for n in self.outs}

    def args(self, ins: dict, outs: dict) -> list:
        a = []
        for p in self.params:
            n = p["name"]
            if p["spec"]["kind"] == "scalar":
                a.append(p["spec"]["value"])
            elif n in self.owned_bufs:
                a.append(self.owned_bufs[n])
            elif n in outs:
                a.append(outs[n])
            elif n in ins:
                a.append(ins[n])
            else:
                raise ValueError(f"{self.name}: parameter {n!r} has no input, output or owned buffer")
        return a

    def sync_left(self) -> list[str]:
        """The sync buffers not back at zero (then re-zeroed, so later cases stand on their own)."""
        if self.name in SYNC_RESET_BY_HOST:
            return []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        left = []
        for p in self.owned:
            if p["role"] == "sync":
                t = self.owned_bufs[p["name"]]
                k = int(torch.count_nonzero(t))
                if k:
                    left.append(f"sync buffer {p['name']!r}: {k} of {t.numel()} word(s) left non-zero after the "
                                "launch (the contract: the kernel leaves its sync words at zero)")
                    t.zero_()
        return left

    def launch(self, ins: dict, which_poison: int = 0) -> dict:
        outs = {n: _poison(t, which_poison) for n, t in self.new_outputs().items()}
        for p in self.owned:
            if p["role"] == "scratch":
                _poison(self.owned_bufs[p["name"]], 0)
            elif self.name in SYNC_RESET_BY_HOST:
                self.owned_bufs[p["name"]].zero_()
        self.launcher(self.args(ins, outs))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return outs

    def inputs(self, case: KCase) -> tuple[dict, dict]:
        return build_kernel_inputs(self.op, self.name, case, self.specs, self.ins, self.device, self.cache)

    # -- judging ---------------------------------------------------------------------------------
    def references(self, ins: dict, extra: dict) -> tuple[dict, dict]:
        """(float32-compute path, float64 oracle) of the op on `ins`."""
        import inspect

        kw = {**ins, **extra}
        params = inspect.signature(self.op.reference).parameters
        if "compute_dtype" not in params:  # a reference with one precision: it is the oracle too
            r = self.op.reference(**{k: v for k, v in kw.items() if k in params})
            return r, {k: v.double() if v.dtype.is_floating_point else v for k, v in r.items()}
        return self.op.reference(**kw, compute_dtype=F32), self.op.reference(**kw, compute_dtype=F64)

    def compare(self, case: KCase, ins: dict, extra: dict, outs: dict, policy) -> tuple[list, list[str]]:
        """(metrics, reasons) of one launch's outputs."""
        ref, oracle = self.references(ins, extra)
        metrics, reasons = [], []
        done = set()
        if self.name in ROUTER_KERNELS:
            m, r = self._selection(case, ins, outs, ref, policy)
            metrics += m
            reasons += r
            done |= {"ids", "weights", "n_groups", "group_expert", "group_start", "sorted_slots"}
            if self.name == "router_select":
                done.add("logits")
        for n in self.outs:
            if n in done:
                continue
            if n not in ref:
                reasons.append(f"{n}: the op's reference does not give this output")
                continue
            cand = outs[n]
            if not cand.dtype.is_floating_point:
                ok = torch.equal(cand.cpu(), ref[n].to(cand.dtype).cpu())
                metrics.append({"name": n, "exact": ok, "passed": ok})
                if not ok:
                    reasons.append(f"{n}: integers differ from the reference")
                continue
            om = compare_output(n, cand, oracle[n], ref[n].to(cand.dtype) if ref[n].dtype != cand.dtype else ref[n],
                                policy)
            metrics.append(om.to_dict())
            reasons += om.reasons
        return metrics, reasons

    def _selection(self, case: KCase, ins: dict, outs: dict, ref: dict, policy) -> tuple[list, list[str]]:
        """ids / weights / grouping, re-derived from the kernel's own logits (router) or the input
        logits (router_select) by the reference rule."""
        from kernels.ops.router import routing_groups_ref
        from kernels.reference import select_experts

        metrics, reasons = [], []
        logits = (outs["logits"] if self.name == "router" else ins["logits"]).float()
        bias = ins["bias"].float()
        ids = outs["ids"]
        E, K = logits.shape[1], ids.shape[1]
        s = torch.sigmoid(logits.double())
        scores = s + bias.double()
        idm = compare_expert_ids("ids", ids, scores, ref["ids"], policy)
        metrics.append(idm.to_dict())
        reasons += idm.reasons
        in_range = bool(((ids >= 0) & (ids < E)).all())
        if case.what in TIE_CASES:
            want = select_experts(torch.sigmoid(logits), bias, K).to(ids.device)
            exact = torch.equal(ids.long().cpu(), want.long().cpu())
            metrics.append({"name": "ids_exact_on_ties", "passed": exact})
            if not exact:
                reasons.append(f"ids: on tied scores ({case.what}) not exactly the reference rule's "
                               "(ties to the lower expert)")
        if not in_range:
            return metrics, reasons + ["ids: out of range; weights and grouping not judged"]
        sel = torch.gather(s, 1, ids.long())
        want_w = sel / (sel.sum(-1, keepdim=True) + 1e-20) * float(self.op.scale)
        err = float((outs["weights"].double() - want_w).abs().max()) if outs["weights"].numel() else 0.0
        ok_w = err <= WEIGHTS_ABS_TOL
        metrics.append({"name": "weights", "max_abs_err": err if math.isfinite(err) else str(err),
                        "allowed": WEIGHTS_ABS_TOL, "passed": ok_w})
        if not ok_w:
            reasons.append(f"weights: max error {err:.3g} against the kernel's own selection exceeds {WEIGHTS_ABS_TOL:g}")
        g = routing_groups_ref(ids.cpu(), self.op.n_experts)
        n = int(g["n_groups"][0])
        got_n = int(outs["n_groups"][0])
        ok_g = (got_n == n and torch.equal(outs["group_expert"][:n].cpu(), g["group_expert"][:n])
                and torch.equal(outs["group_start"][: n + 1].cpu(), g["group_start"][: n + 1])
                and torch.equal(outs["sorted_slots"].cpu(), g["sorted_slots"]))
        metrics.append({"name": "grouping", "n_groups": got_n, "passed": bool(ok_g)})
        if not ok_g:
            reasons.append(f"grouping: not the grouping of the kernel's own ids (n_groups {got_n}, expected {n})")
        return metrics, reasons

    def judge_case(self, case: KCase, policy) -> dict:
        t0 = time.time()
        ins, extra = self.inputs(case)
        before = {n: fingerprint(t) for n, t in ins.items()}
        defects = []
        try:
            outs = self.launch(ins, 0)
            defects += self.sync_left()
            outs2 = self.launch(ins, 1)
            defects += self.sync_left()
        except Exception as e:  # noqa: BLE001 - a failed launch is this case's failure
            return {**case.to_dict(), "passed": False, "reasons": [f"launch failed: {type(e).__name__}: {e}"],
                    "outputs": [], "seconds": round(time.time() - t0, 3)}
        changed = [n for n in ins if not same_fingerprint(ins[n], before[n])]
        if changed:
            defects.append(f"input_mutation: the kernel modified input(s) {changed}")
        differ = [n for n in outs if not D.same_bits(*(defined(n, o, outs) for o in (outs[n], outs2[n])))]
        if differ:
            defects.append(f"poisoned_outputs/determinism: output(s) {differ} differ between a NaN-poisoned "
                           "and a sentinel-poisoned launch on the same inputs (unwritten elements or "
                           "non-deterministic results)")
        metrics, reasons = self.compare(case, ins, extra, outs, policy)
        reasons = defects + reasons
        return {**case.to_dict(), "passed": not reasons, "reasons": reasons, "outputs": metrics,
                "defects": defects, "seconds": round(time.time() - t0, 3)}

    def stress(self, case: KCase, runs: int = STRESS_RUNS) -> dict:
        """`runs` launches on the same inputs: every output bitwise equal to the first, sync words
        back at zero after each."""
        ins, _ = self.inputs(case)
        first, differing, left = None, 0, 0
        for _ in range(runs):
            outs = self.launch(ins, 0)
            left += bool(self.sync_left())
            if first is None:
                first = outs
            elif not all(D.same_bits(defined(n, outs[n], outs), defined(n, first[n], first)) for n in outs):
                differing += 1
        return {"runs": runs, "differing": differing, "sync_left_nonzero": left,
                "passed": differing == 0 and left == 0}

    def same_buffers(self, case: KCase, policy) -> dict:
        """reshuffled_inputs: a launch on `case`, then another seed's values of the same kind written
        into the same input buffers (same addresses; the static weights are the same tensors
        anyway), launched again: it must match its own reference (a kernel keeping results keyed
        by an address, in a global of its own, fails)."""
        ins, _ = self.inputs(case)
        try:
            self.launch(ins, 0)
            left = self.sync_left()
            other = KCase(case.kernel, case.variant, case.seed + 1000, case.what)
            new, extra = self.inputs(other)
            for n, t in new.items():
                if ins[n] is not t:
                    ins[n].copy_(t)
            outs = self.launch(ins, 0)
            left += self.sync_left()
        except Exception as e:  # noqa: BLE001 - a failed launch is this check's failure
            return {"name": "reshuffled_inputs", "passed": False, "applicable": True,
                    "detail": f"launch failed: {type(e).__name__}: {e}", "cases": [case.case_id]}
        _, reasons = self.compare(other, ins, extra, outs, policy)
        reasons = left + reasons
        return {"name": "reshuffled_inputs", "passed": not reasons, "applicable": True,
                "detail": (f"new values in the previous launch's input buffers: {'; '.join(reasons[:2])}" if reasons
                           else "new values written into the previous launch's input buffers matched their own reference"),
                "cases": [case.case_id, other.case_id]}


def judge_variant(mk: MultiKernel, *, seeds=(0, 1), policy=None, stress_runs: int = STRESS_RUNS) -> dict:
    """Every case of the variant, defences as checks, and the stress: one entry of the numerics
    stage's `variants` (the shape `validate.merge_checks` reads)."""
    policy = policy or load_policy()
    t0 = time.time()
    cases = kernel_cases(mk.name, mk.variant, seeds)
    rows = [mk.judge_case(c, policy) for c in cases]
    st = mk.stress(cases[0], stress_runs)
    reshuffled = mk.same_buffers(cases[0], policy)
    mk.cache.clear()

    def check(name, key, ok_detail):
        bad = [r for r in rows if any(key in x for x in r["reasons"])]
        return {"name": name, "passed": not bad, "applicable": True,
                "detail": (f"{len(bad)} case(s), e.g. {bad[0]['case_id']}: "
                           f"{next(x for x in bad[0]['reasons'] if key in x)}") if bad else ok_detail.format(n=len(rows)),
                "cases": [r["case_id"] for r in bad]}

    checks = [
        check("poisoned_outputs", "poisoned_outputs", "every output element written in {n} cases (NaN, then a sentinel)"),
        check("input_mutation", "input_mutation", "no input modified in {n} cases (cloned and compared bitwise)"),
        check("precision_vs_oracle", "relative error", "all {n} cases within the policy against the float64 oracle"),
        check("determinism", "determinism", "two launches per case bitwise identical in {n} cases"),
        reshuffled,
    ]
    for c in checks:
        c["passed"] = c["passed"] and not any(r["reasons"] and r["reasons"][0].startswith("launch failed")
                                              for r in rows)
    binary = {"kernel": mk.name, "side": "head", "variant": mk.variant, "tunables": mk.meta.get("tunables", {}),
              "build_key": mk.meta.get("key"), "cubin_sha256": mk.sha256,
              "cubin_code_sha256": (mk.meta.get("hashes") or {}).get("cubin_code_sha256")}
    passed = all(r["passed"] for r in rows) and st["passed"] and reshuffled["passed"]
    return {"binary": binary, "label": mk.label, "passed": passed,
            "cases": [{**r, "kernel": mk.name, "variant": mk.variant} for r in rows], "checks": checks,
            "stress": st, "seeds": list(seeds), "seconds": round(time.time() - t0, 2)}


# -- timing inputs ------------------------------------------------------------------------------

def bytes_moved(mk: MultiKernel, ins: dict, extra: dict) -> int:
    """The bytes the op must move: its inputs (the routed experts: only the selected experts'
    weights) plus its outputs."""
    total = 0
    for n, t in ins.items():
        if mk.name in EXPERT_KERNELS and n in ("w13", "w2"):
            uniq = int(torch.unique(extra["ids"]).numel())
            total += t[0].nbytes * uniq
        else:
            total += t.nbytes
    total += sum(mk.specs[n].nbytes() for n in mk.outs)
    return int(total)


def mean_bytes_moved(mk: MultiKernel, pairs: list[tuple[dict, dict]]) -> int:
    """The bytes per launch of launches that cycle through `pairs` ((inputs, extra) per launch):
    the mean of their `bytes_moved`. The routed experts' rotated routings select different
    numbers of experts, so one routing's count would misstate what the timed launches read."""
    return round(sum(bytes_moved(mk, i, e) for i, e in pairs) / len(pairs))
