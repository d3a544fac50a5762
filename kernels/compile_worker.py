"""Compile CuTe DSL op variants in a fresh process. Run by `kernels.build`; never imported.

    python -I kernels/compile_worker.py JOB.json     (working directory: a staging folder)

The staging folder holds a copy of exactly the source files the build hashed, in their
repo-relative layout, with a fixed modification time. Its modules are imported under relative
paths, so what the DSL embeds with line info (source file names, and the file mtimes that go
into the DWARF line table) is the same on every checkout: identical sources give identical cubin
bytes wherever they are compiled. An import of a repo module that was not hashed fails here,
which keeps the build's content hash honest.

Only the standard library is imported before the finder is installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import re
import shutil
import sys
import tempfile
import traceback

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class RelativeSourceFinder(importlib.abc.MetaPathFinder):
    """Import `roots.*` from the working directory, recording repo-relative file names."""

    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if parts[0] not in self.roots:
            return None
        base = os.path.join(*parts)
        init = os.path.join(base, "__init__.py")
        if os.path.isfile(init):
            spec = importlib.machinery.ModuleSpec(
                fullname, importlib.machinery.SourceFileLoader(fullname, init), origin=init, is_package=True
            )
            spec.submodule_search_locations = [base]
            spec.has_location = True
            return spec
        if os.path.isfile(base + ".py"):
            p = base + ".py"
            spec = importlib.machinery.ModuleSpec(
                fullname, importlib.machinery.SourceFileLoader(fullname, p), origin=p
            )
            spec.has_location = True
            return spec
        if os.path.isdir(base):  # namespace package (e.g. tests/ without __init__.py)
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [base]
            return spec
        # Not staged: refuse rather than fall back to the checkout (its bytes were not hashed).
        raise ImportError(f"{fullname} is not among the kernel's hashed sources")


def _first_line(text: str) -> str:
    text = _ANSI.sub("", text).strip()
    return text.splitlines()[0].strip() if text else ""


def describe_error(exc: BaseException, staged: set[str]) -> dict:
    """Message, user source file and line of a compile error (paths are repo-relative)."""
    message = _first_line(getattr(exc, "message", None) or str(exc)) or type(exc).__name__
    cause = getattr(exc, "cause", None) or exc.__cause__
    if cause is not None and _first_line(str(cause)) and _first_line(str(cause)) not in message:
        message = f"{message} ({_first_line(str(cause))})"
    if not message.startswith(type(exc).__name__) and not hasattr(exc, "message"):
        message = f"{type(exc).__name__}: {message}"
    file, line = getattr(exc, "filename", None), getattr(exc, "line", None)
    if not (isinstance(file, str) and file in staged and isinstance(line, int)):
        file, line = None, None
        # The innermost frame in the user's sources, across the exception chain.
        seen, e = set(), exc
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            for fr in traceback.extract_tb(e.__traceback__):
                if fr.filename in staged:
                    file, line = fr.filename, fr.lineno
            if isinstance(e, SyntaxError) and e.filename in staged:
                file, line = e.filename, e.lineno
            e = e.__cause__ or e.__context__
    return {"ok": False, "error": message, "file": file, "line": line, "type": type(exc).__name__}


def main(job_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    staged = set(job["sources"])
    sys.meta_path.insert(0, RelativeSourceFinder(job["roots"]))
    results: list[dict] = []

    def save():
        tmp = job["results"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, job["results"])

    try:
        import cutlass.cute as cute

        mod_name, _, attr = job["op"].partition(":")
        op_cls = importlib.import_module(mod_name)
        for part in attr.split("."):
            op_cls = getattr(op_cls, part)
    except Exception as e:  # the op module does not import: every variant fails alike
        err = describe_error(e, staged)
        results.extend(err for _ in job["variants"])
        save()
        return 0

    for v in job["variants"]:
        dump = tempfile.mkdtemp(prefix="fasttrack-dump-")
        try:
            op = op_cls(v["shape"], **v["tunables"])
            specs = {name: s.to_dict() for name, s in op.tensor_specs().items()}
            launch = op.launch_config().to_dict()
            cute.compile(
                op,
                *op.fake_args(),
                options=f"--keep-ptx --keep-cubin --gpu-arch {job['arch']} --dump-dir {dump} {job['options']}",
            )
            found = {ext: [n for n in os.listdir(dump) if n.endswith(f".{job['arch']}.{ext}")] for ext in ("ptx", "cubin")}
            for ext, names in found.items():
                if len(names) != 1:
                    raise RuntimeError(f"expected one .{ext} from the DSL, found {len(names)}: {names}")
            os.makedirs(v["out_dir"], exist_ok=True)
            for ext, names in found.items():
                shutil.move(os.path.join(dump, names[0]), os.path.join(v["out_dir"], f"kernel.{ext}"))
            results.append({"ok": True, "specs": specs, "launch": launch})
        except Exception as e:
            results.append(describe_error(e, staged))
        finally:
            shutil.rmtree(dump, ignore_errors=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
