"""The AOT build: source closure, content keys, cache hits, determinism, metadata, compile errors.

Compiles only the tiny fixture kernels of tests/fixtures (about a second each), and few times:
one module-scoped build is shared by most tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels import build
from kernels.build import BuildError, build_kernel, build_variant, content_key, source_closure
from kernels.manifest import REPO_ROOT, load_manifest, parse_manifest
from kernels.ptx import PtxError, parse_entries, parse_single_entry
from validation.cli import main as cli_main

FIXTURES = Path(__file__).parent / "fixtures"
MANIFEST_PATH = FIXTURES / "manifest.toml"
SHAPE = {"rows": 4, "cols": 96}


@pytest.fixture(scope="module")
def manifest():
    return load_manifest(MANIFEST_PATH)


@pytest.fixture(scope="module")
def built(manifest, tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    art = build_variant("scale", SHAPE, root=root, manifest=manifest)
    return root, art


# -- sources and keys (no compile) ------------------------------------------------------------


def test_source_closure_follows_repo_imports(tmp_path):
    (tmp_path / "pkg" / "ops").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "ops" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "ops" / "base.py").write_text("import os\n")
    (tmp_path / "pkg" / "ops" / "helper.py").write_text("from . import base\n")
    (tmp_path / "pkg" / "ops" / "lazy.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "unused.py").write_text("")
    (tmp_path / "pkg" / "ops" / "op.py").write_text(
        "import torch\nfrom pkg.ops.helper import thing\n"
        "def f():\n    from .lazy import X  # imported inside a function still counts\n"
    )
    man = parse_manifest(
        '[kernels.k]\nop = "pkg.ops.op:Op"\nreference = "r:f"\nsources = ["pkg/ops/op.py"]\n'
        'params = [{ name = "x", role = "activation" }]\n[kernels.k.shapes]\nn = [1]\n'
    )
    assert source_closure(man.kernel("k"), tmp_path) == [
        "pkg/__init__.py", "pkg/ops/__init__.py", "pkg/ops/base.py", "pkg/ops/helper.py",
        "pkg/ops/lazy.py", "pkg/ops/op.py",
    ]


def test_source_closure_finds_imports_nested_in_any_statement_and_reads_each_files_bytes(tmp_path, monkeypatch):
    """Imports under if/try/except/with/class/def/match count; a file's imports are parsed once
    per (path, bytes) (the base and head trees share most files), and new bytes are parsed anew."""
    from kernels import build as B

    def tree(root, extra=""):
        (root / "pkg").mkdir(parents=True)
        (root / "pkg" / "__init__.py").write_text("")
        for m in ("a", "b", "c", "d", "e", "f", "g"):
            (root / "pkg" / f"{m}.py").write_text("")
        (root / "pkg" / "op.py").write_text(
            "if X:\n    import pkg.a\nelse:\n    pass\n"
            "try:\n    pass\nexcept ImportError:\n    from pkg import b\nfinally:\n    pass\n"
            "with ctx():\n    from . import c\n"
            "class K:\n    def m(self):\n        for _ in y:\n            import pkg.d\n"
            "match v:\n    case 1:\n        import pkg.e\n"
            "while w:\n    import pkg.f\n" + extra)
        return root

    man = parse_manifest(
        '[kernels.k]\nop = "pkg.op:Op"\nreference = "r:f"\nsources = ["pkg/op.py"]\n'
        'params = [{ name = "x", role = "activation" }]\n[kernels.k.shapes]\nn = [1]\n'
    )
    parsed = []
    real = B._parse_imports
    monkeypatch.setattr(B, "_IMPORTS", {})
    monkeypatch.setattr(B, "_parse_imports", lambda data, rel: parsed.append(rel.as_posix()) or real(data, rel))
    want = ["pkg/__init__.py"] + [f"pkg/{m}.py" for m in "abcdef"] + ["pkg/op.py"]
    assert source_closure(man.kernel("k"), tree(tmp_path / "base")) == want
    n = len(parsed)
    assert source_closure(man.kernel("k"), tree(tmp_path / "head")) == want and len(parsed) == n
    assert source_closure(man.kernel("k"), tree(tmp_path / "new", "import pkg.g\n")) == sorted(want + ["pkg/g.py"])
    assert parsed.count("pkg/op") == 2


def test_source_closure_of_fixture_includes_the_op_contract(manifest):
    files = source_closure(manifest.kernel("scale"))
    assert "kernels/ops/base.py" in files and "tests/fixtures/scale_op.py" in files
    assert "tests/fixtures/broken_op.py" not in files


def test_missing_declared_source_is_a_build_error(tmp_path):
    man = parse_manifest(
        '[kernels.k]\nop = "pkg.op:Op"\nreference = "r:f"\nsources = ["pkg/op.py"]\n'
        'params = [{ name = "x", role = "activation" }]\n[kernels.k.shapes]\nn = [1]\n'
    )
    with pytest.raises(BuildError, match="kernel 'k': declared source pkg/op.py does not exist"):
        source_closure(man.kernel("k"), tmp_path)


def test_content_key_covers_its_inputs(manifest):
    spec = manifest.kernel("scale")
    base = dict(spec=spec, shape=SHAPE, tunables={"threads": 64}, sources={"a.py": "0"}, version="4.8.1")
    k0 = content_key(**base)
    assert k0 == content_key(**base)
    for change in (
        {"shape": {"rows": 8, "cols": 96}},
        {"tunables": {"threads": 128}},
        {"sources": {"a.py": "1"}},
        {"version": "4.8.2"},
        {"options": ""},
        {"arch": "sm_90"},
    ):
        assert content_key(**{**base, **change}) != k0, change


def test_tunables_are_checked_against_the_manifest(manifest, tmp_path):
    with pytest.raises(BuildError, match="unknown tunable 'block' \\(tunables: threads\\)"):
        build_variant("scale", SHAPE, {"block": 3}, root=tmp_path, manifest=manifest)
    with pytest.raises(BuildError, match=r"threads=48 is not among its choices \[32, 64, 128\]"):
        build_variant("scale", SHAPE, {"threads": 48}, root=tmp_path, manifest=manifest)
    with pytest.raises(BuildError, match="unknown kernel 'nope'"):
        build_variant("nope", SHAPE, root=tmp_path, manifest=manifest)
    assert not any(tmp_path.iterdir())


# -- one real build ---------------------------------------------------------------------------


def test_build_writes_the_folder_and_metadata(built):
    root, art = built
    assert not art.cache_hit
    assert art.dir == root / "scale" / art.key[:16]
    assert sorted(p.name for p in art.dir.iterdir()) == ["kernel.cubin", "kernel.ptx", "kernel.sass", "meta.json"]
    meta = json.loads((art.dir / "meta.json").read_text())
    assert meta == art.meta
    assert meta["kernel"] == "scale" and meta["variant"] == SHAPE and meta["tunables"] == {"threads": 64}
    assert meta["entry"] == parse_single_entry((art.dir / "kernel.ptx").read_text()).name
    assert [(p["name"], p["role"], p["direction"], p["ptx_type"], p["size"]) for p in meta["params"]] == [
        ("x", "activation", "in", "b8", 8),
        ("alpha", "scalar", "in", "f32", 4),
        ("n", "scalar", "in", "u32", 4),
        ("y", "activation", "out", "b8", 8),
    ]
    assert meta["params"][0]["spec"] == {"kind": "tensor", "shape": [4, 96], "dtype": "float32"}
    assert meta["launch"] == {"grid": [6, 1, 1], "block": [64, 1, 1], "smem_bytes": 0, "cooperative": False}
    assert meta["ptx_directives"] == {"reqntid": [64, 1, 1]}
    res = meta["resources"]
    assert 0 < res["registers"] <= 255
    assert res["spill_store_bytes"] == res["spill_load_bytes"] == res["local_bytes"] == 0
    assert meta["sources"]["tests/fixtures/scale_op.py"] == build._sha256_file(REPO_ROOT / "tests/fixtures/scale_op.py")
    # Line info maps the SASS back to the op's source, by repo-relative name.
    assert 'File "tests/fixtures/scale_op.py", line' in (art.dir / "kernel.sass").read_text()
    # Nothing of this machine's file system leaks into what gets committed as evidence.
    for f in art.dir.iterdir():
        assert str(REPO_ROOT).encode() not in f.read_bytes(), f.name


def test_rebuild_is_a_cache_hit_without_compiling(built, manifest, monkeypatch):
    root, art = built

    def no_compile(*a, **k):
        raise AssertionError("compiled on a cache hit")

    monkeypatch.setattr(build.subprocess, "run", no_compile)
    again = build_variant("scale", SHAPE, root=root, manifest=manifest)
    assert again.cache_hit and again.key == art.key and again.meta == art.meta
    # Defaults spelled out are the same variant.
    assert build_variant("scale", SHAPE, {"threads": 64}, root=root, manifest=manifest).cache_hit


def test_tampered_cache_is_rebuilt(built, manifest, tmp_path):
    root, art = built
    copy = tmp_path / "build"
    shutil.copytree(root, copy)
    cubin = copy / "scale" / art.key[:16] / "kernel.cubin"
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    again = build_variant("scale", SHAPE, root=copy, manifest=manifest)
    assert not again.cache_hit
    assert again.paths["cubin"].read_bytes() == art.paths["cubin"].read_bytes()


def test_identical_inputs_give_identical_bytes_on_another_checkout(built, manifest, tmp_path):
    """Fresh processes, cache bypassed, sources copied elsewhere with new mtimes: same bytes."""
    _, art = built
    clone = tmp_path / "elsewhere" / "checkout"
    for rel in art.meta["sources"]:
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO_ROOT / rel, clone / rel)  # new mtime: it reaches the DWARF unless staged
    other = build_variant("scale", SHAPE, root=tmp_path / "b2", manifest=manifest, repo_root=clone, force=True)
    assert not other.cache_hit and other.key == art.key
    for name in ("kernel.cubin", "kernel.ptx", "kernel.sass", "meta.json"):
        assert (other.dir / name).read_bytes() == (art.dir / name).read_bytes(), name


def test_committed_prebuilt_fixture_is_current(built):
    """tests/fixtures/prebuilt/scale (the GPU launch test's binary) is what the build makes today."""
    _, art = built
    pre = FIXTURES / "prebuilt" / "scale"
    assert (pre / "kernel.cubin").read_bytes() == art.paths["cubin"].read_bytes(), (
        "rebuild it: copy the kernel.* and meta.json of `fasttrack build --manifest "
        "tests/fixtures/manifest.toml scale` into tests/fixtures/prebuilt/scale"
    )
    # The key and source hashes move whenever a shared file (kernels/ops/base.py) is edited;
    # what the launcher reads must not.
    volatile = ("key", "sources")
    committed = {k: v for k, v in json.loads((pre / "meta.json").read_text()).items() if k not in volatile}
    assert committed == {k: v for k, v in art.meta.items() if k not in volatile}


def test_real_ptx_parameters(built):
    _, art = built
    entries = parse_entries(art.paths["ptx"].read_text())
    assert len(entries) == 1
    e = entries[0]
    assert [(p.index, p.type, p.size, p.align, p.array) for p in e.params] == [
        (0, "b8", 8, 8, 8), (1, "f32", 4, 4, None), (2, "u32", 4, 4, None), (3, "b8", 8, 8, 8),
    ]
    assert all(p.name == f"{e.name}_param_{p.index}" for p in e.params)
    assert e.block_bound() == ("reqntid", (64, 1, 1))


def test_param_count_mismatch_names_the_kernel(built):
    _, art = built
    entry = parse_single_entry(art.paths["ptx"].read_text())
    man = parse_manifest(
        '[kernels.scale]\nop = "tests.fixtures.scale_op:ScaleOp"\nreference = "r:f"\n'
        'sources = ["tests/fixtures/scale_op.py"]\n'
        'params = [{ name = "x", role = "activation" }, { name = "y", role = "activation", direction = "out" }]\n'
        "[kernels.scale.shapes]\nrows = [4]\n"
    )
    specs = {p["name"]: p["spec"] for p in art.meta["params"]}
    with pytest.raises(BuildError, match=r"kernel 'scale' \[rows=4\]: the PTX entry has 4 parameters, "
                                         r"the manifest declares 2 \(x, y\)"):
        build._zip_params(man.kernel("scale"), entry, specs, "rows=4")
    # Same count, but a buffer declared as a scalar.
    swapped = load_manifest(MANIFEST_PATH).kernel("scale")
    specs["alpha"] = {"kind": "tensor", "shape": [1], "dtype": "float32"}
    with pytest.raises(BuildError, match="parameter 'alpha' has role 'scalar' but its spec is a tensor"):
        build._zip_params(swapped, entry, specs, "rows=4")


def test_block_must_match_reqntid(built):
    _, art = built
    entry = parse_single_entry(art.paths["ptx"].read_text())
    with pytest.raises(BuildError, match=r"block \[128, 1, 1\] but the PTX requires .reqntid \[64, 1, 1\]"):
        build._check_block(entry, {"block": [128, 1, 1]}, "kernel 'scale'")


# -- errors -----------------------------------------------------------------------------------


def test_compile_error_names_kernel_variant_file_and_line(manifest, tmp_path):
    src = (FIXTURES / "broken_op.py").read_text().splitlines()
    line = next(i for i, s in enumerate(src, 1) if "undefined_name" in s and "mY[" in s)
    with pytest.raises(BuildError) as ei:
        build_kernel("broken", root=tmp_path, manifest=manifest)
    msg = str(ei.value)
    assert msg.startswith(f"kernel 'broken' [n=32]: tests/fixtures/broken_op.py:{line}: ")
    assert "undefined_name" in msg and "\n" not in msg and "\x1b" not in msg
    # Nothing half-built is left behind.
    assert list((tmp_path / "broken").iterdir()) == []


def test_ptx_parser_rejects_zero_or_many_entries():
    ptx = ".visible .entry a(\n\t.param .u64 .ptr .global .align 16 a_p0\n)\n.maxntid 256\n{\n}\n"
    (e,) = parse_entries(ptx)
    assert (e.params[0].type, e.params[0].size, e.params[0].align, e.params[0].state_space) == ("u64", 8, 16, "global")
    assert e.block_bound() == ("maxntid", (256, 1, 1))
    with pytest.raises(PtxError, match="expected exactly one .entry, found 2 \\(a, b\\)"):
        parse_single_entry(ptx + ".entry b()\n{\n}\n")
    with pytest.raises(PtxError, match="found 0"):
        parse_single_entry(".version 8.8\n.func f()\n{\n}\n")


def test_resource_and_spill_parsing():
    text = (
        "\nResource usage:\n Common:\n  GLOBAL:0\n Function k2:\n  REG:40 STACK:0 SHARED:0 LOCAL:0\n"
        " Function k:\n  REG:168 STACK:16 SHARED:2048 LOCAL:24 CONSTANT[0]:552 TEXTURE:0\n"
    )
    assert build.parse_resource_usage(text, "k") == {
        "registers": 168, "stack_bytes": 16, "local_bytes": 24, "static_smem_bytes": 2048, "param_const_bytes": 552,
    }
    with pytest.raises(BuildError, match="no resource usage for k3"):
        build.parse_resource_usage(text, "k3")
    sass = "  STL.64 [R1+0x8], R4 ;\n  LDL R5, [R1] ;\n  LDL.128 R8, [R1+0x10] ;\n  ULDC.64 UR4, c[0x0][0x208] ;\n"
    assert build.local_memory_traffic(sass) == {"spill_store_bytes": 8, "spill_load_bytes": 20}


def test_tools_are_found():
    for tool in ("nvdisasm", "cuobjdump"):
        path = build.find_tool(tool)
        assert subprocess.run([str(path), "--version"], capture_output=True).returncode == 0


# -- `fasttrack build` ------------------------------------------------------------------------


def test_cli_unknown_kernel_exits_2(capsys):
    assert cli_main(["build", "no_such_kernel"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fasttrack build: unknown kernel 'no_such_kernel'; the manifest declares:")
    assert len(err.strip().splitlines()) == 1


def test_cli_json_and_table_from_the_cache(built, capsys):
    root, art = built
    args = ["build", "--manifest", str(MANIFEST_PATH), "--root", str(root), "scale"]
    assert cli_main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out) == 1 and out[0]["cache_hit"] is True and out[0]["meta"] == art.meta
    assert cli_main(args) == 0
    table = capsys.readouterr().out
    assert "rows=4 cols=96 threads=64" in table and art.cubin_sha256[:12] in table and "yes" in table


def test_cli_compile_error_is_one_line_exit_1(capsys, tmp_path):
    code = cli_main(["build", "--manifest", str(MANIFEST_PATH), "--root", str(tmp_path), "broken"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("fasttrack build: kernel 'broken' [n=32]: tests/fixtures/broken_op.py:")
    assert "Traceback" not in err


def test_find_artifact_verifies_sources_without_the_dsl(built, manifest, tmp_path, monkeypatch):
    """What a GPU host (no DSL) does: find the carried build of a variant, refuse a stale one."""
    root, art = built
    monkeypatch.setattr(build, "dsl_version", lambda: (_ for _ in ()).throw(AssertionError("needs no DSL")))
    found = build.find_artifact("scale", SHAPE, root=root, manifest=manifest)
    assert found.key == art.key and found.dir == art.dir and found.cache_hit
    with pytest.raises(BuildError, match=r"kernel 'scale' \[rows=8 cols=96 threads=64\]: not built under"):
        build.find_artifact("scale", {"rows": 8, "cols": 96}, root=root, manifest=manifest)
    # A checkout whose op source differs from what was built: the build is stale.
    clone = tmp_path / "checkout"
    for rel in art.meta["sources"]:
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO_ROOT / rel, clone / rel)
    (clone / "tests/fixtures/scale_op.py").write_text((clone / "tests/fixtures/scale_op.py").read_text() + "\n# edit\n")
    with pytest.raises(BuildError, match=r"only stale builds .*changed since: tests/fixtures/scale_op.py"):
        build.find_artifact("scale", SHAPE, root=root, manifest=manifest, repo_root=clone)


def test_dynamic_shared_memory_must_be_requested():
    ptx = (".visible .entry k(\n)\n{\n\t.extern .shared .align 16 .b8 __dynamic_shmem__0[];\n\tret;\n}\n"
           "// .extern .shared .b8 commented_out[];\n")
    from kernels.ptx import dynamic_shared_symbols

    assert dynamic_shared_symbols(ptx) == ["__dynamic_shmem__0"]
    with pytest.raises(BuildError, match=r"uses dynamic shared memory \(.extern .shared __dynamic_shmem__0\[\]\) "
                                         r"but op.launch_config\(\) requests smem_bytes=0"):
        build._check_dynamic_smem(ptx, {"smem_bytes": 0}, "kernel 'k'")
    build._check_dynamic_smem(ptx, {"smem_bytes": 16}, "kernel 'k'")
    build._check_dynamic_smem(".visible .entry k(\n)\n{\n}\n", {"smem_bytes": 0}, "kernel 'k'")


def test_shared_memory_over_the_sm90_limit_is_refused():
    """A variant whose CTA needs more shared memory than sm_90 gives one (the latent_out mma
    design at batch 64 with 16 warps of 4 row tiles asked for 262208 B and failed only at
    cuFuncSetAttribute on the GPU host) is refused by the build, naming both sizes."""
    limit = build.SM90_SMEM_PER_CTA
    assert limit == 232448
    build._check_smem_limit({"dynamic_smem_bytes": limit - 1024, "static_smem_bytes": 1024}, "kernel 'k'")
    with pytest.raises(BuildError, match=r"kernel 'k': needs 262208 B of shared memory per CTA \(dynamic 262208, "
                                         r"static 0\); sm_90 allows at most 232448"):
        build._check_smem_limit({"dynamic_smem_bytes": 262208, "static_smem_bytes": 0}, "kernel 'k'")
    with pytest.raises(BuildError, match=r"needs 232449 B"):
        build._check_smem_limit({"dynamic_smem_bytes": limit, "static_smem_bytes": 1}, "kernel 'k'")


def test_a_real_build_checks_the_shared_memory_limit(manifest, tmp_path, monkeypatch):
    """Through the whole build (compile, then _finish): with the limit set below what the toy
    kernel's CTA uses, the build refuses it and caches nothing under that key."""
    monkeypatch.setattr(build, "SM90_SMEM_PER_CTA", -1)
    with pytest.raises(BuildError, match=r"kernel 'scale' \[.*\]: needs \d+ B of shared memory per CTA"):
        build_variant("scale", {"rows": 2, "cols": 32}, root=tmp_path, manifest=manifest)
    monkeypatch.setattr(build, "SM90_SMEM_PER_CTA", 227 * 1024)
    art = build_variant("scale", {"rows": 2, "cols": 32}, root=tmp_path, manifest=manifest)
    assert not art.cache_hit and (art.dir / "kernel.cubin").is_file()


def test_relative_root_compiles_and_hits(manifest, tmp_path, monkeypatch):
    # The compile worker runs in a staging folder; a relative root must not resolve there.
    monkeypatch.chdir(tmp_path)
    art = build_variant("scale", {"rows": 2, "cols": 64}, root=Path("rel_build"), manifest=manifest)
    assert not art.cache_hit and (tmp_path / "rel_build").is_dir()
    assert (art.dir / "kernel.cubin").is_file()
    again = build_variant("scale", {"rows": 2, "cols": 64}, root=Path("rel_build"), manifest=manifest)
    assert again.cache_hit and again.meta["hashes"]["cubin_sha256"] == art.meta["hashes"]["cubin_sha256"]


def test_dsl_version_names_the_backend_packages(monkeypatch):
    """The build key's DSL version includes the backend libraries: the same front-end version
    with the cu12 or the cu13 backend must give different keys (different compilers)."""
    import importlib.metadata as md

    class Dist:
        def __init__(self, name, version):
            self.metadata = {"Name": name}
            self.version = version

    def with_backend(tag):
        monkeypatch.setattr(md, "version", lambda name: "4.8.1")
        monkeypatch.setattr(md, "distributions", lambda: [Dist("nvidia-cutlass-dsl", "4.8.1"),
                                                          Dist(f"nvidia-cutlass-dsl-libs-{tag}", "4.8.1"),
                                                          Dist("torch", "2.13.0")])
        return build.dsl_version()

    cu12, cu13 = with_backend("cu12"), with_backend("cu13")
    assert cu12 == "4.8.1 (libs-cu12 4.8.1)" and cu13 == "4.8.1 (libs-cu13 4.8.1)"
    # names compare as PEP 503 does: another spelling of the same wheel gives the same key input
    monkeypatch.setattr(md, "distributions", lambda: [Dist("NVIDIA_Cutlass.DSL-libs_cu12", "4.8.1")])
    assert build.dsl_version() == cu12
    spec = load_manifest().kernel("rmsnorm")
    shape = spec.shapes[0]
    assert build.content_key(spec, shape, {}, {"a.py": "0" * 64}, cu12) != \
        build.content_key(spec, shape, {}, {"a.py": "0" * 64}, cu13)


def test_a_tensor_map_parameter_must_be_a_by_value_map():
    """A buffer whose spec has a tensor map (the kernel reads it by TMA) must be the 128-byte,
    64-aligned by-value parameter a CuTe TMA atom compiles to, and nothing else."""
    from kernels.ptx import PtxEntry, PtxParam

    man = parse_manifest(
        '[kernels.t]\nop = "m:Op"\nreference = "r:f"\nsources = []\n'
        'params = [{ name = "w", role = "static" }]\n[kernels.t.shapes]\nrows = [4]\n'
    )
    spec = {"w": {"kind": "tensor", "shape": [64, 64], "dtype": "bfloat16", "tma": {"box": [64, 64], "swizzle": 128}}}
    ok = PtxEntry("k", (PtxParam(0, "k_param_0", "b8", 128, 64, 128),), {})
    assert build._zip_params(man.kernel("t"), ok, spec, "rows=4")[0]["size"] == 128
    ptr = PtxEntry("k", (PtxParam(0, "k_param_0", "u64", 8, 8),), {})
    with pytest.raises(BuildError, match=r"buffer 'w' is read by TMA .* it is 8 bytes aligned to 8"):
        build._zip_params(man.kernel("t"), ptr, spec, "rows=4")
    # without a map, a 128-byte parameter is still refused for a buffer
    plain = {"w": {k: v for k, v in spec["w"].items() if k != "tma"}}
    with pytest.raises(BuildError, match="expected one 8-byte pointer"):
        build._zip_params(man.kernel("t"), ok, plain, "rows=4")


def test_tensor_maps_must_match_the_kernels_tma_copies():
    maps = [{"spec": {"kind": "tensor", "tma": {"box": [64, 128], "swizzle": 128}}},
            {"spec": {"kind": "tensor", "shape": [4], "dtype": "float32"}}]
    two_d = "cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];"
    build._check_tensor_maps(two_d, maps, "k")
    build._check_tensor_maps("ld.global.b32 %r1, [%rd1];", maps[1:], "k")  # no maps, nothing to check
    with pytest.raises(BuildError, match="has no TMA copy"):
        build._check_tensor_maps("ld.global.b32 %r1, [%rd1];", maps, "k")
    with pytest.raises(BuildError, match=r"rank \[2\] but the PTX's TMA copies are \[2, 3\]-d"):
        build._check_tensor_maps(two_d + "\n" + two_d.replace(".2d", ".3d"), maps, "k")


# -- executors ---------------------------------------------------------------------------------

def test_build_requests_builds_several_kernels_in_one_pool_and_reports_each_error(manifest, tmp_path):
    """Variants of several kernels go to one executor; a variant's compile error is its own result,
    and the others still build."""
    from kernels.build import BuildRequest, LocalExecutor, build_requests

    spec, broken = manifest.kernel("scale"), manifest.kernel("broken")
    reqs = [BuildRequest(spec, dict(SHAPE), spec.tunable_defaults(), REPO_ROOT),
            BuildRequest(broken, dict(broken.shapes[0]), broken.tunable_defaults(), REPO_ROOT)]
    got = build_requests(reqs, root=tmp_path, executor=LocalExecutor(2))
    assert not isinstance(got[0], BuildError) and got[0].kernel == "scale"
    assert isinstance(got[1], BuildError) and "broken_op.py" in str(got[1])


@pytest.mark.slow
def test_ray_executor_on_a_loopback_cluster_builds_the_same_bytes(built, manifest, tmp_path):
    """A local Ray cluster on 127.0.0.1 (started and stopped by this test): the task compiles on a
    Ray worker, the driver installs what comes back, and the cubin is the local build's."""
    ray = pytest.importorskip("ray")
    from kernels.build import RayExecutor

    _, art = built
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    try:
        ex = RayExecutor()
        other = build_kernel("scale", shapes=[SHAPE], root=tmp_path / "ray", manifest=manifest, executor=ex)[0]
    finally:
        ray.shutdown()
    assert not other.cache_hit and other.key == art.key
    for name in ("kernel.cubin", "kernel.ptx", "kernel.sass", "meta.json"):
        assert (other.dir / name).read_bytes() == (art.dir / name).read_bytes(), name


def test_unknown_executor_is_a_build_error():
    from kernels.build import make_executor

    with pytest.raises(BuildError, match="unknown build executor"):
        make_executor("slurm")
    assert make_executor("local", 3).jobs == 3
