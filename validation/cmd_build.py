"""`fasttrack build [KERNEL ...]`: compile the manifest's kernels (CPU only) and show their metadata.

Prints one row per variant: kernel, variant, entry name, registers, spill bytes, shared memory,
cubin sha256 prefix and whether it came from the cache; `--json` prints the full metadata.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kernels.build import DEFAULT_ROOT, BuildError, artifact_summary, build_all
from kernels.manifest import REPO_ROOT, ManifestError, load_manifest
from validation.cli import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "build",
        help="compile kernels for sm_90a (no GPU needed) and print their audit-ready metadata",
        description="Compile the manifest's CuTe DSL kernels (all variants) into content-addressed "
        "build folders and print entry, registers, spills, shared memory and cubin hash per variant. "
        "Unchanged inputs are cache hits.",
    )
    p.add_argument("kernels", nargs="*", metavar="KERNEL", help="kernels to build (default: all in the manifest)")
    p.add_argument("--json", action="store_true", help="print the full metadata of every variant as JSON")
    p.add_argument("--root", type=Path, default=None, help="build cache folder (default: build/ at the repo root)")
    p.add_argument("--force", action="store_true", help="recompile even when the cache holds the variant")
    p.add_argument("--manifest", type=Path, default=None, help="manifest file (default: kernels/manifest.toml)")
    p.add_argument("-j", "--jobs", type=int, default=None,
                   help="local compiler processes at a time (default: the CPU count, at most 4)")
    p.add_argument("--executor", default=None, metavar="local|ray|ray:ADDRESS",
                   help="where variants compile (default: $FASTTRACK_BUILD_EXECUTOR, else local processes)")


def _display_path(p: Path) -> str:
    """Repo- or cwd-relative when possible: outputs get committed as evidence."""
    p = Path(p).resolve()
    for base in (Path.cwd().resolve(), REPO_ROOT):
        try:
            return p.relative_to(base).as_posix()
        except ValueError:
            continue
    return str(p)


def _print_table(rows: list[dict]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=240)  # piped: keep one row per variant
    wide = console.width >= 180  # the entry name is long; narrow terminals get it from --json
    table = Table(title="fasttrack build (sizes in bytes; spill = local store/load bytes, smem = "
                  "static+dynamic)", title_justify="left", box=box.SIMPLE_HEAD)
    cols = [("kernel", {"no_wrap": True}), ("variant", {"no_wrap": wide, "min_width": 16})]
    if wide:
        cols.append(("entry", {"overflow": "ellipsis", "max_width": 36, "no_wrap": True}))
    heads = ("regs", "spill st/ld", "local", "smem st+dyn") if wide else ("regs", "spill", "local", "smem")
    cols += [(c, {"justify": "right", "no_wrap": True}) for c in heads]
    cols += [("cubin sha256" if wide else "cubin", {"no_wrap": True}), ("cached", {"no_wrap": True})]
    for col, kw in cols:
        table.add_column(col, **kw)
    for r in rows:
        cells = [r["kernel"], r["variant"]] + ([r["entry"]] if wide else []) + [
            str(r["registers"]), f"{r['spill_store_bytes']}/{r['spill_load_bytes']}", str(r["local_bytes"]),
            f"{r['static_smem_bytes']}+{r['dynamic_smem_bytes']}", r["cubin_sha256"][:12 if wide else 8],
            "yes" if r["cache_hit"] else "no",
        ]
        table.add_row(*cells)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    try:
        manifest = load_manifest(args.manifest)
        for name in args.kernels:
            manifest.kernel(name)
    except ManifestError as e:
        raise UserError(str(e), code=2) from None
    if args.jobs is not None and args.jobs < 1:
        raise UserError("--jobs must be at least 1", code=2)
    root = args.root if args.root is not None else DEFAULT_ROOT

    start = time.monotonic()
    progress_bar = None
    callback = None
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress_bar = Progress(
            TextColumn("building"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.description}"), console=Console(stderr=True), transient=True,
        )
        task = progress_bar.add_task("", total=None)

        def callback(done, total, art):
            progress_bar.update(task, completed=done, total=total, description=f"{art.kernel} {art.dir.name}")

        progress_bar.start()
    try:
        from kernels.build import make_executor

        arts = build_all(args.kernels or None, root=root, progress=callback, force=args.force,
                         jobs=args.jobs, manifest=manifest,
                         executor=make_executor(args.executor, args.jobs) if args.executor else None)
    except BuildError as e:
        raise UserError(str(e), code=1) from None
    finally:
        if progress_bar is not None:
            progress_bar.stop()

    rows = [artifact_summary(a) for a in arts]
    for r, a in zip(rows, arts):
        r["dir"] = _display_path(a.dir)
    if args.json:
        out = [{"dir": r["dir"], "cache_hit": r["cache_hit"], "meta": a.meta} for r, a in zip(rows, arts)]
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(rows)
    cached = sum(a.cache_hit for a in arts)
    print(
        f"fasttrack build: {len(arts)} variant(s), {len(arts) - cached} compiled, {cached} cached, "
        f"in {time.monotonic() - start:.1f} s under {_display_path(Path(root))}/",
        file=sys.stderr,
    )
    return 0
