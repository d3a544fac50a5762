"""`propose-optimization`: propose one isolated, scope-bounded change to a kernel.

    propose-optimization --kernel K --goal TEXT [--proposer claude|tuner|replay] [--base REV]
                         [--budget turns=40,cost=10,wall=1h,...] [--model ID] ...

Exit codes: 0 a change was committed on a new branch; 1 the run ended without an accepted change
(rejected, no proposal, refusal, budget reached, defaults already best: see the summary);
2 bad input or an infrastructure error (unknown kernel or revision, missing API key or file, API
error); 130 interrupted (Ctrl-C; what was written is kept).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agent.budget import BudgetError, BudgetLimits
from agent.proposers.claude import DEFAULT_MAX_RETRIES, DEFAULT_MAX_TOKENS, DEFAULT_MODEL, MODEL_ENV, resolve_model

EPILOG = """\
budget keys: turns, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost (USD),
wall (seconds or 90s/30m/2h); 'none' lifts a limit. Defaults: turns=40, cost=10, wall=1h.

The Claude proposer reads the API key from ANTHROPIC_API_KEY (never from the command line) and the
model from --model, else $%s, else %s.

The tuner needs timings: on a GPU host it measures locally; elsewhere pass --measurements FILE
written on a GPU host by `scripts/tune_measure.py measure` (see agent/README.md).

exit codes: 0 change committed; 1 no accepted change (see the run summary); 2 bad input or
infrastructure error; 130 interrupted.
""" % (MODEL_ENV, DEFAULT_MODEL)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="propose-optimization",
        description="Propose an isolated, scope-bounded optimization of one kernel, in a new git worktree.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--kernel", help="kernel name from kernels/manifest.toml (required unless --clean)")
    p.add_argument("--goal", default="", help="what to improve (required for the claude proposer)")
    p.add_argument("--proposer", choices=("claude", "tuner", "replay"), default="claude")
    p.add_argument("--base", default="HEAD", help="revision to start from (default HEAD)")
    p.add_argument("--budget", action="append", metavar="KEY=VALUE[,...]", help="budget limits (repeatable)")
    p.add_argument("--model", help=f"Claude model id (default ${MODEL_ENV} or {DEFAULT_MODEL})")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="max output tokens per model turn")
    p.add_argument("--max-retries", type=int, default=DEFAULT_MAX_RETRIES,
                   help="retries (exponential backoff) on 429/5xx/overloaded and connection errors")
    p.add_argument("--trajectory", type=Path, help="replay: the trajectory.jsonl to re-run")
    p.add_argument("--measurements", type=Path, action="append",
                   help="tuner: timings JSON from scripts/tune_measure.py (repeatable: one per round measured)")
    p.add_argument("--eta", type=int, default=2, help="tuner: successive-halving reduction factor")
    p.add_argument("--min-gain", type=float, default=2.0, help="tuner: minimum geomean gain in percent")
    p.add_argument("--stage", help="tuner: search only this stage's own tunables (a persistent kernel's "
                   "[[kernels.K.stages]] entry); the others stay at their defaults")
    p.add_argument("--repo", type=Path, default=Path("."), help="repository root (default: current folder)")
    p.add_argument("--runs-dir", type=Path, help="where run folders go (default .fasttrack/runs)")
    p.add_argument("--no-progress", action="store_true", help="no live display (plain stage lines only)")
    p.add_argument("--clean", action="store_true",
                   help="remove the worktrees and branches of runs that committed nothing (their records stay)")
    return p


def signing_key_problem(repo: Path) -> str | None:
    """Why this host may not run a proposer whose code builds here: a signing key is within reach
    ($FASTTRACK_SIGNING_KEY, or a key in the repository's key store). Signing belongs on the
    trusted runner, never where proposed code builds."""
    from kernels.sandbox import KEY_DIR, KEY_ENV

    if os.environ.get(KEY_ENV):
        return f"${KEY_ENV} names a signing key on this host"
    keys = sorted((repo / KEY_DIR).glob("*")) if (repo / KEY_DIR).is_dir() else []
    if keys:
        return f"the key store {KEY_DIR}/ of this repository holds {len(keys)} file(s)"
    return None


def _fail(msg: str, code: int = 2) -> int:
    print(f"propose-optimization: {msg}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None, *, backends=None, http_client=None) -> int:
    """Parse arguments, run one proposal, print its outcome; returns the exit code.

    `backends` and `http_client` are seams for tests (a fake build/validate, a mock transport).
    """
    args = build_parser().parse_args(argv)
    from agent.loop import RunConfig, UserError, clean_runs, run_proposal
    from agent.progress import Progress
    from agent.trajectory import TrajectoryError

    try:
        budget = BudgetLimits.parse(args.budget)
    except BudgetError as e:
        return _fail(str(e))
    if args.max_tokens <= 0 or args.max_retries < 0 or args.eta < 2:
        return _fail("--max-tokens must be positive, --max-retries non-negative, --eta at least 2")
    if not (args.repo / ".git").exists():
        return _fail(f"{args.repo} is not the root of a git repository (use --repo)")
    if args.clean:
        removed, kept = clean_runs(args.repo.resolve(), args.runs_dir)
        print(f"removed {len(removed)} run worktree(s) and branch(es) that committed nothing; "
              f"kept {len(kept)} committed run(s) and every run record")
        return 0
    if not args.kernel:
        return _fail("--kernel is required")
    if args.runs_dir and args.runs_dir.exists() and not args.runs_dir.is_dir():
        return _fail(f"--runs-dir {args.runs_dir} is not a folder")
    if args.runs_dir is not None:
        args.runs_dir = args.runs_dir.resolve()
    model = resolve_model(args.model)
    # Children never inherit it: the checks get a scrubbed environment, the sandbox a clean one,
    # and git runs no hooks.
    api_key = os.environ.get("ANTHROPIC_API_KEY")
    if backends is None:
        from agent.backends import RepoBackends
        from kernels.sandbox import Sandbox

        repo = args.repo.resolve()
        key = os.environ.get("FASTTRACK_SIGNING_KEY")  # hidden even where a visible folder holds it
        backends = RepoBackends(build_root=repo / "build",
                                sandbox=Sandbox(key_roots=(str(repo),), hidden=(key,) if key else ()))
    if args.proposer in ("claude", "replay"):
        key = signing_key_problem(args.repo.resolve())
        if key:
            return _fail(f"refusing to run the {args.proposer} proposer here: {key}. Proposed code builds "
                         "on this host; signing happens only on the trusted runner, so move the key there")
    problem = getattr(backends, "sandbox_problem", lambda: "the backends cannot sandbox proposed code")()
    if problem:
        return _fail(f"proposed code must build in a sandbox, and it cannot here: {problem}")

    if args.stage and args.proposer != "tuner":
        return _fail("--stage is a tuner option (--proposer tuner)")
    if args.proposer == "claude":
        if not args.goal.strip():
            return _fail("--goal is required for the claude proposer")
        if not api_key:
            return _fail("ANTHROPIC_API_KEY is not set; set it, or run offline with --proposer tuner or replay")
        from agent.proposers.claude import ClaudeProposer, make_client

        client = make_client(api_key=api_key, max_retries=args.max_retries, http_client=http_client)
        proposer = ClaudeProposer(client, model=model, max_tokens=args.max_tokens, max_retries=args.max_retries)
    elif args.proposer == "tuner":
        if args.measurements is None and not backends.gpu_available():
            return _fail("no CUDA device on this host, so the tuner cannot measure here. Run "
                         "`scripts/tune_measure.py prepare` here and `scripts/tune_measure.py measure` "
                         "on a GPU host, then pass its JSON with --measurements FILE")
        for m in args.measurements or []:
            if not m.is_file():
                return _fail(f"measurements file {m} does not exist")
        from agent.proposers.tuner import TunerProposer, stage_tunables

        if args.stage:
            from kernels.manifest import ManifestError, load_manifest

            try:
                stage_tunables(load_manifest(args.repo.resolve() / "kernels" / "manifest.toml").kernel(args.kernel),
                               args.stage)
            except (ManifestError, ValueError) as e:
                return _fail(f"--stage {args.stage}: {e}")
        proposer = TunerProposer(measurements=[m.resolve() for m in args.measurements or []],
                                 eta=args.eta, min_gain_pct=args.min_gain, stage=args.stage)
        args.goal = args.goal or "faster kernel through its declared tunables"
    else:
        if args.trajectory is None:
            return _fail("--proposer replay needs --trajectory FILE")
        from agent.proposers.replay import ReplayProposer

        try:
            proposer = ReplayProposer(args.trajectory)
        except TrajectoryError as e:
            return _fail(str(e))
        args.goal = args.goal or f"replay of {args.trajectory.name}"

    cfg = RunConfig(
        kernel=args.kernel, goal=args.goal, proposer=args.proposer, base=args.base, repo=args.repo.resolve(),
        runs_dir=args.runs_dir, budget=budget, model=model, max_tokens=args.max_tokens,
        max_retries=args.max_retries, replay_from=args.trajectory, measurements=args.measurements,
        tuner_eta=args.eta, tuner_min_gain_pct=args.min_gain,
    )
    progress = Progress(f"{args.kernel} / {args.proposer}", live=False if args.no_progress else None)
    try:
        result = run_proposal(cfg, proposer, backends=backends, progress=progress,
                              secrets_to_redact=[api_key] if api_key else [])
    except UserError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    out = sys.stdout if result.exit_code == 0 else sys.stderr  # a failed run's reason is an error
    print(f"{result.outcome}: {result.reason}", file=out)
    print(f"run folder: {result.run_dir}", file=out)
    if result.worktree:
        print(f"worktree: {result.worktree} (branch {result.branch})", file=out)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
