"""AOT build: compile CuTe DSL kernels on a CPU-only host for sm_90a into content-addressed folders.

For one manifest kernel and one variant (a shape dict plus tunables) the build writes
`build/<kernel>/<content-hash>/`:

    kernel.ptx    the PTX the DSL generated
    kernel.cubin  the binary the GPU host launches (kernels.launch) and the evidence is bound to
    kernel.sass   its disassembly with source line annotations (nvdisasm -c -g), for the audit
    meta.json     entry name, parameters (PTX layout zipped with the manifest roles and the op's
                  tensor specs), launch configuration, resources, hashes, sources, versions

The content hash covers: a build-format version, the kernel name, its op and manifest params,
the variant and tunables (defaults filled in), the target arch and compile options, the DSL
version, and the bytes of every source file the op can import from the repository: the
manifest's declared sources plus the transitive closure of their repo-local imports (which
includes kernels/ops/base.py and any helper module under kernels/ops), found by parsing imports
statically. A rebuild with the same inputs is a cache hit and compiles nothing.

Compiles run in fresh child processes (`kernels/compile_worker.py`) over a staging copy of
exactly the hashed files with a fixed mtime, imported under repo-relative paths. Each chunk of
variants is a self-contained task (source bytes in, built files out) run by an executor: the
local one (`LocalExecutor`, up to `jobs` child processes at a time; the default) or Ray
(`RayExecutor`, a cluster of build hosts; `make_executor`, $FASTTRACK_BUILD_EXECUTOR);
`build_requests` builds variants of many kernels and source trees in one pool. Line info is on (`--generate-line-info`) so the SASS maps back to Python lines; it
embeds source file names and mtimes, which the staging copy makes independent of the checkout,
so identical inputs give identical cubin bytes on any host. Line info leaves the instructions
alone (gemv, rmsnorm and prodcons give the same SASS instructions with and without it).

Nothing here imports the DSL; only the child processes do.
"""

from __future__ import annotations

import ast
import concurrent.futures
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from kernels.cubin import code_sha256
from kernels.launch import TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES
from kernels.manifest import REPO_ROOT, KernelSpec, Manifest, ManifestError, load_manifest
from kernels.ptx import PtxError, dynamic_shared_symbols, parse_single_entry

BUILD_FORMAT = 1  # bump when the folder layout or meta.json schema changes
ARCH = "sm_90a"
COMPILE_OPTIONS = "--generate-line-info"  # added to --keep-ptx/--keep-cubin/--gpu-arch/--dump-dir
DEFAULT_ROOT = REPO_ROOT / "build"
STAGED_MTIME = 0  # seconds since the epoch, for every staged source (it reaches the DWARF)
WORKER = Path(__file__).with_name("compile_worker.py")
COMPILE_TIMEOUT_S = 300  # per variant
MAX_VARIANTS_PER_WORKER = 8  # amortises the DSL import; smaller chunks report progress sooner


class BuildError(RuntimeError):
    """A kernel variant cannot be built; the message names the kernel, the variant and the cause."""


@dataclass
class BuildArtifact:
    kernel: str
    shape: dict
    tunables: dict
    key: str  # full content hash (sha256 hex); the folder is named by its first 16 digits
    dir: Path
    meta: dict
    paths: dict[str, Path] = field(default_factory=dict)  # ptx, cubin, sass, meta
    cache_hit: bool = False

    @property
    def cubin_sha256(self) -> str:
        return self.meta["hashes"]["cubin_sha256"]

    @property
    def cubin_code_sha256(self) -> str:
        """sha256 of the cubin's sections but its line tables (kernels/cubin.py)."""
        return self.meta["hashes"].get("cubin_code_sha256") or code_sha256(Path(self.paths["cubin"]).read_bytes())


# -- tools ------------------------------------------------------------------------------------


def find_tool(name: str) -> Path:
    """Locate a CUDA binary tool (nvdisasm, cuobjdump).

    Looks in the `nvidia-cuda-*` PyPI wheels (site-packages/nvidia/*/bin), then on PATH, then in
    $CUDA_HOME/bin. Raises BuildError with the package to install otherwise.
    """
    candidates: list[Path] = []
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(base).glob(f"*/bin/{name}"))
    which = shutil.which(name)
    if which:
        candidates.append(Path(which))
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "bin" / name)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise BuildError(f"{name} not found; install it with: pip install nvidia-cuda-{name}")


def _run_tool(args: list, what: str) -> str:
    try:
        proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{what}: {e}") from None
    if proc.returncode != 0:
        raise BuildError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout


_RESOURCE_RE = re.compile(r"(REG|STACK|SHARED|LOCAL|CONSTANT\[0\]):(\d+)")


def parse_resource_usage(text: str, entry: str) -> dict:
    """Registers, stack, local and static shared bytes of `entry` from cuobjdump --dump-resource-usage."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("Function ") and line.strip().rstrip(":").endswith(entry):
            found = dict(_RESOURCE_RE.findall(lines[i + 1] if i + 1 < len(lines) else ""))
            if "REG" in found:
                return {
                    "registers": int(found["REG"]),
                    "stack_bytes": int(found.get("STACK", 0)),
                    "local_bytes": int(found.get("LOCAL", 0)),
                    "static_smem_bytes": int(found.get("SHARED", 0)),
                    "param_const_bytes": int(found.get("CONSTANT[0]", 0)),
                }
    raise BuildError(f"cuobjdump reports no resource usage for {entry}")


def local_memory_traffic(sass: str) -> dict:
    """Static bytes of local-memory stores/loads in SASS (STL/LDL): spills, and local arrays.

    ptxas reports spill bytes the same way (summed instruction widths); the DSL does not pass
    that report on, so it is recounted from the code that runs.
    """
    width = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
    out = {"spill_store_bytes": 0, "spill_load_bytes": 0}
    for m in re.finditer(r"\b(STL|LDL)((?:\.[A-Z0-9]+)*)", sass):
        mods = [x for x in m.group(2).split(".") if x]
        size = next((width[x] for x in mods if x in width), 4)
        out["spill_store_bytes" if m.group(1) == "STL" else "spill_load_bytes"] += size
    return out


# -- sources ----------------------------------------------------------------------------------


def _module_file(mod: str, repo_root: Path) -> Path | None:
    base = repo_root.joinpath(*mod.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def _package_inits(mod: str, repo_root: Path) -> list[Path]:
    parts = mod.split(".")
    out = []
    for i in range(1, len(parts)):
        init = repo_root.joinpath(*parts[:i], "__init__.py")
        if init.is_file():
            out.append(init)
    return out


# (repo-relative path, sha256 of the bytes) -> the modules the file imports: the closures of
# every kernel at base and at head share most files (kernels/ops/base.py, parts/, ...), and a
# file's imports depend on nothing but its path and its bytes, so each is parsed once a process.
_IMPORTS: dict[tuple[str, str], frozenset[str]] = {}


def _imports_of(path: Path, repo_root: Path) -> set[str]:
    """Module names `path` imports (absolute, relative ones resolved), anywhere in the file."""
    rel = path.relative_to(repo_root).with_suffix("")
    data = path.read_bytes()
    key = (rel.as_posix(), hashlib.sha256(data).hexdigest())
    if key not in _IMPORTS:
        _IMPORTS[key] = frozenset(_parse_imports(data, rel))
    return set(_IMPORTS[key])


def _parse_imports(data: bytes, rel: Path) -> set[str]:
    package = list(rel.parts[:-1])  # the package a relative import starts from
    try:
        tree = ast.parse(data, filename=str(rel))
    except SyntaxError:
        return set()  # the compile reports it, with its line
    names: set[str] = set()
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod:
                names.add(mod)
                names.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return names


def _statements(tree: ast.AST):
    """Every statement of a module, nested ones included (an import is always a statement):
    walks statement lists only, never into expressions, which hold most of a module's nodes."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for value in vars(node).values():
            if isinstance(value, list):
                todo.extend(x for x in value if isinstance(x, (ast.stmt, ast.excepthandler, ast.match_case)))


def source_closure(spec: KernelSpec, repo_root: Path = REPO_ROOT) -> list[str]:
    """Repo-relative paths of every file the kernel's op can import from the repository, sorted.

    The manifest's declared sources, the op's module, and transitively every repo-local module
    they import (with the `__init__.py` of each package on the way).
    """
    repo_root = Path(repo_root)
    todo: list[Path] = []
    for s in spec.sources:
        p = repo_root / s
        if not p.is_file():
            raise BuildError(f"kernel {spec.name!r}: declared source {s} does not exist")
        todo.append(p)
    op_mod = spec.op.partition(":")[0]
    op_file = _module_file(op_mod, repo_root)
    if op_file is None:
        raise BuildError(f"kernel {spec.name!r}: op module {op_mod} is not a file in the repository")
    todo += [op_file] + _package_inits(op_mod, repo_root)
    seen: set[Path] = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        if p.suffix != ".py":
            continue
        for mod in _imports_of(p, repo_root):
            f = _module_file(mod, repo_root)
            if f is not None:
                todo.append(f)
                todo += _package_inits(mod, repo_root)
    return sorted(p.relative_to(repo_root).as_posix() for p in seen)


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them (case, and runs of - _ . alike)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def dsl_version() -> str:
    """The DSL's version and those of its backend packages, e.g. "4.8.1 (libs-base 4.8.1,
    libs-core 4.8.1, libs-cu12 4.8.1)". Part of every build key: the backend (cu12 or cu13
    libraries, installed beside the same front-end version) decides the compiler that emits the
    cubin, so two backends must never share a cache entry."""
    try:
        front = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        raise BuildError("nvidia-cutlass-dsl is not installed; the build needs it (pip install -e .)") from None
    prefix = "nvidia-cutlass-dsl-"
    backends = sorted({(name.removeprefix(prefix), d.version)
                       for d in importlib.metadata.distributions()
                       if (name := _normalized(d.metadata["Name"] or "")).startswith(prefix)})
    return front + (" (" + ", ".join(f"{n} {v}" for n, v in backends) + ")" if backends else "")


# -- variants and keys ------------------------------------------------------------------------


def resolve_tunables(spec: KernelSpec, tunables: dict | None) -> dict:
    """The manifest defaults overridden by `tunables`; BuildError on unknown names or values."""
    out = spec.tunable_defaults()
    known = {t.name: t for t in spec.tunables}
    for name, value in (tunables or {}).items():
        if name not in known:
            names = ", ".join(known) or "none"
            raise BuildError(f"kernel {spec.name!r}: unknown tunable {name!r} (tunables: {names})")
        if value not in known[name].choices:
            raise BuildError(
                f"kernel {spec.name!r}: tunable {name}={value!r} is not among its choices "
                f"{list(known[name].choices)}"
            )
        out[name] = value
    return out


def variant_label(shape: dict, tunables: dict) -> str:
    """`batch=4 width=7168 threads=256`: how messages and tables name a variant."""
    return " ".join(f"{k}={v}" for k, v in list(shape.items()) + list(tunables.items()))


def content_key(spec: KernelSpec, shape: dict, tunables: dict, sources: dict[str, str],
                version: str, options: str = COMPILE_OPTIONS, arch: str = ARCH) -> str:
    """The sha256 that names a variant's build folder (see the module docstring for its inputs)."""
    doc = {
        "format": BUILD_FORMAT,
        "kernel": spec.name,
        "op": spec.op,
        "params": [[p.name, p.role, p.direction] for p in spec.params],
        "shape": shape,
        "tunables": tunables,
        "arch": arch,
        "options": options,
        "dsl_version": version,
        "sources": sources,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class _Plan:
    spec: KernelSpec
    shape: dict
    tunables: dict
    key: str
    dir: Path


def _load_cached(plan: _Plan) -> BuildArtifact | None:
    meta_path = plan.dir / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("key") != plan.key or meta.get("format") != BUILD_FORMAT:
            return None
        cubin = (plan.dir / "kernel.cubin").read_bytes()
        if hashlib.sha256(cubin).hexdigest() != meta["hashes"]["cubin_sha256"]:
            return None
        if not all((plan.dir / f).is_file() for f in ("kernel.ptx", "kernel.sass")):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return _artifact(plan, meta, cache_hit=True)


def _artifact(plan: _Plan, meta: dict, cache_hit: bool) -> BuildArtifact:
    paths = {k: plan.dir / f"kernel.{k}" for k in ("ptx", "cubin", "sass")}
    paths["meta"] = plan.dir / "meta.json"
    return BuildArtifact(plan.spec.name, plan.shape, plan.tunables, plan.key, plan.dir, meta, paths, cache_hit)


# -- metadata ---------------------------------------------------------------------------------


def _zip_params(spec: KernelSpec, entry, specs: dict, label: str) -> list[dict]:
    where = f"kernel {spec.name!r} [{label}]"
    if len(entry.params) != len(spec.params):
        raise BuildError(
            f"{where}: the PTX entry has {len(entry.params)} parameters, the manifest declares "
            f"{len(spec.params)} ({', '.join(p.name for p in spec.params)})"
        )
    names = [p.name for p in spec.params]
    if list(specs) != names:
        raise BuildError(
            f"{where}: op.tensor_specs() names {list(specs)}, the manifest's params are {names} "
            "(same names, same order)"
        )
    out = []
    for ptx_p, man_p in zip(entry.params, spec.params):
        s = specs[man_p.name]
        if (s["kind"] == "scalar") != (man_p.role == "scalar"):
            raise BuildError(
                f"{where}: parameter {man_p.name!r} has role {man_p.role!r} but its spec is a {s['kind']}"
            )
        if s["kind"] == "tensor" and s.get("tma") is not None:
            if (ptx_p.size, ptx_p.align) != (TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN):
                raise BuildError(
                    f"{where}: buffer {man_p.name!r} is read by TMA (its spec has a tensor map), so the "
                    f"PTX parameter must be a by-value {TENSOR_MAP_BYTES}-byte tensor map aligned to "
                    f"{TENSOR_MAP_ALIGN}; it is {ptx_p.size} bytes aligned to {ptx_p.align}"
                )
        elif s["kind"] == "tensor" and ptx_p.size != 8:
            raise BuildError(
                f"{where}: buffer {man_p.name!r} is {ptx_p.size} bytes in the PTX, expected one 8-byte "
                "pointer (a static-layout tensor); dynamic layouts are not supported by the launcher"
            )
        out.append({
            "index": ptx_p.index,
            "name": man_p.name,
            "role": man_p.role,
            "direction": man_p.direction,
            "ptx_name": ptx_p.name,
            "ptx_type": ptx_p.type,
            "size": ptx_p.size,
            "align": ptx_p.align,
            "spec": s,
        })
    return out


def _check_block(entry, launch: dict, where: str) -> None:
    bound = entry.block_bound()
    if bound is None:
        return
    kind, dims = bound
    block = tuple(int(b) for b in launch["block"])
    if kind == "reqntid" and block != dims:
        raise BuildError(f"{where}: op.launch_config() block {list(block)} but the PTX requires .reqntid {list(dims)}")
    if kind == "maxntid" and block[0] * block[1] * block[2] > dims[0] * dims[1] * dims[2]:
        raise BuildError(f"{where}: op.launch_config() block {list(block)} exceeds the PTX .maxntid {list(dims)}")


def _check_dynamic_smem(ptx_text: str, launch: dict, where: str) -> None:
    # A kernel that addresses dynamic shared memory launched with none writes out of bounds;
    # the size cannot be read from the PTX, but "some versus none" can.
    symbols = dynamic_shared_symbols(ptx_text)
    if symbols and int(launch.get("smem_bytes", 0)) <= 0:
        raise BuildError(
            f"{where}: the kernel uses dynamic shared memory (.extern .shared {symbols[0]}[]) but "
            "op.launch_config() requests smem_bytes=0"
        )


# Shared memory one CTA may use on sm_90 (the opt-in maximum, static and dynamic together).
SM90_SMEM_PER_CTA = 227 * 1024


def _check_smem_limit(resources: dict, where: str) -> None:
    """A launch asking for more shared memory than one CTA may have fails only on the GPU host
    (`cuFuncSetAttribute` refuses it): refuse the variant here, naming the sizes."""
    dynamic, static = int(resources.get("dynamic_smem_bytes", 0)), int(resources.get("static_smem_bytes", 0))
    if dynamic + static > SM90_SMEM_PER_CTA:
        raise BuildError(f"{where}: needs {dynamic + static} B of shared memory per CTA (dynamic {dynamic}, "
                         f"static {static}); sm_90 allows at most {SM90_SMEM_PER_CTA}: choose smaller tunables")


def _check_tensor_maps(ptx_text: str, params: list[dict], where: str) -> None:
    """A kernel that takes tensor maps must copy by TMA, with boxes of the rank the maps
    declare: the launcher encodes each map from its spec, the kernel's TMA atom was built by the
    DSL, and a mismatch (say, the DSL splitting a box into a 3-d copy) would read the wrong bytes
    silently. Checked: some `cp.async.bulk.tensor` exists, and every one is of the maps' rank."""
    ranks = {len(p["spec"]["tma"]["box"]) for p in params if p["spec"].get("tma")}
    if not ranks:
        return
    copies = {int(n) for n in re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", ptx_text)}
    if not copies:
        raise BuildError(f"{where}: parameters are declared tensor maps but the PTX has no TMA copy "
                         "(cp.async.bulk.tensor)")
    if copies != ranks:
        raise BuildError(f"{where}: the tensor maps are of rank {sorted(ranks)} but the PTX's TMA copies are "
                         f"{sorted(copies)}-d: the op's boxes do not describe what the kernel copies")


def _finish(plan: _Plan, tmp: Path, result: dict, sources: dict[str, str], version: str) -> dict:
    """Parse the worker's PTX/cubin in `tmp`, write kernel.sass and meta.json there; return meta."""
    label = variant_label(plan.shape, plan.tunables)
    where = f"kernel {plan.spec.name!r} [{label}]"
    ptx_text = (tmp / "kernel.ptx").read_text()
    try:
        entry = parse_single_entry(ptx_text, what=f"{where}: PTX")
    except PtxError as e:
        raise BuildError(str(e)) from None
    params = _zip_params(plan.spec, entry, result["specs"], label)
    _check_tensor_maps(ptx_text, params, where)
    launch = dict(result["launch"])
    _check_block(entry, launch, where)
    _check_dynamic_smem(ptx_text, launch, where)
    cubin = tmp / "kernel.cubin"
    sass = _run_tool([find_tool("nvdisasm"), "-c", "-g", cubin], f"{where}: nvdisasm")
    (tmp / "kernel.sass").write_text(sass)
    usage = _run_tool([find_tool("cuobjdump"), "--dump-resource-usage", cubin], f"{where}: cuobjdump")
    resources = parse_resource_usage(usage, entry.name)
    resources.update(local_memory_traffic(sass))
    resources["dynamic_smem_bytes"] = int(launch.get("smem_bytes", 0))
    _check_smem_limit(resources, where)
    meta = {
        "format": BUILD_FORMAT,
        "kernel": plan.spec.name,
        "variant": plan.shape,
        "tunables": plan.tunables,
        "key": plan.key,
        "entry": entry.name,
        "arch": ARCH,
        "options": COMPILE_OPTIONS,
        "dsl_version": version,
        "params": params,
        "launch": launch,
        "ptx_directives": {k: list(v) for k, v in entry.directives.items()},
        "resources": resources,
        "hashes": {
            "cubin_sha256": _sha256_file(cubin),
            # every section but the line tables (kernels/cubin.py): what a comment edit leaves alone
            "cubin_code_sha256": code_sha256(Path(cubin).read_bytes()),
            "ptx_sha256": hashlib.sha256(ptx_text.encode()).hexdigest(),
            "sass_sha256": hashlib.sha256(sass.encode()).hexdigest(),
        },
        "sources": sources,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def _install(tmp: Path, final: Path) -> None:
    os.chmod(tmp, 0o755)  # mkdtemp made it private; a build folder is for every reader
    if final.exists():
        shutil.rmtree(final)
    try:
        os.replace(tmp, final)
    except OSError:
        # Another build of the same key won the race; its folder has the same content.
        if not (final / "meta.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


# -- compile ----------------------------------------------------------------------------------


def _stage(files: Iterable[str], repo_root: Path, into: Path) -> None:
    for rel in files:
        dst = into / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo_root / rel, dst)
        os.utime(dst, (STAGED_MTIME, STAGED_MTIME))


def _worker_env() -> dict:
    # CUTE_DSL_* variables change what the DSL emits (line info, arch, optimisation); the key
    # does not cover them, so the child never sees them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
    env["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
    env["PYTHONHASHSEED"] = "0"
    return env


def _compile_chunk(spec: KernelSpec, plans: list[_Plan], staging: Path, files: list[str],
                   tmps: list[Path], sandbox=None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="fasttrack-job-") as jd:
        job = {
            "op": spec.op,
            "arch": ARCH,
            "options": COMPILE_OPTIONS,
            "roots": sorted({f.split("/")[0] for f in files}),
            "sources": files,
            "results": str(Path(jd) / "results.json"),
            "variants": [
                {"shape": p.shape, "tunables": p.tunables, "out_dir": str(t)} for p, t in zip(plans, tmps)
            ],
        }
        job_path = Path(jd) / "job.json"
        job_path.write_text(json.dumps(job))
        cmd, env = [sys.executable, "-I", str(WORKER), str(job_path)], _worker_env()
        if sandbox is not None:  # kernels/sandbox.py: the worker imports the (untrusted) sources
            cmd = sandbox.command(cmd, env={k: env[k] for k in ("CUTE_DSL_DISABLE_FILE_CACHING", "PYTHONHASHSEED")},
                                  read=[staging, WORKER], write=[jd, *tmps], cwd=staging)
            env = None
        try:
            proc = subprocess.run(
                cmd, cwd=staging, env=env, capture_output=True, text=True,
                timeout=COMPILE_TIMEOUT_S * len(plans),
            )
        except subprocess.TimeoutExpired:
            raise BuildError(
                f"kernel {spec.name!r}: compiling {len(plans)} variant(s) took over "
                f"{COMPILE_TIMEOUT_S * len(plans)} s; gave up"
            ) from None
        try:
            results = json.loads(Path(job["results"]).read_text())
        except (OSError, ValueError):
            results = []
        if len(results) < len(plans):
            tail = (proc.stderr or proc.stdout).strip()[-800:]
            crashed = plans[len(results)]
            results.append({
                "ok": False, "file": None, "line": None, "type": "crash",
                "error": f"the compiler process died (exit {proc.returncode}) while compiling "
                         f"[{variant_label(crashed.shape, crashed.tunables)}]: {tail}",
            })
            results += [{"ok": False, "skipped": True}] * (len(plans) - len(results))
        return results


def _error_message(spec: KernelSpec, plan: _Plan, result: dict) -> str:
    where = f"kernel {spec.name!r} [{variant_label(plan.shape, plan.tunables)}]"
    loc = f"{result['file']}:{result['line']}: " if result.get("file") else ""
    return f"{where}: {loc}{result['error']}"


def _plans(spec: KernelSpec, variants: list[tuple[dict, dict]], root: Path, repo_root: Path):
    files = source_closure(spec, repo_root)
    sources = {f: _sha256_file(repo_root / f) for f in files}
    version = dsl_version()
    plans = []
    for shape, tun in variants:
        key = content_key(spec, shape, tun, sources, version)
        plans.append(_Plan(spec, shape, tun, key, root / spec.name / key[:16]))
    return files, sources, version, plans


def _build(spec: KernelSpec, variants: list[tuple[dict, dict]], *, root: Path, force: bool,
           progress: Callable | None, jobs: int | None, repo_root: Path,
           executor: "BuildExecutor | None" = None, sandbox=None) -> list[BuildArtifact]:
    results = build_requests([BuildRequest(spec, shape, tun, Path(repo_root)) for shape, tun in variants],
                             root=root, force=force, progress=progress, jobs=jobs, executor=executor,
                             sandbox=sandbox)
    errors = [r for r in results if isinstance(r, BuildError)]
    if errors:
        more = len(errors) - 1
        raise BuildError(str(errors[0]) + (f" (and {more} more variant(s) failed)" if more else ""))
    return results


# -- executors: where compile tasks run ------------------------------------------------------
#
# A compile task is one chunk of variants of one kernel at one source tree, self-contained (the
# staged source bytes travel with it, the built files come back as bytes), so it runs the same in
# a local worker thread (each drives one compile child process: a process pool) or on a Ray worker
# of another host. The driver installs what comes back into the content-addressed cache.


@dataclass(frozen=True)
class BuildRequest:
    """One variant to build: a kernel spec, its shape and resolved tunables, the source tree."""

    spec: KernelSpec
    shape: dict
    tunables: dict
    repo_root: Path = REPO_ROOT


def _compile_task(task: dict) -> list[dict]:
    """Compile one chunk (`task`: spec, plans, files {rel: bytes}, sources, version) on this
    host; per variant {"ok": True, "meta", "blobs": {name: bytes}} or {"ok": False, "error"}.
    Needs the DSL and nvdisasm/cuobjdump here; touches no cache."""
    spec, plans = task["spec"], task["plans"]
    out: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fasttrack-task-") as td:
        staging = Path(td) / "src"
        for rel, data in task["files"].items():
            dst = staging / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            os.utime(dst, (STAGED_MTIME, STAGED_MTIME))
        tmps = [Path(td) / f"v{i}" for i in range(len(plans))]
        for t in tmps:  # made here: a sandboxed worker may write only folders that exist
            t.mkdir()
        results = _compile_chunk(spec, plans, staging, sorted(task["files"]), tmps, task.get("sandbox"))
        for plan, tmp, res in zip(plans, tmps, results):
            if res.get("skipped"):
                out.append({"ok": False, "skipped": True})
            elif not res["ok"]:
                out.append({"ok": False, "error": _error_message(spec, plan, res)})
            else:
                try:
                    meta = _finish(plan, tmp, res, task["sources"], task["version"])
                except BuildError as e:
                    out.append({"ok": False, "error": str(e)})
                    continue
                out.append({"ok": True, "meta": meta,
                            "blobs": {f.name: f.read_bytes() for f in tmp.iterdir() if f.is_file()}})
    return out


class BuildExecutor:
    """Runs compile tasks; `run(tasks)` yields (task index, results) as tasks complete."""

    name = "executor"

    def run(self, tasks: list[dict]):  # pragma: no cover - interface
        raise NotImplementedError


class LocalExecutor(BuildExecutor):
    """Up to `jobs` compile child processes at a time on this host (default: the CPU count, at
    most 4: each child holds the DSL, ~1 GB)."""

    name = "local"

    def __init__(self, jobs: int | None = None):
        self.jobs = max(1, jobs or min(4, os.cpu_count() or 1))

    def run(self, tasks: list[dict]):
        with concurrent.futures.ThreadPoolExecutor(min(self.jobs, max(1, len(tasks)))) as pool:
            futs = {pool.submit(_compile_task, t): i for i, t in enumerate(tasks)}
            for fut in concurrent.futures.as_completed(futs):
                yield futs[fut], fut.result()


class RayExecutor(BuildExecutor):
    """Compile tasks as Ray tasks on a cluster of build hosts (`pip install -e '.[ray]'`); each
    host needs this package importable, the DSL and the CUDA binary tools. `address`: a running
    cluster ("auto", "ray://host:10001", "127.0.0.1:6379"); None starts a local one."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: float = 1):
        try:
            import ray
        except ImportError:
            raise BuildError("the ray executor needs ray: pip install -e '.[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            env = {"env_vars": {"PYTHONPATH": str(REPO_ROOT)}}
            ray.init(address=address, runtime_env=env, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        self.remote = ray.remote(num_cpus=num_cpus, max_retries=0)(_compile_task)

    def run(self, tasks: list[dict]):
        refs = {self.remote.remote(t): i for i, t in enumerate(tasks)}
        pending = list(refs)
        while pending:
            done, pending = self.ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    res = self.ray.get(ref)
                except Exception as e:  # a lost node, a worker crash: every variant of the task fails
                    res = [{"ok": False, "error": f"ray task failed: {type(e).__name__}: {e}"}] * len(
                        tasks[refs[ref]]["plans"])
                yield refs[ref], res


EXECUTOR_ENV = "FASTTRACK_BUILD_EXECUTOR"


def make_executor(spec: str | None = None, jobs: int | None = None) -> BuildExecutor:
    """The executor `spec` names: "local" (default), "ray" (a local Ray cluster, or the one
    RAY_ADDRESS names) or "ray:ADDRESS"; default from $FASTTRACK_BUILD_EXECUTOR."""
    spec = spec or os.environ.get(EXECUTOR_ENV) or "local"
    if spec == "local":
        return LocalExecutor(jobs)
    if spec == "ray" or spec.startswith("ray:"):
        return RayExecutor(spec.partition(":")[2] or os.environ.get("RAY_ADDRESS") or None)
    raise BuildError(f"unknown build executor {spec!r}: local, ray or ray:ADDRESS")


def build_requests(requests: list[BuildRequest], *, root: Path = DEFAULT_ROOT, force: bool = False,
                   progress: Callable | None = None, jobs: int | None = None,
                   executor: BuildExecutor | None = None, sandbox=None) -> list["BuildArtifact | BuildError"]:
    """Build many variants, of any kernels and source trees, at once: cache hits first, then the
    misses as compile tasks (a chunk of one kernel at one tree each) on `executor` (default: the
    local one with `jobs` processes), each compile child inside `sandbox` when given. Returns, in
    request order, each artifact or the BuildError of its variant (nothing raised for a variant's
    compile error)."""
    root = Path(root).resolve()
    out: list = [None] * len(requests)
    total, done = len(requests), 0
    groups: dict[tuple, list[int]] = {}
    prepared: dict[tuple, tuple] = {}
    version: list[str] = []  # read once per call (it walks every installed distribution)
    for i, rq in enumerate(requests):
        gkey = (rq.spec.name, str(Path(rq.repo_root).resolve()), id(rq.spec))
        if gkey not in prepared:
            try:
                files = source_closure(rq.spec, rq.repo_root)
                sources = {f: _sha256_file(Path(rq.repo_root) / f) for f in files}
                version = version or [dsl_version()]
                prepared[gkey] = (files, sources, version[0])
            except BuildError as e:
                prepared[gkey] = e
        prep = prepared[gkey]
        if isinstance(prep, BuildError):
            out[i] = prep
            continue
        files, sources, version = prep
        key = content_key(rq.spec, rq.shape, rq.tunables, sources, version)
        plan = _Plan(rq.spec, dict(rq.shape), dict(rq.tunables), key, root / rq.spec.name / key[:16])
        hit = None if force else _load_cached(plan)
        if hit is not None:
            out[i] = hit
            done += 1
            if progress:
                progress(done, total, hit)
            continue
        out[i] = plan
        groups.setdefault(gkey, []).append(i)
    if not groups:
        return out
    find_tool("nvdisasm"), find_tool("cuobjdump")  # fail before compiling, not after
    executor = executor or LocalExecutor(jobs)
    workers = getattr(executor, "jobs", None) or 8
    n_missing = sum(len(v) for v in groups.values())
    size = max(1, min(MAX_VARIANTS_PER_WORKER, -(-n_missing // workers)))
    tasks, members = [], []
    for gkey, idx in groups.items():
        files, sources, version = prepared[gkey]
        repo_root = Path(requests[idx[0]].repo_root)
        (root / requests[idx[0]].spec.name).mkdir(parents=True, exist_ok=True)
        blobs = {f: (repo_root / f).read_bytes() for f in files}
        for c in range(0, len(idx), size):
            chunk = idx[c:c + size]
            tasks.append({"spec": requests[chunk[0]].spec, "plans": [out[i] for i in chunk],
                          "files": blobs, "sources": sources, "version": version, "sandbox": sandbox})
            members.append(chunk)
    for t, results in executor.run(tasks):
        for i, res in zip(members[t], results):
            plan = out[i]
            if res.get("skipped"):
                out[i] = BuildError(f"kernel {plan.spec.name!r} [{variant_label(plan.shape, plan.tunables)}]: "
                                    "not compiled (an earlier variant of its batch crashed the compiler)")
                continue
            if not res["ok"]:
                out[i] = BuildError(res["error"])
                continue
            out[i] = _install_blobs(plan, res["meta"], res["blobs"])
            done += 1
            if progress:
                progress(done, total, out[i])
    return out


def _install_blobs(plan: _Plan, meta: dict, blobs: dict[str, bytes]) -> BuildArtifact:
    """Write a task's files into a fresh folder beside the cache entry and install it atomically."""
    plan.dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{plan.key[:16]}-", dir=plan.dir.parent))
    try:
        for name, data in blobs.items():
            (tmp / Path(name).name).write_bytes(data)
        _install(tmp, plan.dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _artifact(plan, meta, cache_hit=False)


# -- public API -------------------------------------------------------------------------------


def _spec(kernel: str, manifest: Manifest | None) -> KernelSpec:
    try:
        return (manifest or load_manifest()).kernel(kernel)
    except ManifestError as e:
        raise BuildError(str(e)) from None


def build_variant(kernel: str, shape: dict, tunables: dict | None = None, *, root: Path = DEFAULT_ROOT,
                  force: bool = False, manifest: Manifest | None = None,
                  repo_root: Path = REPO_ROOT) -> BuildArtifact:
    """Build one variant of `kernel` (a shape dict, tunables over the manifest defaults).

    Returns the artifact from the cache when its content key is already built (unless `force`);
    otherwise compiles in a child process and installs the folder atomically. Raises BuildError
    naming the kernel, the variant and, for a compile error, the source file and line.
    """
    spec = _spec(kernel, manifest)
    tun = resolve_tunables(spec, tunables)
    return _build(spec, [(dict(shape), tun)], root=Path(root), force=force, progress=None, jobs=1,
                  repo_root=Path(repo_root))[0]


def build_kernel(kernel: str, *, shapes: list[dict] | None = None, tunables: dict | None = None,
                 root: Path = DEFAULT_ROOT, progress: Callable | None = None, force: bool = False,
                 jobs: int | None = None, manifest: Manifest | None = None,
                 repo_root: Path = REPO_ROOT, executor: BuildExecutor | None = None,
                 sandbox=None) -> list[BuildArtifact]:
    """Build `kernel` for `shapes` (default: every manifest variant) with the same tunables.

    Compiles the variants that are not cached on `executor` (default: up to `jobs` local child
    processes, `LocalExecutor`). `progress(done, total, artifact)` is called after each variant.
    Artifacts come back in the order of `shapes`. With `sandbox` (a kernels.sandbox.Sandbox)
    each compile child, which imports the sources, runs inside it: it sees the staged sources
    read-only and writes only its own output folders (the cache's other entries stay out of
    its reach).
    """
    spec = _spec(kernel, manifest)
    tun = resolve_tunables(spec, tunables)
    variants = [(dict(s), dict(tun)) for s in (shapes if shapes is not None else spec.shapes)]
    return _build(spec, variants, root=Path(root), force=force, progress=progress, jobs=jobs,
                  repo_root=Path(repo_root), executor=executor, sandbox=sandbox)


def build_all(kernels: list[str] | None = None, *, root: Path = DEFAULT_ROOT, progress: Callable | None = None,
              force: bool = False, jobs: int | None = None, manifest: Manifest | None = None,
              repo_root: Path = REPO_ROOT, executor: BuildExecutor | None = None) -> list[BuildArtifact]:
    """Build every manifest variant of `kernels` (default: all kernels), each at the tunables it
    ships with (kernels.block.shipped_tunables: the defaults under the block plan), in manifest
    order, all in one pool (`build_requests`: the variants of every kernel compile side by side).

    `progress(done, total, artifact)` counts over all kernels. Raises the first BuildError.
    """
    from kernels.block import plan_in_tree, shipped_tunables  # kernels.block imports this module

    man = manifest or load_manifest()
    names = list(kernels) if kernels else list(man.kernels)
    specs = [_spec(n, man) for n in names]  # unknown names fail before anything compiles
    plan = plan_in_tree(Path(repo_root)) or {}
    reqs = [BuildRequest(spec, dict(shape), shipped_tunables(spec, shape, plan), Path(repo_root))
            for spec in specs for shape in spec.shapes]
    out = build_requests(reqs, root=root, force=force, progress=progress, jobs=jobs, executor=executor)
    errors = [r for r in out if isinstance(r, BuildError)]
    if errors:
        more = len(errors) - 1
        raise BuildError(str(errors[0]) + (f" (and {more} more variant(s) failed)" if more else ""))
    return out


def find_artifact(kernel: str, shape: dict, tunables: dict | None = None, *, root: Path = DEFAULT_ROOT,
                  manifest: Manifest | None = None, repo_root: Path = REPO_ROOT) -> BuildArtifact:
    """The existing build of one variant, verified against today's sources; compiles nothing.

    For hosts without the DSL (the GPU host runs what a CPU host built and carried over): the
    folder's content key is recomputed from the current source files and the DSL version the
    folder records, so a stale build (any hashed source changed since) is refused, naming the
    changed files. Raises BuildError when no current build exists.
    """
    spec = _spec(kernel, manifest)
    tun = resolve_tunables(spec, tunables)
    shape = dict(shape)
    label = f"kernel {kernel!r} [{variant_label(shape, tun)}]"
    files = source_closure(spec, repo_root)
    sources = {f: _sha256_file(Path(repo_root) / f) for f in files}
    stale: list[str] = []
    for meta_path in sorted((Path(root) / kernel).glob("*/meta.json")):
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("variant") != shape or meta.get("tunables") != tun or meta.get("format") != BUILD_FORMAT:
                continue
            key = content_key(spec, shape, tun, sources, meta["dsl_version"], meta["options"], meta["arch"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        plan = _Plan(spec, shape, tun, key, meta_path.parent)
        if key == meta["key"] and meta_path.parent.name == key[:16]:
            hit = _load_cached(plan)
            if hit is not None:
                return hit
        changed = sorted(f for f in set(sources) | set(meta.get("sources", {}))
                         if sources.get(f) != meta.get("sources", {}).get(f))
        stale.append(f"{meta_path.parent.name} (changed since: {', '.join(changed) or 'build inputs'})")
    if stale:
        raise BuildError(f"{label}: only stale builds under {root}: {'; '.join(stale)}; rebuild with `fasttrack build {kernel}`")
    raise BuildError(f"{label}: not built under {root}; run `fasttrack build {kernel}` on a host with the DSL")


def load_artifact(build_dir: Path) -> dict:
    """The meta.json of a build folder (for tools that only read)."""
    return json.loads((Path(build_dir) / "meta.json").read_text())


def artifact_summary(art: BuildArtifact) -> dict[str, Any]:
    """The audit-ready row of one artifact (what `fasttrack build` prints)."""
    r = art.meta["resources"]
    return {
        "kernel": art.kernel,
        "variant": variant_label(art.shape, art.tunables),
        "entry": art.meta["entry"],
        "registers": r["registers"],
        "spill_store_bytes": r["spill_store_bytes"],
        "spill_load_bytes": r["spill_load_bytes"],
        "local_bytes": r["local_bytes"],
        "static_smem_bytes": r["static_smem_bytes"],
        "dynamic_smem_bytes": r["dynamic_smem_bytes"],
        "cubin_sha256": art.cubin_sha256,
        "key": art.key,
        "dir": str(art.dir),
        "cache_hit": art.cache_hit,
    }
