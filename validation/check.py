"""Judge an implementation of a reference op: the case matrix plus every defence.

`check_callable(op, fn, device)` is what `fasttrack check --op OP --impl MODULE:CALLABLE` runs: any
Python callable that claims to implement reference op OP (same signature as the function in
`kernels.reference.REFERENCE_OPS`, without `compute_dtype`) is judged the same way as the
project's own kernels. `judge(subject, ...)` is the shared core `fasttrack validate` uses for
cubins (through a `DestinationSubject`).

Imports torch and the validator only (runs on the GPU host).
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field

import torch

from kernels.config import ModelConfig, get_config
from kernels.reference import REFERENCE_OPS

from . import defences as D
from .numerics import (DECODE_BATCHES, DEFAULT_SEEDS, DISTRIBUTIONS, Case, TolerancePolicy,
                       case_matrix, gpu_configuration, load_policy)
from .opinputs import OP_DEFS, OpDef, build_inputs, op_def

# Shapes a candidate is never shown during the matrix: odd batches, and a config whose widths
# differ from every preset's (multiples of 8, as every kernel may assume). Each run adds shapes
# drawn from the operating system's entropy (`sampled_unseen`), so no candidate can know them.
UNSEEN_BATCHES = (5, 17)
UNSEEN_CONFIG = ModelConfig(name="unseen", hidden=96, latent=40, n_experts=12, top_k=3,
                            expert_inter=16, shared_inter=32)
# The check's matrix: every decode batch, plus 3 (odd, fills no power-of-two tile).
CHECK_BATCHES = tuple(sorted(set(DECODE_BATCHES) | {3}))
# ...and the value distributions beyond the validator's: past fp16's range, exact score ties
CHECK_DISTRIBUTIONS = DISTRIBUTIONS + ("beyond_fp16",)


@dataclass
class JudgeReport:
    """The outcome of judging one subject: bundle-ready `correctness` and `defences` sections."""

    subject: str
    op: str
    device: str
    cases: list[D.CaseResult]
    checks: list[D.DefenceResult]
    policy: TolerancePolicy
    not_covered: list[str] = field(default_factory=list)

    @property
    def correctness_passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def defences_passed(self) -> bool:
        return all(d.passed for d in self.checks)

    @property
    def passed(self) -> bool:
        return self.correctness_passed and self.defences_passed

    def failure_reasons(self, limit: int = 5) -> list[str]:
        out = [f"defence {d.name}: {d.detail}" for d in self.checks if not d.passed]
        out += [f"case {c.case.case_id}: {'; '.join(c.reasons[:2])}" for c in self.cases if not c.passed]
        return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])

    def correctness(self) -> dict:
        return {"passed": self.correctness_passed, "policy": self.policy.to_dict(),
                "cases": [c.to_dict() for c in self.cases]}

    def defences(self) -> dict:
        return {"passed": self.defences_passed, "checks": [d.to_dict() for d in self.checks]}


def _probe(cases: list[Case]) -> Case:
    """The case the multi-call defences run on: normal values, the smallest batch of at least 3."""
    normal = [c for c in cases if c.distribution == "normal" and "boundary" not in c.tags] or cases
    multi = sorted((c for c in normal if c.batch >= 3), key=lambda c: c.batch)
    return (multi or normal)[0]


def judge(subject, op: OpDef, base_cfg: ModelConfig, cases: list[Case], *,
          policy: TolerancePolicy | None = None, unseen: list[Case] | None = None,
          unseen_reason: str = "", delay_s: float = D.DEFAULT_DELAY_S,
          progress=None) -> JudgeReport:
    """Run every case (reference first, outputs poisoned, inputs guarded) and every defence.

    `unseen` are cases outside the declared matrix (shape specialisation); pass None with
    `unseen_reason` where the subject cannot take other shapes (a cubin built for one variant).
    """
    policy = policy or load_policy()
    results: list[D.CaseResult] = []
    for i, case in enumerate(cases):
        inputs = build_inputs(op, case, base_cfg, subject.device)
        res = D.evaluate(subject, op, case, inputs, policy, delay_s=delay_s)[0]
        results.append(res)
        del inputs
        if progress:
            progress(i + 1, len(cases), res)
    gc.collect()
    probe = _probe(cases)
    checks = [
        D.check_coverage(subject, op, probe, build_inputs(op, probe, base_cfg, subject.device), policy),
        D.defence_from_matrix("input_mutation", results, "input_mutation",
                              "no input modified in {n} calls (all inputs cloned and compared bitwise)"),
        D.defence_from_matrix("output_aliasing", results, "output_aliasing",
                              "no output shared memory with an input or a reference output in {n} calls"),
        D.check_both_orders(subject, op, probe, base_cfg, policy),
        D.check_reshuffled(subject, op, probe, base_cfg, policy),
    ]
    unseen_results: list[D.CaseResult] = []
    if unseen:
        d, unseen_results = D.check_unseen(subject, op, unseen, base_cfg, policy)
        checks.append(d)
    else:
        checks.append(D.not_applicable("unseen_shapes", unseen_reason or "no unseen shapes given"))
    precision_bad = [r for r in results if any(
        "relative error" in x or "mismatch" in x for m in r.outputs for x in m.reasons)]
    measured = [r for r in results if r.outputs and D.ran(r)]
    if precision_bad:
        checks.append(D.DefenceResult(
            "precision_vs_oracle", False, True,
            f"{len(precision_bad)} case(s) beyond the policy's factor of the bf16 reference's error "
            f"against the float64 oracle, e.g. {precision_bad[0].case.case_id}: {precision_bad[0].reasons[0]}",
            [r.case.case_id for r in precision_bad]))
    elif not measured:
        checks.append(D.not_measured("precision_vs_oracle", results))
    else:
        unmeasured = len(results) - len(measured)
        checks.append(D.DefenceResult(
            "precision_vs_oracle", True, True,
            f"all {len(measured)} measured cases within the policy's factor of the bf16 reference's error "
            "against the float64 oracle" + (f" ({unmeasured} case(s) not measured: the call raised "
                                            "or returned no comparable output)" if unmeasured else ""),
            [r.case.case_id for r in measured]))
    checks.append(D.check_determinism(subject, op, probe, base_cfg, policy))
    checks.append(D.defence_from_matrix("work_after_return", results, "work_after_return",
                                        "outputs unchanged after a device sync and delay in {n} calls; no threads left"))
    order = {n: i for i, n in enumerate(D.DEFENCE_NAMES)}
    checks.sort(key=lambda d: order.get(d.name, len(order)))
    return JudgeReport(subject.name, op.name, str(subject.device), results + unseen_results, checks, policy)


def reference_ops() -> dict[str, str]:
    """Each op `check` can judge, with its reference callable as MODULE:FUNCTION."""
    return {name: f"{fn.__module__}:{fn.__name__}" for name, fn in REFERENCE_OPS.items() if name in OP_DEFS}


def matrix_for(op: OpDef, cfg: ModelConfig, device, *, quick: bool = False) -> list[Case]:
    """The declared matrix of a reference op on a preset; `quick` keeps one seed and two batches."""
    gpu = gpu_configuration(device)
    batches = (1, 8) if quick else CHECK_BATCHES
    seeds = DEFAULT_SEEDS[:1] if quick else DEFAULT_SEEDS
    cases = case_matrix(op.name, [{}], moe=op.moe, gpu=gpu, batches=batches, seeds=seeds,
                        distributions=DISTRIBUTIONS, boundary=list(op.boundary))
    # past fp16's range at every batch (one seed); exact ties for ops that select experts
    extra = ["beyond_fp16"] + (["ties"] if op.name in D.SELECTING_OPS else [])
    if op.name == "route_logits":  # logits given: NaN and ±inf scores (counted as -inf: vLLM's rule)
        extra.append("nonfinite")
    base_routing = "uniform" if op.moe else None
    cases += [Case(op.name, {}, b, seeds[0], d, base_routing, gpu, (d,)) for d in extra for b in batches]
    return cases


def sampled_unseen(op: OpDef, gpu: dict, rng: random.Random | None = None) -> list[Case]:
    """Shapes drawn per run: two batches in 6..96 outside the decode batches, and one config of
    widths (multiples of 8) no preset has. `rng` defaults to the OS's entropy."""
    rng = rng or random.SystemRandom()
    pool = [b for b in range(6, 97) if b not in CHECK_BATCHES and b not in UNSEEN_BATCHES]
    batches = rng.sample(pool, 2)
    hidden = 8 * rng.randint(7, 20)
    top_k = rng.randint(2, 4)
    # the latent is at most the hidden width (ModelConfig refuses more)
    cfg = {"hidden": hidden, "latent": 8 * rng.randint(3, min(8, hidden // 8)), "n_experts": rng.randint(top_k + 2, 20),
           "top_k": top_k, "expert_inter": 8 * rng.randint(1, 4), "shared_inter": 8 * rng.randint(2, 6)}
    if op.name in ("rmsnorm", "residual"):
        prob = {"width": hidden}
    elif op.name in ("linear", "latent_down"):
        prob = {"n": cfg["latent"], "k": hidden}
    elif op.name == "gated_situ":
        prob = {"width": cfg["shared_inter"]}
    else:
        prob = cfg
    routing = "uniform" if op.moe else None
    return ([Case(op.name, {}, b, 11, "normal", routing, gpu, ("unseen", "sampled")) for b in batches]
            + [Case(op.name, prob, batches[0], 13, "normal", routing, gpu, ("unseen", "sampled"))])


def unseen_for(op: OpDef, device) -> list[Case]:
    """Unseen shapes for a reference op: odd batches on the base config and the `unseen` widths."""
    gpu = gpu_configuration(device)
    problems = [{}] + [{k: v for k, v in UNSEEN_CONFIG.to_dict().items() if k != "name"}]
    # Row-wise ops and linear take their widths from the problem, not the config.
    if op.name in ("rmsnorm", "residual"):
        problems[1] = {"width": UNSEEN_CONFIG.hidden}
    elif op.name in ("linear", "latent_down"):
        problems[1] = {"n": UNSEEN_CONFIG.latent, "k": UNSEEN_CONFIG.hidden}
    return ([Case(op.name, p, b, 7, "normal", "uniform" if op.moe else None, gpu, ("unseen",))
             for p in problems for b in UNSEEN_BATCHES] + sampled_unseen(op, gpu))


def check_callable(op_name: str, fn, *, device: str = "cpu", preset: str = "tiny",
                   quick: bool = False, policy: TolerancePolicy | None = None,
                   delay_s: float = D.DEFAULT_DELAY_S, progress=None) -> JudgeReport:
    """Judge `fn`, which claims to implement reference op `op_name`, on `device`.

    KeyError for an unknown op; everything the candidate does wrong (raising included) is in the
    report, never an exception.
    """
    op = op_def(op_name)
    cfg = get_config(preset)
    dev = torch.device(device)
    subject = D.CallableSubject(fn, getattr(fn, "__qualname__", repr(fn)), dev)
    return judge(subject, op, cfg, matrix_for(op, cfg, dev, quick=quick), policy=policy,
                 unseen=unseen_for(op, dev), delay_s=delay_s, progress=progress)
