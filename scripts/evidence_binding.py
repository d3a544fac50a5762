"""Does committed GPU evidence still name the cubins this checkout builds?

    python scripts/evidence_binding.py evidence_reports/foundation/final/gpu_proof.json \
        evidence_reports/moe_block/round5/final/block_plan.json

Every file is an evidence bundle (`bundle.json`, schema fasttrack.evidence/1: its head
`binaries`, each naming `kernel`, `variant`, `tunables`, `cubin_sha256` and `cubin_code_sha256`)
or a JSON with `cases`, each naming `kernel`, `shape`, `tunables` and the `cubin_sha256` it
measured (the plans and results of the proof scripts older evidence came from). Each case is rebuilt on this host (cached builds under `--root`) and its
cubin compared. A cubin carries line tables for every source it was built from (an edit to a
shared module such as `kernels/ops/parts/common.py`, even a comment, moves lines and changes the
cubins of every kernel that imports it), so this is the way to know whether a figure in a README
still describes the code at HEAD.

A case is bound when the rebuilt cubin has its `cubin_sha256` (the same bytes), or, where the
case also records `cubin_code_sha256` (plans since kernels/cubin.py), the same code sha256: every
ELF section identical but the line tables, i.e. the same instructions, constants, resources and
attributes, only source lines moved. Such cases are counted apart ("line tables differ").

Prints, per file, how many cases are bound and names each one that is not; exit 0 when every
case of every file is bound, 1 when some are not, 2 on bad input (an unreadable file, a case
without those fields, a build error).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


class BindingError(RuntimeError):
    """Bad input: one clear line, exit 2."""


def load_cases(path: Path) -> list[dict]:
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise BindingError(f"{path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise BindingError(f"{path}: not JSON ({e})") from None
    if isinstance(doc, dict) and doc.get("schema") == "fasttrack.evidence/1":
        cases = bundle_cases(doc)
        if not cases:
            raise BindingError(f"{path}: a bundle with no head binaries")
    else:
        cases = doc.get("cases") if isinstance(doc, dict) else None
    if not isinstance(cases, list) or not cases:
        raise BindingError(f"{path}: no `cases` list")
    for i, c in enumerate(cases):
        missing = [k for k in ("kernel", "shape", "tunables", "cubin_sha256") if k not in c]
        if missing:
            raise BindingError(f"{path}: case {i} has no {', '.join(missing)}")
    return cases


def bundle_cases(bundle: dict) -> list[dict]:
    """A bundle's head binaries as cases (once per kernel, variant, tunables and cubin): what the
    bundle measured of the code it judged (its base binaries are another revision's)."""
    out, seen = [], set()
    for b in bundle.get("binaries") or []:
        if not isinstance(b, dict) or b.get("side") != "head":
            continue
        key = json.dumps([b.get("kernel"), b.get("variant"), b.get("tunables"), b.get("cubin_sha256")], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        c = {"kernel": b.get("kernel"), "shape": b.get("variant"), "tunables": b.get("tunables"),
             "cubin_sha256": b.get("cubin_sha256")}
        if b.get("cubin_code_sha256"):
            c["cubin_code_sha256"] = b["cubin_code_sha256"]
        out.append({k: v for k, v in c.items() if v is not None})
    return out


def check(cases: list[dict], root: Path, jobs: int | None = None) -> list[tuple[dict, tuple[str, str]]]:
    """(case, (cubin sha256, code sha256) this checkout builds) for every case, built in groups
    of one kernel and one set of tunables."""
    from kernels.build import BuildError, build_kernel
    from kernels.manifest import ManifestError, load_manifest

    man = load_manifest()

    def declared(kernel: str, tunables: dict) -> dict:
        # A tunable the manifest no longer declares (its design deleted, docs/decisions.md) is
        # dropped: the rebuild takes the current code, and the code hash judges whether it is
        # still what the evidence ran.
        try:
            names = {t.name for t in man.kernel(kernel).tunables}
        except ManifestError:  # the build names the unknown kernel
            return tunables
        return {k: v for k, v in tunables.items() if k in names}

    groups: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        key = [c["kernel"], declared(c["kernel"], c["tunables"])]
        groups.setdefault(json.dumps(key, sort_keys=True), []).append(i)
    built: dict[int, tuple[str, str]] = {}
    for key, idx in groups.items():
        kernel, tunables = json.loads(key)
        try:
            arts = build_kernel(kernel, shapes=[cases[i]["shape"] for i in idx], tunables=tunables,
                                root=root, jobs=jobs)
        except BuildError as e:
            raise BindingError(str(e)) from None
        for i, art in zip(idx, arts):
            built[i] = (art.cubin_sha256, art.cubin_code_sha256)
    return [(c, built[i]) for i, c in enumerate(cases)]


def verdict(case: dict, built: tuple[str, str]) -> str:
    """"same" (the same cubin bytes), "code" (same code sha256, line tables differ: only where the
    case records `cubin_code_sha256`) or "unbound"."""
    sha, code = built
    if sha == case["cubin_sha256"]:
        return "same"
    if case.get("cubin_code_sha256") and code == case["cubin_code_sha256"]:
        return "code"
    return "unbound"


def record_code_hashes(path: Path, dirs: dict[str, Path]) -> int:
    """Add `cubin_code_sha256` to every case of the plan or result at `path` whose cubin is still
    at hand: `dirs` maps a cubin sha256 to a build folder (a plan's carried `dir`s); the folder's
    cubin must have exactly the case's `cubin_sha256`. Returns how many cases were annotated."""
    from kernels.cubin import CubinError, code_sha256

    doc = json.loads(path.read_text())
    n = 0
    for c in doc["cases"]:
        d = dirs.get(c["cubin_sha256"])
        if d is None or c.get("cubin_code_sha256"):
            continue
        try:
            data = (d / "kernel.cubin").read_bytes()
            if hashlib.sha256(data).hexdigest() != c["cubin_sha256"]:
                raise BindingError(f"{d}: its cubin is not the one {path} names")
            c["cubin_code_sha256"] = code_sha256(data)
        except (OSError, CubinError) as e:
            raise BindingError(f"{d}: cannot read its cubin ({e})") from None
        n += 1
    if n:  # nothing to add: the file stays as it is
        path.write_text(json.dumps(doc, indent=1) + "\n")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="evidence JSON with `cases` (proof results or plans)")
    ap.add_argument("--root", type=Path, help="build cache root (default: a temporary folder)")
    ap.add_argument("--jobs", type=int, help="compile processes (default: the build's)")
    ap.add_argument("--record-code-sha", type=Path, metavar="PLAN",
                    help="instead of checking: add each case's cubin_code_sha256 to FILES from the cubins that "
                         "PLAN's `dir`s still hold (each checked against the case's cubin_sha256)")
    args = ap.parse_args(argv)
    if args.record_code_sha:
        try:
            plan_cases = load_cases(args.record_code_sha)
            dirs = {c["cubin_sha256"]: REPO / c["dir"] for c in plan_cases if c.get("dir") and (REPO / c["dir"]).is_dir()}
            for f in args.files:  # every file read before any is written
                load_cases(f)
            for f in args.files:
                print(f"{f}: {record_code_hashes(f, dirs)} cases given their code sha256")
        except BindingError as e:
            print(f"evidence_binding: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        loaded = [(f, load_cases(f)) for f in args.files]  # every file read before any build
        root = args.root or Path(tempfile.mkdtemp(prefix="evidence_binding_"))
        unbound = 0
        for f, cases in loaded:
            results = [(c, h, verdict(c, h)) for c, h in check(cases, root, args.jobs)]
            bad = [(c, h) for c, h, v in results if v == "unbound"]
            moved = sum(v == "code" for _, _, v in results)
            unbound += len(bad)
            print(f"{f}: {len(results) - len(bad)}/{len(results)} cases bound to this checkout's cubins"
                  + (f" ({moved} of them the same code, line tables differ)" if moved else ""))
            for c, h in bad:
                print(f"  unbound: {c['kernel']} {json.dumps(c['shape'], sort_keys=True)} "
                      f"(evidence {c['cubin_sha256'][:12]}, built {h[0][:12]})")
    except BindingError as e:
        print(f"evidence_binding: {e}", file=sys.stderr)
        return 2
    return 1 if unbound else 0


if __name__ == "__main__":
    sys.exit(main())
