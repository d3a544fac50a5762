"""Numerics: compare a candidate's outputs with the float64 oracle, the bf16 reference as yardstick.

For every output the candidate returns, `compare_output` measures max abs error, relative Frobenius
error against the float64 oracle, the plain bf16 reference's error against the same oracle, their
ratio, ULP statistics (in the output dtype, against the oracle rounded to that dtype), mismatch
fraction and NaN/Inf counts, and decides pass/fail under the tolerance policy of
`validation/tolerances.toml` (the one place tolerances are written).

The case matrix (`case_matrix`) spans batch sizes, seeds, value distributions, routing patterns for
MoE ops, boundary problems and the GPU configuration the run happens on (recorded even while only
one configuration exists).

Imports only torch (and tomllib): this module runs on the GPU host.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

POLICY_PATH = Path(__file__).with_name("tolerances.toml")

DISTRIBUTIONS = ("normal", "uniform", "large", "near_zero", "outliers")
# Distributions `fasttrack check` adds (validation.check): magnitudes past fp16's 65504 (an fp16
# intermediate overflows; bf16 and fp32 hold them), and values on a coarse grid so that router
# scores tie exactly (the reference breaks exact ties toward the lower expert index).
EXTRA_DISTRIBUTIONS = ("beyond_fp16", "ties", "nonfinite")  # nonfinite: router logits with NaN/±inf
ROUTINGS = ("uniform", "hot", "same", "distinct")
DEFAULT_BATCHES = (1, 3, 8, 64)  # 3: an odd batch that fills no power-of-two tile
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # every batch the decode block serves
DEFAULT_SEEDS = (0, 1)


class PolicyError(ValueError):
    """The tolerance policy file is malformed or lacks the dtype asked for."""


# ---------------------------------------------------------------------------------------------
# Tolerance policy
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DtypePolicy:
    dtype: str
    max_error_ratio: float
    rel_fro_floor: float
    mismatch_rtol: float
    mismatch_atol_rms: float
    max_mismatch_fraction: float


@dataclass(frozen=True)
class TolerancePolicy:
    dtypes: dict[str, DtypePolicy]
    tie_tolerance: float
    source: str  # repo-relative path the policy came from

    def for_dtype(self, dtype: torch.dtype | str) -> DtypePolicy:
        name = str(dtype).removeprefix("torch.")
        try:
            return self.dtypes[name]
        except KeyError:
            raise PolicyError(
                f"no tolerance policy for output dtype {name!r} (have: {', '.join(sorted(self.dtypes))})"
            ) from None

    def to_dict(self) -> dict:
        return {"source": self.source, "tie_tolerance": self.tie_tolerance,
                "dtypes": {k: asdict(v) for k, v in self.dtypes.items()}}


def load_policy(path: Path | None = None) -> TolerancePolicy:
    """The tolerance policy from `validation/tolerances.toml` (or `path`); PolicyError if malformed."""
    p = Path(path) if path else POLICY_PATH
    try:
        raw = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise PolicyError(f"cannot read tolerance policy {p.name}: {e}") from None
    keys = ("max_error_ratio", "rel_fro_floor", "mismatch_rtol", "mismatch_atol_rms",
            "max_mismatch_fraction")
    dtypes = {}
    for name, d in raw.get("dtype", {}).items():
        missing = [k for k in keys if not isinstance(d.get(k), (int, float))]
        if missing:
            raise PolicyError(f"{p.name}: dtype.{name} lacks numeric {', '.join(missing)}")
        if d["max_error_ratio"] < 1.0:
            raise PolicyError(f"{p.name}: dtype.{name}.max_error_ratio below 1 would fail the reference itself")
        dtypes[name] = DtypePolicy(name, *(float(d[k]) for k in keys))
    if not dtypes:
        raise PolicyError(f"{p.name}: no [dtype.*] tables")
    tie = raw.get("integer", {}).get("tie_tolerance")
    if not isinstance(tie, (int, float)):
        raise PolicyError(f"{p.name}: [integer] tie_tolerance missing")
    source = p.name if path is None else str(p)
    if path is None:
        source = "validation/" + p.name
    return TolerancePolicy(dtypes, float(tie), source)


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that adjacent representable values differ by 1 (sign-magnitude fixed)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        b = t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
        sign, mag = b & 0x8000, b & 0x7FFF
    elif t.dtype == torch.float32:
        b = t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        sign, mag = b & 0x80000000, b & 0x7FFFFFFF
    else:
        raise PolicyError(f"ULP distance is defined for bf16/fp16/fp32, not {t.dtype}")
    return torch.where(sign != 0, -mag, mag)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of `a`'s dtype (b is rounded to it first)."""
    return (_ordered_bits(a) - _ordered_bits(b.to(a.dtype))).abs()


def rel_fro(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_F / ||ref||_F in float64 (||x - ref|| itself when ref is all zero)."""
    d = (x.double() - ref.double()).norm().item()
    n = ref.double().norm().item()
    return d / n if n > 0 else d


@dataclass
class OutputMetrics:
    """One output of one case: the candidate measured against the oracle, next to the bf16 reference."""

    name: str
    dtype: str
    numel: int
    max_abs: float
    rel_fro: float
    ref_rel_fro: float
    ratio: float  # rel_fro / ref_rel_fro (inf when the reference is exact and the candidate is not)
    allowed_rel_fro: float
    ulp_max: float
    ulp_mean: float
    ulp_p99: float
    mismatch_fraction: float
    ref_mismatch_fraction: float
    allowed_mismatch_fraction: float
    nan: int
    inf: int
    passed: bool
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():  # JSON has no inf/nan: write them as strings
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = str(v)
        return d


def _mismatch_fraction(x: torch.Tensor, oracle: torch.Tensor, pol: DtypePolicy) -> float:
    o = oracle.double()
    rms = o.pow(2).mean().sqrt().item() if o.numel() else 0.0
    err = (x.double() - o).abs()
    bad = (err > pol.mismatch_rtol * o.abs() + pol.mismatch_atol_rms * rms) | ~torch.isfinite(x.double())
    return bad.double().mean().item() if bad.numel() else 0.0


def compare_output(name: str, cand: torch.Tensor, oracle: torch.Tensor, ref: torch.Tensor,
                   policy: TolerancePolicy) -> OutputMetrics:
    """Measure `cand` against the float64 `oracle`, with the bf16-path `ref` as yardstick.

    Fails (with reasons) on a shape or dtype different from the reference's, NaN/Inf where the
    oracle is finite, error beyond max(max_error_ratio * ref error, floor), or a mismatch fraction
    beyond the policy's. Never raises on bad candidate values.
    """
    reasons: list[str] = []
    pol = policy.for_dtype(ref.dtype)
    if tuple(cand.shape) != tuple(ref.shape):
        return OutputMetrics(name, str(ref.dtype).removeprefix("torch."), ref.numel(), math.inf,
                             math.inf, math.nan, math.inf, math.nan, math.inf, math.inf, math.inf,
                             1.0, 0.0, 0.0, 0, 0, False,
                             [f"{name}: shape {tuple(cand.shape)} != reference {tuple(ref.shape)}"])
    if cand.dtype != ref.dtype:
        reasons.append(f"{name}: dtype {cand.dtype} != reference {ref.dtype}")
    c = cand.detach().to("cpu")
    o = oracle.detach().to("cpu").double()
    r = ref.detach().to("cpu")
    cd = c.double()
    finite_oracle = torch.isfinite(o)
    nan = int((torch.isnan(cd) & finite_oracle).sum())
    inf = int((torch.isinf(cd) & finite_oracle).sum())
    if nan or inf:
        reasons.append(f"{name}: {nan} NaN and {inf} Inf where the oracle is finite")
    diff = (cd - o).abs()
    max_abs = float(diff.max().item()) if diff.numel() else 0.0
    err = rel_fro(cd, o) if not (nan or inf) else math.inf
    ref_err = rel_fro(r, o)
    allowed = max(pol.max_error_ratio * ref_err, pol.rel_fro_floor)
    ratio = err / ref_err if ref_err > 0 else (0.0 if err == 0 else math.inf)
    if not err <= allowed:
        reasons.append(f"{name}: relative error {err:.3g} exceeds {allowed:.3g} "
                       f"(bf16 reference {ref_err:.3g} x{pol.max_error_ratio:g}, floor {pol.rel_fro_floor:.3g})")
    mism = _mismatch_fraction(cd, o, pol)
    ref_mism = _mismatch_fraction(r.double(), o, pol)
    allowed_mism = max(pol.max_mismatch_fraction, pol.max_error_ratio * ref_mism)
    if mism > allowed_mism:
        reasons.append(f"{name}: {mism:.3%} of elements mismatch (allowed {allowed_mism:.3%})")
    ulp_dtype = ref.dtype if ref.dtype in (torch.bfloat16, torch.float16, torch.float32) else None
    if ulp_dtype is not None and c.numel() and not (nan or inf):
        u = ulp_distance(c.to(ulp_dtype), o).double()
        ulp_max, ulp_mean = u.max().item(), u.mean().item()
        ulp_p99 = torch.quantile(u.flatten()[: 1 << 24], 0.99).item()
    else:
        ulp_max = ulp_mean = ulp_p99 = math.nan
    return OutputMetrics(
        name=name, dtype=str(ref.dtype).removeprefix("torch."), numel=ref.numel(), max_abs=max_abs,
        rel_fro=err, ref_rel_fro=ref_err, ratio=ratio, allowed_rel_fro=allowed, ulp_max=ulp_max,
        ulp_mean=ulp_mean, ulp_p99=ulp_p99, mismatch_fraction=mism, ref_mismatch_fraction=ref_mism,
        allowed_mismatch_fraction=allowed_mism, nan=nan, inf=inf, passed=not reasons, reasons=reasons,
    )


def compare_expert_ids(name: str, cand_ids: torch.Tensor, oracle_scores: torch.Tensor,
                       ref_ids: torch.Tensor, policy: TolerancePolicy) -> OutputMetrics:
    """Expert ids [T, k]: each token's chosen set must be a valid top-k of the oracle's biased
    scores, up to near-ties within `policy.tie_tolerance` (order within a token does not
    matter). Exact ties are not forgiven: of experts with bitwise-equal scores the lower index
    wins (the reference's rule), so choosing a higher index over a tied lower one fails.
    Non-finite scores count as -inf (vLLM's rule): such an expert is chosen only when fewer than
    k finite ones exist."""
    reasons = []
    if tuple(cand_ids.shape) != tuple(ref_ids.shape):
        reasons.append(f"{name}: shape {tuple(cand_ids.shape)} != reference {tuple(ref_ids.shape)}")
        bad_frac = 1.0
    else:
        ids = cand_ids.detach().to("cpu").long()
        s = oracle_scores.detach().to("cpu").double()
        s = torch.where(torch.isfinite(s), s, torch.full_like(s, -math.inf))
        T, k = ids.shape
        in_range = (ids >= 0) & (ids < s.shape[1])
        dup = torch.zeros(T, dtype=torch.bool)
        if k > 1:
            srt = ids.sort(dim=1).values
            dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
        kth = s.sort(dim=1, descending=True).values[:, k - 1: k]
        chosen = torch.gather(s, 1, ids.clamp(0, s.shape[1] - 1))
        ok = in_range.all(dim=1) & ~dup & (chosen >= kth - policy.tie_tolerance).all(dim=1)
        # an exact tie broken the other way: an expert not chosen with a lower index and the
        # same score as a chosen one
        picked = torch.zeros_like(s, dtype=torch.bool).scatter_(1, ids.clamp(0, s.shape[1] - 1), True)
        idx = torch.arange(s.shape[1])
        same = (s.unsqueeze(2) == s.unsqueeze(1))  # [T, i, j]: score i == score j
        lower = idx.view(1, -1, 1) < idx.view(1, 1, -1)  # i < j
        flipped = (same & lower & ~picked.unsqueeze(2) & picked.unsqueeze(1)).any(dim=(1, 2))
        ties_bad = int((ok & flipped).sum())
        ok = ok & ~flipped
        bad_frac = 1.0 - ok.double().mean().item()
        if bad_frac > 0:
            reasons.append(f"{name}: {int((~ok).sum())} of {T} tokens chose experts outside the top-{k}"
                           + (f" ({ties_bad} broke an exact tie toward the higher index)" if ties_bad else ""))
    return OutputMetrics(name, "int32", ref_ids.numel(), math.nan, math.nan, math.nan, math.nan,
                         math.nan, math.nan, math.nan, math.nan, bad_frac, 0.0, 0.0, 0, 0,
                         not reasons, reasons)


# ---------------------------------------------------------------------------------------------
# The case matrix
# ---------------------------------------------------------------------------------------------


def gpu_configuration(device: str | torch.device = "cpu") -> dict:
    """The GPU-configuration axis of a case: model, count, SMs available (cpu -> zeros)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {"gpu": "cpu", "gpu_count": 0, "sm_count": 0}
    props = torch.cuda.get_device_properties(dev)
    return {"gpu": props.name, "gpu_count": torch.cuda.device_count(),
            "sm_count": props.multi_processor_count}


@dataclass(frozen=True)
class Case:
    """One point of the matrix: an op on a problem, a batch, a seed, a value distribution, a
    routing pattern (MoE ops; None otherwise) and a GPU configuration."""

    op: str
    problem: dict
    batch: int
    seed: int
    distribution: str
    routing: str | None
    gpu: dict
    tags: tuple[str, ...] = ()

    @property
    def case_id(self) -> str:
        prob = ",".join(f"{k}={v}" for k, v in sorted(self.problem.items()))
        parts = [self.op, prob, f"b{self.batch}", f"s{self.seed}", self.distribution]
        if self.routing:
            parts.append(f"route={self.routing}")
        return "/".join(p for p in parts if p)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["case_id"] = self.case_id
        d["tags"] = list(self.tags)
        return d


def case_matrix(op: str, problems: list[dict], *, moe: bool, gpu: dict,
                batches=DEFAULT_BATCHES, seeds=DEFAULT_SEEDS, distributions=DISTRIBUTIONS,
                routings=ROUTINGS, boundary: list[dict] | None = None) -> list[Case]:
    """The declared matrix for one op.

    Full product of problems x batches x seeds x distributions (routing "uniform" for MoE ops),
    plus for MoE ops every routing pattern at every batch (normal values, seed 0), plus each
    boundary problem at the smallest and largest batch. A problem dict may pin `batch` (kernel
    variants do): then only that batch is used for it.
    """
    cases: list[Case] = []
    base_routing = "uniform" if moe else None

    def batches_for(p):
        return (p["batch"],) if "batch" in p else tuple(batches)

    def strip(p):
        return {k: v for k, v in p.items() if k != "batch"}

    for p in problems:
        for b, s, d in itertools.product(batches_for(p), seeds, distributions):
            cases.append(Case(op, strip(p), b, s, d, base_routing, gpu))
        if moe:
            for b, r in itertools.product(batches_for(p), routings):
                if r != base_routing:
                    cases.append(Case(op, strip(p), b, seeds[0], "normal", r, gpu, ("routing",)))
    for p in boundary or []:
        bs = batches_for(p)
        for b in sorted({min(bs), max(bs)}):
            cases.append(Case(op, strip(p), b, seeds[0], "normal", base_routing, gpu, ("boundary",)))
    return cases


def fill_distribution(shape, distribution: str, gen: torch.Generator, device,
                      dtype=torch.bfloat16) -> torch.Tensor:
    """Activation values of a named distribution (never all zeros: zeros hide unwritten outputs).

    normal N(0,1); uniform U(-sqrt3, sqrt3) (unit variance); large N(0,1)*1024; near_zero
    N(0,1)*1e-3 (below an RMSNorm eps); outliers N(0,1) with 0.5% of elements x64.
    """
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if distribution == "uniform":
        t = (torch.rand(shape, generator=gen, device=device) * 2 - 1) * math.sqrt(3.0)
    elif distribution == "large":
        t = t * 1024.0
    elif distribution == "near_zero":
        t = t * 1e-3
    elif distribution == "outliers":
        mask = torch.rand(shape, generator=gen, device=device) < 0.005
        t = torch.where(mask, t * 64.0, t)
    elif distribution == "beyond_fp16":
        # |x| in [2^16, 2^19] for a quarter of the elements, N(0,1) x 4096 elsewhere: past
        # 65504, the largest fp16, yet a small fraction of bf16's and fp32's range
        mag = torch.exp2(16 + 3 * torch.rand(shape, generator=gen, device=device))
        big = torch.rand(shape, generator=gen, device=device) < 0.25
        t = torch.where(big, torch.sign(t) * mag, t * 4096.0)
    elif distribution == "nonfinite":
        u = torch.rand(shape, generator=gen, device=device)
        t = torch.where(u < 0.03, torch.full_like(t, math.nan), t)
        t = torch.where((u >= 0.03) & (u < 0.04), torch.full_like(t, math.inf), t)
        t = torch.where((u >= 0.04) & (u < 0.05), torch.full_like(t, -math.inf), t)
    elif distribution == "ties":
        t = torch.round(t.clamp(-2, 2) * 2) / 2  # {-2, -1.5, ..., 2}: many exact ties per row
    elif distribution != "normal":
        raise ValueError(f"unknown distribution {distribution!r}; "
                         f"known: {', '.join(DISTRIBUTIONS + EXTRA_DISTRIBUTIONS)}")
    return t.to(dtype)


def routing_ids(batch: int, n_experts: int, top_k: int, pattern: str, gen: torch.Generator,
                device) -> torch.Tensor:
    """Expert ids [batch, top_k] (int32, distinct per token) for a routing pattern.

    uniform: random; hot: half of each token's slots on the same few experts; same: every token
    picks the same experts; distinct: tokens spread over as many different experts as possible.
    """
    if pattern == "uniform":
        ids = torch.stack([torch.randperm(n_experts, generator=gen, device="cpu")[:top_k]
                           for _ in range(batch)])
    elif pattern == "hot":
        hot = max(1, top_k // 2)
        rows = []
        for _ in range(batch):
            rest = torch.randperm(n_experts - hot, generator=gen, device="cpu")[: top_k - hot] + hot
            rows.append(torch.cat([torch.arange(hot), rest]))
        ids = torch.stack(rows)
    elif pattern == "same":
        ids = torch.arange(top_k).repeat(batch, 1)
    elif pattern == "distinct":
        ids = (torch.arange(batch).unsqueeze(1) * top_k + torch.arange(top_k)) % n_experts
    else:
        raise ValueError(f"unknown routing pattern {pattern!r}; known: {', '.join(ROUTINGS)}")
    return ids.to(torch.int32).to(device)
