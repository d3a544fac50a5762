"""Defences: the validator assumes the candidate is adversarial (ARCHITECTURE.md, decision 4).

A judged implementation is a `Subject`: either a Python callable with the reference op's signature
(`CallableSubject`, for `fasttrack check`) or a kernel that writes into buffers the harness
allocates (`DestinationSubject`, for cubins launched by `fasttrack validate`). Both go through the
same guarded call, `invoke`, and the same defences:

  poisoned_outputs    outputs are poisoned (NaN, then a finite sentinel) before every run and every
                      element must be overwritten; for callables, the allocator's free memory of the
                      output sizes is poisoned first, so a stale buffer cannot pass for a result
  input_mutation      every input (weights included) is cloned before the call and compared bitwise;
                      during the call every torch op that writes memory is watched (a dispatch
                      mode), so an input used as scratch and restored before return fails too
  output_aliasing     an output may not share memory with an input or with the reference's output
  both_orders         reference-then-candidate and candidate-then-reference, fresh allocations each:
                      an output reused from a freed or still-live reference buffer fails
  reshuffled_inputs   the same shapes with permuted rows, new values in the old buffers (written
                      through an alias with its own version counter, so the tensors the candidate
                      sees keep their `_version`), and one changed row: caching by pointer, by
                      (pointer, version) or by a weak value key fails
  unseen_shapes       batches and widths the declared matrix never showed: shape specialisation fails
  precision_vs_oracle the float64 oracle, not the bf16 reference, is the target: an error more than
                      the policy's factor above the bf16 reference's (fp16/bf16 accumulation) fails
  determinism         the same inputs twice give bitwise-identical outputs
  work_after_return   the output snapshotted at return must equal the output after a device-wide
                      sync and a delay, and no thread may be left running: side-stream or
                      background-thread work fails

Imports torch and the validator's own modules only (runs on the GPU host).
"""

from __future__ import annotations

import gc
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .numerics import (Case, OutputMetrics, TolerancePolicy, compare_expert_ids, compare_output)
from .opinputs import OpDef, build_inputs, flatten_outputs, iter_tensors, map_tensors

F32, F64 = torch.float32, torch.float64
NAN_POISON = float("nan")
SENTINEL_POISON = -12288.0  # exactly representable in bf16, fp16 and fp32; never a plausible output
INT_POISONS = (-1, -7)
DEFAULT_DELAY_S = 0.02  # how long after return the output must stay unchanged

DEFENCE_NAMES = ("poisoned_outputs", "input_mutation", "output_aliasing", "both_orders",
                 "reshuffled_inputs", "unseen_shapes", "precision_vs_oracle", "determinism",
                 "work_after_return")


# ---------------------------------------------------------------------------------------------
# Subjects
# ---------------------------------------------------------------------------------------------


def _poison_fill(t: torch.Tensor, poison: float) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(poison)
    return t.fill_(INT_POISONS[0] if poison != poison else INT_POISONS[1])  # NaN -> first int poison


def poison_allocator(device, sizes: list[tuple[tuple[int, ...], torch.dtype]], poison: float) -> None:
    """Fill then free blocks of the given sizes, so the next allocations of those sizes hold poison
    rather than whatever the reference (or an earlier call) left there."""
    blocks = [_poison_fill(torch.empty(s, dtype=d, device=device), poison) for s, d in sizes]
    del blocks


class CallableSubject:
    """A Python callable with the reference op's signature (no `compute_dtype`)."""

    writes_into_outputs = False

    def __init__(self, fn: Callable, name: str, device):
        self.fn = fn
        self.name = name
        self.device = torch.device(device)
        self.expected_sizes: list[tuple[tuple[int, ...], torch.dtype]] = []

    def run(self, inputs: dict, poison: float) -> dict[str, torch.Tensor]:
        if self.expected_sizes:
            poison_allocator(self.device, self.expected_sizes, poison)
        return flatten_outputs(self.fn(**inputs))


class DestinationSubject:
    """A kernel that writes into outputs the harness allocates: `launch(inputs, outputs)`.

    `output_specs(inputs)` gives {name: (shape, dtype)}; each run allocates fresh outputs and fills
    them with the poison before the launch.
    """

    writes_into_outputs = True

    def __init__(self, launch: Callable[[dict, dict], None],
                 output_specs: Callable[[dict], dict[str, tuple[tuple[int, ...], torch.dtype]]],
                 name: str, device):
        self.launch = launch
        self.output_specs = output_specs
        self.name = name
        self.device = torch.device(device)

    def run(self, inputs: dict, poison: float) -> dict[str, torch.Tensor]:
        outs = {n: _poison_fill(torch.empty(s, dtype=d, device=self.device), poison)
                for n, (s, d) in self.output_specs(inputs).items()}
        self.launch(inputs, outs)
        return outs


# ---------------------------------------------------------------------------------------------
# The guarded call
# ---------------------------------------------------------------------------------------------


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN when the bits agree; -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        iv = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(iv), b.contiguous().view(iv))
    return torch.equal(a, b)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1 and a1 > a0 and b1 > b0


@dataclass
class Invocation:
    """One guarded call of a subject: its outputs and every defect seen around the call."""

    outputs: dict[str, torch.Tensor]
    error: str | None = None
    mutated_inputs: list[str] = field(default_factory=list)
    changed_after_return: list[str] = field(default_factory=list)
    extra_threads: int = 0
    aliased: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def defects(self) -> list[str]:
        d = []
        if self.error:
            d.append(f"raised: {self.error}")
        if self.mutated_inputs:
            d.append(f"input_mutation: modified input(s) {', '.join(self.mutated_inputs)}")
        if self.changed_after_return:
            d.append("work_after_return: output(s) "
                     f"{', '.join(self.changed_after_return)} changed after the call returned")
        if self.extra_threads > 0:
            d.append(f"work_after_return: left {self.extra_threads} thread(s) running")
        if self.aliased:
            d.append(f"output_aliasing: {'; '.join(self.aliased)}")
        return d


class InputWriteWatch(TorchDispatchMode):
    """Records every torch op, during the call, that writes into memory of an input (its schema
    marks the argument written: in-place ops, `out=`, copy_, set_, index_put_, ...), whatever the
    input holds at return. Writes that bypass torch (a raw pointer through ctypes, a cubin) are
    not seen here; for kernels the static audit's `store-to-readonly` covers them."""

    def __init__(self, inputs: dict):
        super().__init__()
        self.spans = [(p, *_span(t)) for p, t in iter_tensors(inputs) if t.numel()]
        self.hits: list[str] = []

    def _note(self, val) -> None:
        for t in (val if isinstance(val, (list, tuple)) else (val,)):
            if isinstance(t, torch.Tensor) and t.numel():
                try:
                    a0, a1 = _span(t)
                except RuntimeError:  # no storage (a functional or sparse tensor)
                    continue
                for p, b0, b1 in self.spans:
                    if a0 < b1 and b0 < a1 and p not in self.hits:
                        self.hits.append(p)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                self._note(args[i] if i < len(args) else kwargs.get(arg.name))
        return func(*args, **kwargs)


def refill_unversioned(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write `src`'s values into `dst`'s memory through an alias with its own version counter:
    `dst` keeps its identity, pointer and `_version`, only the bytes change. What an ordinary
    kernel writing by pointer does, and what a cache keyed by (identity or pointer, version)
    cannot see."""
    alias = torch.empty(0, dtype=dst.dtype, device=dst.device)
    alias.set_(dst.untyped_storage(), dst.storage_offset(), dst.size(), dst.stride())
    alias.copy_(src)


def invoke(subject, inputs: dict, *, poison: float = NAN_POISON, delay_s: float = DEFAULT_DELAY_S,
           forbidden: dict[str, torch.Tensor] | None = None) -> Invocation:
    """Call `subject` on `inputs` with the defences that apply to every single call.

    Before: inputs cloned, outputs (or the allocator) poisoned, live threads counted. At return:
    outputs snapshotted at once (on CUDA, on the current stream, without waiting for other
    streams). After: a device-wide sync and `delay_s`, then outputs compared bitwise with the
    snapshot, inputs with their clones, output storage against the inputs' and `forbidden`'s.
    The returned outputs are the snapshot at return. Exceptions become `error`, never propagate.
    """
    device = subject.device
    before = map_tensors(inputs, lambda t: t.clone())
    _sync(device)
    threads_before = threading.active_count()
    t0 = time.perf_counter()
    watch = InputWriteWatch(inputs)
    try:
        with watch:
            outs = subject.run(inputs, poison)
    except Exception as e:  # the candidate's failure is a verdict, not a crash of the judge
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return Invocation({}, error=tb, seconds=time.perf_counter() - t0)
    snapshot = {k: v.detach().clone() for k, v in outs.items()}
    seconds = time.perf_counter() - t0
    _sync(device)
    if delay_s > 0:
        time.sleep(delay_s)
    _sync(device)
    inv = Invocation(snapshot, seconds=seconds)
    inv.changed_after_return = [k for k in outs if not same_bits(outs[k].detach(), snapshot[k])]
    inv.extra_threads = max(0, threading.active_count() - threads_before)
    befores = dict(iter_tensors(before))
    inv.mutated_inputs = [p for p, t in iter_tensors(inputs) if not same_bits(t, befores[p])]
    inv.mutated_inputs += [f"{p} (written during the call, restored before return)"
                           for p in watch.hits if p not in inv.mutated_inputs]
    for oname, o in outs.items():
        for p, t in iter_tensors(inputs):
            if o.numel() and t.numel() and _overlaps(o, t):
                inv.aliased.append(f"output {oname!r} shares memory with input {p!r}")
        for p, t in (forbidden or {}).items():
            if o.numel() and t.numel() and _overlaps(o, t):
                inv.aliased.append(f"output {oname!r} shares memory with the reference's {p!r}")
    return inv


# ---------------------------------------------------------------------------------------------
# One case: references, the guarded call, the comparison
# ---------------------------------------------------------------------------------------------


@dataclass
class References:
    bf16: dict[str, torch.Tensor]
    oracle: dict[str, torch.Tensor]
    extra: dict  # op-specific (router: oracle biased scores)


# Reference ops that select experts (ids and weights out): the oracle pins the bf16 path's
# selection, and ids are compared up to near-ties of the scores.
SELECTING_OPS = ("router", "route_logits")


def _finite_selection(op: OpDef, inputs: dict, ref):
    """The selection rule for non-finite scores: vLLM's router treats a non-finite score as -inf
    (never chosen ahead of a finite one), and so does the check (numerics.compare_expert_ids).
    Where the bf16 path's scores hold a non-finite value, its selection is redone under that rule
    (ties still to the lower index) and pinned."""
    logits = ref.logits if op.name == "router" else inputs["logits"].to(F32)
    s = torch.sigmoid(logits.to(F32)) + inputs["bias"].to(F32)
    if bool(torch.isfinite(s).all()):
        return ref
    s = torch.where(torch.isfinite(s), s, torch.full_like(s, -float("inf")))
    ids = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, : inputs["top_k"]].to(torch.int32)
    return op.reference(**inputs, ids=ids, compute_dtype=F32)


def compute_references(op: OpDef, inputs: dict) -> References:
    """The bf16 path (float32 compute) and the float64 oracle of `op` on `inputs`.

    The oracle pins the bf16 path's expert selection (router) so a near-tie cannot flip it.
    """
    ref = op.reference(**inputs, compute_dtype=F32)
    extra = {}
    if op.name in SELECTING_OPS:
        ref = _finite_selection(op, inputs, ref)
        oracle = op.reference(**inputs, ids=ref.ids, compute_dtype=F64)
        logits = oracle.logits if op.name == "router" else inputs["logits"].to(F64)
        extra["scores"] = torch.sigmoid(logits) + inputs["bias"].to(F64)
    else:
        oracle = op.reference(**inputs, compute_dtype=F64)
    return References(flatten_outputs(ref), flatten_outputs(oracle), extra)


def compare_outputs(op: OpDef, cand: dict[str, torch.Tensor], refs: References,
                    policy: TolerancePolicy) -> list[OutputMetrics]:
    """Every reference output compared; a missing output is a failed metric."""
    metrics = []
    cand = dict(cand)
    if op.name in SELECTING_OPS and {"ids", "weights"} <= cand.keys():
        metrics.append(compare_expert_ids("ids", cand["ids"], refs.extra["scores"], refs.bf16["ids"], policy))
        # Weights are compared per expert id: sort each token's (id, weight) pairs by id; tokens
        # whose chosen set differs from the reference's (forgiven ties) drop out of the comparison.
        ci, co = cand["ids"].long().cpu().sort(dim=1)
        ri, ro = refs.bf16["ids"].long().cpu().sort(dim=1)
        same = (ci == ri).all(dim=1) if ci.shape == ri.shape else torch.zeros(ri.shape[0], dtype=torch.bool)
        cw = torch.gather(cand["weights"].cpu(), 1, co)[same] if ci.shape == ri.shape else cand["weights"]
        metrics.append(compare_output("weights", cw, torch.gather(refs.oracle["weights"].cpu(), 1, ro)[same],
                                      torch.gather(refs.bf16["weights"].cpu(), 1, ro)[same], policy))
        cand.pop("ids"), cand.pop("weights")
        names = [n for n in refs.bf16 if n not in ("ids", "weights")]
    else:
        names = list(refs.bf16)
    for n in names:
        if n not in cand:
            metrics.append(OutputMetrics(n, str(refs.bf16[n].dtype), refs.bf16[n].numel(), *([float("nan")] * 11),
                                         0, 0, False, [f"{n}: missing from the candidate's outputs "
                                                       f"(has: {', '.join(cand) or 'none'})"]))
            continue
        metrics.append(compare_output(n, cand[n], refs.oracle[n], refs.bf16[n], policy))
    return metrics


@dataclass
class CaseResult:
    case: Case
    passed: bool
    outputs: list[OutputMetrics]
    defects: list[str]
    order: str
    seconds: float

    @property
    def reasons(self) -> list[str]:
        return self.defects + [r for m in self.outputs for r in m.reasons]

    def to_dict(self) -> dict:
        return {**self.case.to_dict(), "passed": self.passed, "order": self.order,
                "seconds": round(self.seconds, 6), "reasons": self.reasons,
                "outputs": [m.to_dict() for m in self.outputs]}


def evaluate(subject, op: OpDef, case: Case, inputs: dict, policy: TolerancePolicy, *,
             order: str = "reference_first", poison: float = NAN_POISON,
             delay_s: float = DEFAULT_DELAY_S) -> tuple[CaseResult, Invocation]:
    """Judge one call of `subject` on `inputs` against its references, in the given order.

    reference_first: references computed (and kept alive) before the call; candidate_first: the
    candidate runs first on `inputs`, the references afterwards on a clone taken before the call.
    """
    refs = None
    if order == "reference_first":
        refs = compute_references(op, inputs)
        forbidden = dict(refs.bf16)
    else:
        clean = map_tensors(inputs, lambda t: t.clone())
        forbidden = None
    if isinstance(subject, CallableSubject):
        # Outputs the size of the reference's are what a stale buffer would be mistaken for.
        if refs is not None:
            subject.expected_sizes = [(tuple(t.shape), t.dtype) for t in refs.bf16.values()]
    inv = invoke(subject, inputs, poison=poison, delay_s=delay_s, forbidden=forbidden)
    if refs is None:
        refs = compute_references(op, clean)
    if inv.error:
        metrics = []
    else:
        metrics = compare_outputs(op, inv.outputs, refs, policy)
    defects = inv.defects()
    passed = not defects and bool(metrics) and all(m.passed for m in metrics)
    return CaseResult(case, passed, metrics, defects, order, inv.seconds), inv


# ---------------------------------------------------------------------------------------------
# The defences that need more than one call
# ---------------------------------------------------------------------------------------------


@dataclass
class DefenceResult:
    name: str
    passed: bool
    applicable: bool
    detail: str
    cases: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _fails(results: list[CaseResult]) -> list[str]:
    return [f"{r.case.case_id}: {'; '.join(r.reasons[:2]) or 'failed'}" for r in results if not r.passed]


def _summary(name: str, results: list[CaseResult], what: str, ok_detail: str) -> DefenceResult:
    bad = _fails(results)
    ids = [r.case.case_id for r in results]
    if bad:
        return DefenceResult(name, False, True, f"{what}: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""), ids)
    return DefenceResult(name, True, True, ok_detail, ids)


def ran(r: CaseResult) -> bool:
    """The candidate's call returned (a call that raised measured nothing)."""
    return not any(d.startswith("raised:") for d in r.defects)


def not_measured(name: str, results: list[CaseResult]) -> DefenceResult:
    """A defence whose measurement never happened: it fails and says so."""
    return DefenceResult(name, False, True,
                         f"not measured: the candidate raised on every one of {len(results)} calls "
                         f"(e.g. {results[0].defects[0] if results and results[0].defects else 'no calls'})",
                         [r.case.case_id for r in results])


def defence_from_matrix(name: str, results: list[CaseResult], prefix: str, ok_detail: str) -> DefenceResult:
    """A per-call defence summarised over the whole matrix: fails if any case shows `prefix`, or
    if no call returned (nothing was measured). `{n}` in `ok_detail` counts the calls that ran."""
    hits = [f"{r.case.case_id}: {d}" for r in results for d in r.reasons if d.startswith(prefix)]
    ids = [r.case.case_id for r in results]
    if hits:
        return DefenceResult(name, False, True, hits[0] + (f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""), ids)
    done = [r for r in results if ran(r)]
    if not done:
        return not_measured(name, results)
    extra = f" ({len(results) - len(done)} call(s) raised, not measured)" if len(done) < len(results) else ""
    return DefenceResult(name, True, True, ok_detail.format(n=len(done)) + extra, ids)


def check_coverage(subject, op: OpDef, case: Case, inputs: dict, policy: TolerancePolicy) -> DefenceResult:
    """Two runs with different poisons (NaN, then a finite sentinel); an element left equal to the
    poison in both was never written. Then the NaN-poisoned run must pass numerically."""
    runs = []
    for poison in (NAN_POISON, SENTINEL_POISON):
        res, inv = evaluate(subject, op, case, map_tensors(inputs, lambda t: t.clone()), policy, poison=poison)
        runs.append((res, inv, poison))
    unwritten = []
    (r1, i1, _), (r2, i2, p2) = runs
    for n in i1.outputs.keys() & i2.outputs.keys():
        a, b = i1.outputs[n], i2.outputs[n]
        if a.dtype.is_floating_point:
            miss = torch.isnan(a) & (b == p2)
        else:
            miss = (a == INT_POISONS[0]) & (b == INT_POISONS[1])
        k = int(miss.sum())
        if k:
            unwritten.append(f"{n}: {k} of {a.numel()} elements never written")
    if unwritten:
        return DefenceResult("poisoned_outputs", False, True, "; ".join(unwritten), [case.case_id])
    if not (r1.passed and r2.passed):
        bad = r1 if not r1.passed else r2
        return DefenceResult("poisoned_outputs", False, True,
                             f"with poisoned outputs: {'; '.join(bad.reasons[:2])}", [case.case_id])
    how = ("outputs poisoned with NaN and with a sentinel: every element written"
           if subject.writes_into_outputs else
           "allocator poisoned before each call; outputs free of poison and NaN")
    return DefenceResult("poisoned_outputs", True, True, how, [case.case_id])


def check_both_orders(subject, op: OpDef, case: Case, base_cfg, policy: TolerancePolicy) -> DefenceResult:
    """Reference first (kept alive) and candidate first on fresh inputs; both must pass."""
    results = []
    for order, seed in (("reference_first", case.seed), ("candidate_first", case.seed + 500)):
        # Candidate first gets values never seen before, and nothing from the earlier call is
        # alive (the Invocation is dropped): no correct result exists anywhere to be picked up.
        gc.collect()
        c = Case(case.op, case.problem, case.batch, seed, case.distribution, case.routing, case.gpu)
        inputs = build_inputs(op, c, base_cfg, subject.device)
        results.append(evaluate(subject, op, c, inputs, policy, order=order)[0])
        del inputs
    bad = [f"{r.order}: {'; '.join(r.reasons[:2])}" for r in results if not r.passed]
    if bad:
        return DefenceResult("both_orders", False, True, " | ".join(bad), [case.case_id])
    return DefenceResult("both_orders", True, True,
                         "passes with the reference run before and after it, fresh allocations each",
                         [case.case_id])


def _permute_tokens(op: OpDef, inputs: dict, perm: torch.Tensor) -> dict:
    out = map_tensors(inputs, lambda t: t.clone())
    for a in op.token_args:
        out[a] = out[a][perm.to(out[a].device)].contiguous()
    return out


def check_reshuffled(subject, op: OpDef, case: Case, base_cfg, policy: TolerancePolicy) -> DefenceResult:
    """Same shapes, other values, several ways: each call must match its own oracle.

    1 rows permuted (fresh tensors): a cache keyed by shape or a permutation-invariant summary
    2 new values written into the previous call's buffers: a cache keyed by pointer
    3 the previous values with only the last row changed: a cache keyed by a sample of the values
    """
    dev = subject.device
    a = build_inputs(op, case, base_cfg, dev)
    steps = [("original", a)]
    if case.batch > 1:
        perm = torch.roll(torch.arange(case.batch), 1)
        steps.append(("rows permuted", _permute_tokens(op, a, perm)))
    other = build_inputs(op, Case(case.op, case.problem, case.batch, case.seed + 1000, case.distribution,
                                  case.routing, case.gpu), base_cfg, dev)
    steps.append(("new values in the same buffers", None))
    last = build_inputs(op, Case(case.op, case.problem, case.batch, case.seed + 2000, case.distribution,
                                 case.routing, case.gpu), base_cfg, dev)
    one_row = map_tensors(a, lambda t: t.clone())
    for name in op.token_args:
        if one_row[name].dtype.is_floating_point:
            one_row[name][-1] = last[name][-1]
    steps.append(("last row changed", one_row))
    results = []
    for label, inputs in steps:
        if inputs is None:  # the first call's tensors, refilled: same objects, pointers, versions
            for (p, dst), (_, src) in zip(iter_tensors(a), iter_tensors(other)):
                refill_unversioned(dst, src)
            inputs = a
        res = evaluate(subject, op, case, inputs, policy)[0]
        res.order = label
        results.append(res)
    bad = [f"{r.order}: {'; '.join(r.reasons[:2])}" for r in results if not r.passed]
    if bad:
        return DefenceResult("reshuffled_inputs", False, True, " | ".join(bad), [case.case_id])
    return DefenceResult("reshuffled_inputs", True, True,
                         f"{len(results)} calls with reshuffled inputs each matched their own oracle",
                         [case.case_id])


def check_determinism(subject, op: OpDef, case: Case, base_cfg, policy: TolerancePolicy) -> DefenceResult:
    """Two calls on identical inputs (separate allocations) must agree bit for bit."""
    inputs = build_inputs(op, case, base_cfg, subject.device)
    i1 = invoke(subject, map_tensors(inputs, lambda t: t.clone()))
    i2 = invoke(subject, map_tensors(inputs, lambda t: t.clone()))
    if i1.error or i2.error:
        return DefenceResult("determinism", False, True, f"raised: {i1.error or i2.error}", [case.case_id])
    diff = [n for n in i1.outputs if n not in i2.outputs or not same_bits(i1.outputs[n], i2.outputs[n])]
    if diff:
        return DefenceResult("determinism", False, True,
                             f"two runs on identical inputs differ in {', '.join(diff)}", [case.case_id])
    return DefenceResult("determinism", True, True, "two runs on identical inputs are bitwise identical",
                         [case.case_id])


def check_unseen(subject, op: OpDef, cases: list[Case], base_cfg, policy: TolerancePolicy) -> tuple[DefenceResult, list[CaseResult]]:
    """The candidate on shapes outside the declared matrix must pass like any other case."""
    results = []
    for c in cases:
        inputs = build_inputs(op, c, base_cfg, subject.device)
        results.append(evaluate(subject, op, c, inputs, policy)[0])
    d = _summary("unseen_shapes", results, "fails on a shape it was not shown",
                 f"{len(results)} shapes outside the declared matrix pass")
    return d, results


def not_applicable(name: str, why: str) -> DefenceResult:
    return DefenceResult(name, True, False, why)
