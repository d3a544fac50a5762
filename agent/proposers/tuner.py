"""The tuner: successive halving over a kernel's declared tunables, on measured time.

Every combination of the manifest's tunable choices is a candidate. Round 0 times all candidates on
a few validation shapes; each round keeps the best 1/eta (by the geometric mean of their time
relative to the current defaults on the same shapes) and times the survivors on eta times as many
shapes; the last round uses every shape. The winner is proposed only if it beats the defaults by at
least `min_gain_pct` (geometric mean) and is not slower than them beyond the measured noise on any
shape; otherwise the run ends with "defaults already best" and the whole search as its evidence.

Timings come from a measurer:
  * `FileMeasurer`: a JSON file written on a GPU host by `scripts/tune_measure.py measure` (so the
    search can run here, without a GPU); its kernel sources must hash to the worktree's.
  * `LocalGpuMeasurer`: builds each candidate here and runs `scripts/tune_measure.py` on the local
    GPU, only for the candidates and shapes each round needs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from agent.rfc import Proposal
from agent.session import RunStopped, Session
from agent.tools import Toolbox
from agent.trajectory import scrubbed_environment

MEASUREMENTS_SCHEMA = "fasttrack.tune-measurements/1"
PLAN_SCHEMA = "fasttrack.tune-plan/1"
REGRESSION_FLOOR = 0.02  # a shape counts as slower beyond max(2%, the measured noise)


REQUEST_SCHEMA = "fasttrack.tune-request/1"


class MeasurementError(ValueError):
    """A measurements file that cannot be used for this kernel and revision."""


class NeedMeasurements(Exception):
    """A round needs timings the measurements do not hold: `configs` x `shapes` (round `round`)."""

    def __init__(self, round_: int, configs: list[dict], shapes: list[dict]):
        super().__init__(f"round {round_} needs {len(configs)} settings x {len(shapes)} shapes not yet measured")
        self.round = round_
        self.configs = configs
        self.shapes = shapes


def schedule(n_configs: int, n_shapes: int, eta: int) -> list[int]:
    """How many shapes each successive-halving round times (the last round: all)."""
    n_rounds = max(1, math.ceil(math.log(n_configs, eta))) if n_configs > 1 else 1
    return [n_shapes if r == n_rounds - 1 else max(1, math.ceil(n_shapes / eta ** (n_rounds - 1 - r)))
            for r in range(n_rounds)]


def config_key(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def shape_key(shape: dict) -> str:
    return json.dumps(shape, sort_keys=True, separators=(",", ":"))


def tunable_grid(spec, stage: str | None = None) -> list[dict]:
    """Every combination of the kernel's declared tunable choices (defaults first), less the
    explorer-only ones (kernels/manifest.py `Tunable.explore_only`). With `stage` (a stage of a
    persistent kernel, `[[kernels.K.stages]]`): only that stage's own tunables vary, every
    other tunable stays at its default, so the winner changes that one stage."""
    default = spec.tunable_defaults()
    varied = None if stage is None else set(stage_tunables(spec, stage))
    axes = [(t.name, t.tuned_choices if varied is None or t.name in varied else (t.default,)) for t in spec.tunables]
    grid = [dict(zip([n for n, _ in axes], combo)) for combo in itertools.product(*(c for _, c in axes))]
    return sorted(grid, key=lambda c: c != default)


def stage_tunables(spec, stage: str) -> tuple[str, ...]:
    """The tunables stage `stage` of `spec` declares as its own; a ValueError names a stage the
    kernel lacks or one with no tunables of its own."""
    from kernels.manifest import ManifestError

    try:
        names = spec.stage(stage).tunables
    except ManifestError as e:
        raise ValueError(str(e)) from None
    if not names:
        owned = [st.name for st in spec.stages if st.tunables]
        raise ValueError(f"stage {stage!r} of {spec.name!r} declares no tunables of its own"
                         + (f" (stages with tunables: {', '.join(owned)})" if owned else ""))
    return names


def sources_sha256(root: Path, sources) -> dict[str, str]:
    return {s: hashlib.sha256((Path(root) / s).read_bytes()).hexdigest() for s in sources}


@dataclass
class Timing:
    median_us: float
    noise: float  # relative half-spread of the samples (p90 - p10) / (2 * median)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.median_us > 0 and math.isfinite(self.median_us)


def _timing_from_result(r: dict) -> Timing:
    if r.get("error"):
        return Timing(float("nan"), 0.0, str(r["error"]))
    if r.get("ok") is False:
        return Timing(float("nan"), 0.0, r.get("reason") or "measurement marked not ok")
    med = float(r["median_us"])
    p10, p90 = r.get("p10_us"), r.get("p90_us")
    noise = (float(p90) - float(p10)) / (2 * med) if p10 is not None and p90 is not None and med > 0 else 0.0
    return Timing(med, max(noise, 0.0))


def parse_measurements(data: dict, kernel: str, expected_sources: dict[str, str] | None) -> dict:
    """{(config_key, shape_key): Timing} from a measurements document; MeasurementError if it is
    for another kernel, another schema, or kernel sources other than `expected_sources`."""
    if not isinstance(data, dict) or data.get("schema") != MEASUREMENTS_SCHEMA:
        raise MeasurementError(f"not a tune measurements file (schema {MEASUREMENTS_SCHEMA!r} expected)")
    if data.get("kernel") != kernel:
        raise MeasurementError(f"measurements are for kernel {data.get('kernel')!r}, not {kernel!r}")
    if expected_sources is not None:
        got = data.get("sources_sha256") or {}
        differ = sorted(s for s in expected_sources if got.get(s) != expected_sources[s])
        if differ:
            raise MeasurementError(
                "measurements were taken on different kernel sources than this revision's "
                f"({', '.join(differ)}); prepare and measure again at this revision")
    table = {}
    for r in data.get("results") or []:
        try:
            table[(config_key(r["tunables"]), shape_key(r["variant"]))] = _timing_from_result(r)
        except (KeyError, TypeError, ValueError) as e:
            raise MeasurementError(f"malformed result entry ({e}): {str(r)[:200]}") from None
    if not table:
        raise MeasurementError("the measurements file holds no results")
    return table


def measured_binaries(data: dict) -> list[dict]:
    """{tunables, variant, cubin_sha256} of every timed result that names its cubin."""
    return [{"tunables": r.get("tunables"), "variant": r.get("variant"), "cubin_sha256": r["cubin_sha256"]}
            for r in data.get("results") or [] if isinstance(r, dict) and r.get("cubin_sha256")]


class FileMeasurer:
    """Timings recorded on a GPU host (one or more files, later ones win); measuring is a lookup.
    A round asking for timings no file holds raises NeedMeasurements."""

    source = "file"

    def __init__(self, paths, kernel: str, expected_sources: dict[str, str] | None):
        self.table: dict = {}
        self.meta: list[dict] = []
        self.environment: dict = {}
        self.binaries: list[dict] = []  # what was timed, by cubin hash (the replay binds to it)
        self._round = -1
        for path in ([paths] if isinstance(paths, (str, Path)) else list(paths)):
            try:
                data = json.loads(Path(path).read_text())
            except OSError as e:
                raise MeasurementError(f"cannot read measurements {path}: {e.strerror}") from None
            except json.JSONDecodeError as e:
                raise MeasurementError(f"{Path(path).name}: not valid JSON ({e.msg})") from None
            try:
                self.table.update(parse_measurements(data, kernel, expected_sources))
            except MeasurementError as e:
                raise MeasurementError(f"{Path(path).name}: {e}") from None
            self.binaries += measured_binaries(data)
            env = data.get("environment") or {}
            if self.environment and env.get("gpu") != self.environment.get("gpu"):
                raise MeasurementError(f"{Path(path).name}: measured on {env.get('gpu')!r}, the others on "
                                       f"{self.environment.get('gpu')!r}; timings of different GPUs do not mix")
            self.environment = env
            self.meta.append({"file": Path(path).name, **{k: data.get(k) for k in ("created", "command", "commit",
                                                                                   "environment")}})

    def measure(self, configs: list[dict], shapes: list[dict]) -> dict:
        self._round += 1
        missing_c = [c for c in configs if any((config_key(c), shape_key(s)) not in self.table for s in shapes)]
        if missing_c:
            missing_s = [s for s in shapes if any((config_key(c), shape_key(s)) not in self.table for c in missing_c)]
            raise NeedMeasurements(self._round, missing_c, missing_s)
        return {(config_key(c), shape_key(s)): self.table[(config_key(c), shape_key(s))]
                for c in configs for s in shapes}


class LocalGpuMeasurer:
    """Builds each requested candidate here and times it on the local GPU with scripts/tune_measure.py."""

    source = "local_gpu"

    def __init__(self, session: Session, script: Path | None = None):
        self.s = session
        self.script = script or Path(__file__).resolve().parents[2] / "scripts" / "tune_measure.py"
        self.environment: dict = {}
        self.meta: dict = {}
        self._round = 0

    def measure(self, configs: list[dict], shapes: list[dict]) -> dict:
        self._round += 1
        entries, out = [], {}
        for cfg in configs:
            r = self.s.backends.build(self.s.worktree, self.s.kernel, shapes, cfg)
            if not r.ok:
                for sh in shapes:
                    out[(config_key(cfg), shape_key(sh))] = Timing(float("nan"), 0.0, f"build {r.status}: {r.summary[:300]}")
                continue
            for b in r.data.get("built", []):
                entries.append({"tunables": cfg, "variant": b["variant"], "build_dir": b["dir"],
                                "cubin_sha256": b.get("cubin_sha256")})
        if not entries:
            return out
        tune_dir = self.s.run_dir / "tune"
        tune_dir.mkdir(exist_ok=True)
        plan = tune_dir / f"plan_round{self._round}.json"
        result = tune_dir / f"measured_round{self._round}.json"
        plan.write_text(json.dumps({
            "schema": PLAN_SCHEMA, "kernel": self.s.kernel, "commit": self.s.base_sha,
            "sources_sha256": sources_sha256(self.s.worktree, self.s.spec.sources),
            "default": self.s.spec.tunable_defaults(), "entries": entries}, indent=1))
        env = scrubbed_environment()  # the measurement runs the worktree's kernel code
        env["PYTHONPATH"] = os.pathsep.join([str(self.s.worktree)] + [p for p in [env.get("PYTHONPATH")] if p])
        proc = subprocess.run([sys.executable, str(self.script), "measure", "--plan", str(plan), "--out", str(result)],
                              cwd=self.s.worktree, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            raise RunStopped("error", "tune_measure.py failed on the local GPU:\n" + proc.stderr[-2000:])
        data = json.loads(result.read_text())
        self.environment = data.get("environment") or {}
        self.meta = {k: data.get(k) for k in ("created", "command", "commit", "environment")}
        self.binaries = getattr(self, "binaries", []) + measured_binaries(data)
        out.update(parse_measurements(data, self.s.kernel, None))
        return out


def spread_pick(items: list, m: int) -> list:
    """`m` items spread evenly over `items` (first and last included when m >= 2)."""
    n = len(items)
    if m >= n:
        return list(items)
    if m == 1:
        return [items[n // 2]]
    idx = sorted({round(i * (n - 1) / (m - 1)) for i in range(m)})
    return [items[i] for i in idx]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("inf")


def successive_halving(configs: list[dict], shapes: list[dict], default: dict, measure, *, eta: int = 2,
                       on_round=None) -> dict:
    """Run successive halving; returns {rounds, ranking, timings} (see the module docstring)."""
    if eta < 2:
        raise ValueError("eta must be at least 2")
    plan = schedule(len(configs), len(shapes), eta)
    n_rounds = len(plan)
    survivors = list(configs)
    rounds, timings = [], {}
    eliminated: dict[str, str] = {}
    ranking: list[dict] = []
    for r in range(n_rounds):
        last = r == n_rounds - 1
        subset = spread_pick(shapes, plan[r])
        to_measure = survivors + ([default] if default not in survivors else [])
        timings.update(measure(to_measure, subset))
        scored = []
        for c in survivors:
            ck = config_key(c)
            bad = [(s, timings[(ck, shape_key(s))]) for s in subset if not timings[(ck, shape_key(s))].ok]
            if bad:
                eliminated[ck] = f"round {r}: no valid timing for {shape_key(bad[0][0])} ({bad[0][1].error})"
                continue
            ratios = []
            for s in subset:
                d = timings[(config_key(default), shape_key(s))]
                if not d.ok:
                    raise RunStopped("error", f"the defaults have no valid timing for {shape_key(s)} ({d.error})")
                ratios.append(timings[(ck, shape_key(s))].median_us / d.median_us)
            scored.append((geomean(ratios), c))
        scored.sort(key=lambda x: (x[0], config_key(x[1])))
        keep = len(scored) if last else max(1, math.ceil(len(scored) / eta))
        for score, c in scored[keep:]:
            eliminated[config_key(c)] = f"round {r}: relative time {score:.4f}, not in the best {keep}"
        rounds.append({"round": r, "shapes": [shape_key(s) for s in subset],
                       "candidates": [{"tunables": c, "relative_time": round(score, 5)} for score, c in scored],
                       "kept": keep})
        if on_round:
            on_round(rounds[-1])
        survivors = [c for _, c in scored[:keep]]
        ranking = [{"tunables": c, "relative_time": score} for score, c in scored[:keep]]
        if not survivors:
            break
    return {"rounds": rounds, "ranking": ranking, "eliminated": eliminated, "timings": timings,
            "final_shapes": [shape_key(s) for s in shapes]}


def decide(result: dict, shapes: list[dict], default: dict, *, min_gain_pct: float) -> dict:
    """Pick the best ranked candidate that beats the defaults by `min_gain_pct` with no shape slower
    beyond noise; returns {chosen (tunables or None), reason, per_shape, gain_pct}."""
    t = result["timings"]
    dk = config_key(default)
    for cand in result["ranking"]:
        c = cand["tunables"]
        if c == default:
            return {"chosen": None, "gain_pct": 0.0, "per_shape": [],
                    "reason": "defaults already best: no candidate ranked above the current defaults"}
        ck = config_key(c)
        rows, slower = [], []
        for s in shapes:
            a, d = t[(ck, shape_key(s))], t[(dk, shape_key(s))]
            ratio = a.median_us / d.median_us
            tol = max(REGRESSION_FLOOR, a.noise + d.noise)
            verdict = "FAST" if ratio < 1 - tol else "SLOW" if ratio > 1 + tol else "SAME"
            rows.append({"variant": s, "default_us": d.median_us, "candidate_us": a.median_us,
                         "ratio": round(ratio, 5), "tolerance": round(tol, 4), "verdict": verdict})
            if verdict == "SLOW":
                slower.append(s)
        gain = (1 - geomean([r["ratio"] for r in rows])) * 100
        if slower:
            continue
        if gain < min_gain_pct:
            return {"chosen": None, "gain_pct": gain, "per_shape": rows,
                    "reason": f"defaults already best: the best candidate {c} gains only {gain:.2f}% "
                              f"(threshold {min_gain_pct}%)"}
        return {"chosen": c, "gain_pct": gain, "per_shape": rows,
                "reason": f"{c} is {gain:.2f}% faster than the defaults (geometric mean over {len(rows)} shapes), "
                          "slower on none"}
    return {"chosen": None, "gain_pct": 0.0, "per_shape": [],
            "reason": "defaults already best: every faster candidate is slower than the defaults on some shape"}


class TunerProposer:
    name = "tuner"
    allows_tunable_edits = True

    def __init__(self, *, measurements=None, eta: int = 2, min_gain_pct: float = 2.0, stage: str | None = None):
        self.stage = stage  # search only this stage's own tunables (tunable_grid)
        self.measurements = [Path(m) for m in (measurements or [])] if not isinstance(measurements, (str, Path)) \
            else [Path(measurements)]
        self.eta = eta
        self.min_gain_pct = min_gain_pct
        self.report: dict | None = None

    def _measurer(self, session: Session):
        if self.measurements:
            try:
                return FileMeasurer(self.measurements, session.kernel,
                                    sources_sha256(session.worktree, session.spec.sources))
            except MeasurementError as e:
                raise RunStopped("error", str(e)) from None
        if session.backends.gpu_available():
            return LocalGpuMeasurer(session)
        raise RunStopped("error", "no CUDA device on this host, so the tuner cannot measure; run "
                         "scripts/tune_measure.py on a GPU host and pass its JSON with --measurements")

    def run(self, session: Session, toolbox: Toolbox) -> Proposal:
        spec = session.spec
        if not spec.tunables:
            raise RunStopped("no_change", f"kernel {session.kernel!r} declares no tunables")
        try:
            grid = tunable_grid(spec, self.stage)
        except ValueError as e:
            raise RunStopped("error", str(e)) from None
        measurer = self._measurer(session)
        default = spec.tunable_defaults()
        shapes = list(spec.shapes)
        where = f" of stage {self.stage}" if self.stage else ""
        session.stage(f"tuner: {len(grid)} candidates{where} over {len(shapes)} shapes ({measurer.source})")
        session.trajectory.event("tuner_start", candidates=grid, shapes=shapes, eta=self.eta, stage=self.stage,
                                 min_gain_pct=self.min_gain_pct, measurer=measurer.source,
                                 measurements=[m.name for m in self.measurements])

        def on_round(rd):
            session.check_budget()
            best = rd["candidates"][0] if rd["candidates"] else None
            if best:
                session.set_best(f"round {rd['round']}: {best['tunables']} at {best['relative_time']:.3f}x defaults")
            session.trajectory.event("tuner_round", **rd)

        try:
            result = successive_halving(grid, shapes, default, measurer.measure, eta=self.eta, on_round=on_round)
        except NeedMeasurements as need:
            raise RunStopped("needs_measurements", self._request(session, need)) from None
        decision = decide(result, shapes, default, min_gain_pct=self.min_gain_pct)
        # The measurements, bound to the cubins they timed: what a replay of this run checks.
        session.trajectory.event("measurements", binaries=list(getattr(measurer, "binaries", [])))
        self.report = {
            "kernel": session.kernel, "stage": self.stage, "default": default, "eta": self.eta,
            "min_gain_pct": self.min_gain_pct,
            "measurer": measurer.source, "measurements_meta": measurer.meta,
            "rounds": result["rounds"], "eliminated": result["eliminated"],
            "decision": {k: v for k, v in decision.items()},
        }
        session.trajectory.event("tuner_decision", **decision)
        if decision["chosen"] is None:
            raise RunStopped("no_change", decision["reason"])
        chosen = decision["chosen"]
        changed = {k: v for k, v in chosen.items() if default.get(k) != v}
        out = toolbox.call("set_tunable_defaults", {"values": changed}, "tuner-set")
        if out.is_error:
            raise RunStopped("error", f"could not apply the tunables: {out.content}")
        out = toolbox.call("submit_proposal", self._proposal_input(session, default, changed, decision, measurer),
                           "tuner-submit")
        if out.proposal is None:
            raise RunStopped("rejected", out.content)
        return out.proposal

    def _request(self, session: Session, need: NeedMeasurements) -> str:
        """Write the next round's measurement request into the run folder; the message says what to run."""
        req = {"schema": REQUEST_SCHEMA, "kernel": session.kernel, "stage": self.stage, "round": need.round,
               "eta": self.eta,
               "commit": session.base_sha, "configs": need.configs, "shapes": need.shapes,
               "sources_sha256": sources_sha256(session.worktree, session.spec.sources)}
        path = session.run_dir / f"tune_request_round{need.round}.json"
        path.write_text(json.dumps(req, indent=1))
        self.report = {"kernel": session.kernel, "eta": self.eta, "pending_request": path.name,
                       "rounds_done": need.round, "measurements": [m.name for m in self.measurements]}
        return (f"successive-halving round {need.round} needs {len(need.configs)} settings x "
                f"{len(need.shapes)} shapes not measured yet. Next: `python scripts/tune_measure.py prepare "
                f"--kernel {session.kernel} --request {path}` here, `scripts/tune_measure.py measure` on the GPU "
                "host, then run the tuner again with every --measurements file so far")

    def _proposal_input(self, session, default, changed, decision, measurer) -> dict:
        rows = decision["per_shape"]
        fast = [r for r in rows if r["verdict"] == "FAST"]
        batches = sorted({r["variant"].get("batch") for r in fast if isinstance(r["variant"].get("batch"), int)})
        all_batches = sorted({r["variant"].get("batch") for r in rows if isinstance(r["variant"].get("batch"), int)})
        # Claim a speedup only on batch sizes where every measured shape was clearly faster.
        claim = [b for b in batches
                 if all(r["verdict"] == "FAST" for r in rows if r["variant"].get("batch") == b)]
        best = min(rows, key=lambda r: r["ratio"])
        worst = max(rows, key=lambda r: r["ratio"])
        gpu = measurer.environment.get("gpu") or "the GPU host"
        change = ", ".join(f"{k} {default.get(k)} -> {v}" for k, v in changed.items())
        scope = f"{session.kernel} stage {self.stage}" if self.stage else session.kernel
        return {
            "title": f"tune {scope} defaults: {change}",
            "summary": (f"Change {session.kernel}'s tunable defaults ({change}); measured "
                        f"{decision['gain_pct']:.1f}% faster (geometric mean over {len(rows)} validation shapes) "
                        f"on {gpu}, slower on none."),
            "motivation": session.goal,
            "design": (f"Successive halving (eta {self.eta}) over all {len(tunable_grid(session.spec, self.stage))} "
                       "combinations of the declared tunables"
                       + (f" of stage {self.stage} (the others at their defaults)" if self.stage else "")
                       + f", timed by scripts/tune_measure.py ({measurer.source}); the winner must beat "
                       f"the defaults by at least {self.min_gain_pct}% and be slower on no shape beyond the "
                       "measured noise. Only the defaults change (the kernel's manifest entry, where they are "
                       "declared), not its code."),
            "prediction": (f"Median kernel time {-decision['gain_pct']:+.1f}% (geometric mean); best "
                           f"{(best['ratio'] - 1) * 100:+.1f}% at {best['variant']}, worst "
                           f"{(worst['ratio'] - 1) * 100:+.1f}% at {worst['variant']}; numerics unchanged "
                           "within tolerance (same arithmetic, different work split)."),
            "predicted_time_change_pct": -round(decision["gain_pct"], 2),
            "predicted_cases": f"batches {all_batches}",
            "predicted_batches": claim or None,
            "risks": ("Timings come from one GPU host and one session: another clock, driver or concurrent "
                      "load can reorder close candidates. A different work split changes the fp32 "
                      "summation order, so outputs may differ in the last bits from the old defaults."),
            "rollback": "Any SLOW verdict at any batch size in the validation benchmark, or a numerics failure.",
            "alternatives": "Other settings of the last round, time relative to the defaults: " + (
                "; ".join(f"{c['tunables']}: {c['relative_time']:.3f}x" for c in [
                    c for c in self.report["rounds"][-1]["candidates"] if c["tunables"] != decision["chosen"]][:5])
                or "none"),
            "questions": "",
        }

    def extra_evidence(self) -> dict:
        return {"tuning.json": json.dumps(self.report, indent=1, default=str)} if self.report else {}

    def summary_extra(self) -> dict:
        return {"tuning": self.report} if self.report else {}

