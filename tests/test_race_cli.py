"""`fasttrack audit`: exit codes (0 clean, 1 error finding, 2 bad input), --json, messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from kernels.manifest import load_manifest  # noqa: E402
from validation.cli import main  # noqa: E402
from validation.race.artifacts import build_variant_of, mutant_spec  # noqa: E402

PRODCONS_ROLES = ["--param", "gamma=static", "--param", "w=static", "--param", "stage=scratch",
                  "--param", "flags=sync"]


def _built(kernel: str, mutant: str | None, into: Path) -> tuple[Path, Path]:
    spec = load_manifest().kernel(kernel)
    if mutant:
        spec = mutant_spec(spec, mutant)
    art = build_variant_of(spec)
    ptx, cubin = into / f"{kernel}_{mutant}.ptx", into / f"{kernel}_{mutant}.cubin"
    shutil.copy(art.paths["ptx"], ptx)
    shutil.copy(art.paths["cubin"], cubin)
    return ptx, cubin


def _names(n):
    return ["x", "gamma", "w", "stage", "flags", "y"][:n]


def _by_index(args):
    """--param NAME=ROLE with prodcons names -> index form (the PTX has no names)."""
    out = []
    for a in args:
        if "=" in a:
            name, role = a.split("=")
            a = f"{_names(6).index(name)}={role}"
        out.append(a)
    return out


def test_manifest_kernel_clean_exit_0(capsys):
    assert main(["audit", "prodcons"]) == 0
    assert "prodcons: clean" in capsys.readouterr().out


def test_manifest_mutant_exit_1_json(capsys):
    assert main(["audit", "prodcons", "--mutant", "relaxed_publish", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["clean"] is False
    rules = {f["rule"] for r in doc["reports"] for f in r["findings"]}
    assert "relaxed-publish" in rules


def test_standalone_ptx_and_cubin(tmp_path, capsys):
    ptx, cubin = _built("prodcons", "nc_activation", tmp_path)
    rc = main(["audit", "--ptx", str(ptx), "--cubin", str(cubin), "--json"] + _by_index(PRODCONS_ROLES))
    assert rc == 1
    doc = json.loads(capsys.readouterr().out)
    (rep,) = doc["reports"]
    assert rep["checked"] == ["ptx", "sass"]
    assert any(f["rule"] == "nc-load-mutable" and f["params"] == ["param_3"] for f in rep["findings"])

    good_ptx, good_cubin = _built("prodcons", None, tmp_path)
    assert main(["audit", "--ptx", str(good_ptx), "--cubin", str(good_cubin)] + _by_index(PRODCONS_ROLES)) == 0


def test_unnamed_params_default_to_activation(tmp_path, capsys):
    """With no roles the weights count as activations: their nc loads are flagged."""
    ptx, _ = _built("prodcons", None, tmp_path)
    assert main(["audit", "--ptx", str(ptx), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    flagged = {p for f in doc["reports"][0]["findings"] if f["rule"] == "nc-load-mutable" for p in f["params"]}
    assert flagged == {"param_2"}  # w (index 2) is read through nc loads; gamma is read plainly


@pytest.mark.parametrize("args,needle", [
    (["--ptx", "{missing}"], "cannot read PTX"),
    (["--ptx", "{garbage}"], "unreadable PTX"),
    (["--ptx", "{ptx}", "--param", "9=static"], "out of range"),
    (["--ptx", "{ptx}", "--param", "nosuch=static"], "unknown parameter 'nosuch'"),
    (["--ptx", "{ptx}", "--param", "1=readonly"], "unknown role 'readonly'"),
    (["--ptx", "{ptx}", "--param", "1"], "expected NAME_OR_INDEX=ROLE"),
    (["--ptx", "{ptx}", "--cubin", "{garbage}"], "nvdisasm"),
    (["nosuchkernel"], "unknown kernel 'nosuchkernel'"),
    ([], "name a KERNEL"),
    (["prodcons", "--ptx", "{ptx}"], "not both"),
])
def test_bad_input_exit_2_one_message(tmp_path, capsys, args, needle):
    ptx, _ = _built("prodcons", None, tmp_path)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x7fELF not really\n")
    subst = {"{missing}": str(tmp_path / "missing.ptx"), "{garbage}": str(garbage), "{ptx}": str(ptx)}
    argv = ["audit"] + [subst.get(a, a) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_standalone_audit_takes_directions_and_a_task_table(tmp_path, capsys):
    """--param NAME=ROLE:DIRECTION and --points-to reach the audit (fixtures from tests/fixtures/race)."""
    from pathlib import Path

    from validation.cli import main

    fx = Path(__file__).parent / "fixtures" / "race"
    roles = ["flags=sync:inout", "data=activation:inout", "out=activation:out", "table=static:in",
             "weights=static:in", "x=activation:in"]
    idx = [f"--param={i}={r.split('=', 1)[1]}" for i, r in enumerate(roles)]
    assert main(["audit", "--ptx", str(fx / "store_to_input.ptx")] + idx) == 1
    assert "store-to-readonly" in capsys.readouterr().out
    assert main(["audit", "--ptx", str(fx / "store_to_static_twin.ptx")] + idx) == 0
    table = "--points-to=3=32:0=activation,8=static,16=scalar"
    assert main(["audit", "--ptx", str(fx / "tableslot_undeclared.ptx"), table] + idx) == 1
    assert "points-to-undeclared" in capsys.readouterr().out
    assert main(["audit", "--ptx", str(fx / "tableslot_undeclared.ptx"), "--points-to=3=32:oops"] + idx) == 2
