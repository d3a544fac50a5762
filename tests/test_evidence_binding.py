"""scripts/evidence_binding.py: committed evidence against the cubins this checkout builds."""

from __future__ import annotations

import json

import pytest

from kernels.build import build_variant
from scripts import evidence_binding as E

SHAPE = {"batch": 1, "width": 3584}


@pytest.mark.slow
def test_bound_and_unbound_cases_and_bad_input(tmp_path, capsys):
    root = tmp_path / "build"
    art = build_variant("rmsnorm", SHAPE, root=root)
    case = {"kernel": "rmsnorm", "shape": SHAPE, "tunables": art.meta["tunables"],
            "cubin_sha256": art.meta["hashes"]["cubin_sha256"]}
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"cases": [case]}))
    assert E.main([str(good), "--root", str(root)]) == 0
    assert "1/1 cases bound" in capsys.readouterr().out
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"cases": [case, dict(case, cubin_sha256="0" * 64)]}))
    assert E.main([str(stale), "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "1/2 cases bound" in out and 'unbound: rmsnorm {"batch": 1, "width": 3584} (evidence 000000000000' in out
    # bad input: one line, exit 2, nothing built
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"cases": [{"kernel": "rmsnorm"}]}))
    assert E.main([str(good), str(broken), "--root", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "case 0 has no shape, tunables, cubin_sha256" in err[0]
    assert not (tmp_path / "none").exists()
    assert E.main([str(tmp_path / "missing.json")]) == 2


def test_a_case_binds_by_its_code_hash_only_where_it_records_one():
    """Same bytes: "same". Other bytes with the recorded code sha256 (line tables moved):
    "code". Other bytes without a recorded code sha256, or another code: "unbound"."""
    case = {"cubin_sha256": "a" * 64, "cubin_code_sha256": "c" * 64}
    assert E.verdict(case, ("a" * 64, "x" * 64)) == "same"
    assert E.verdict(case, ("b" * 64, "c" * 64)) == "code"
    assert E.verdict(case, ("b" * 64, "d" * 64)) == "unbound"
    assert E.verdict({"cubin_sha256": "a" * 64}, ("b" * 64, "c" * 64)) == "unbound"


def test_the_current_evidence_list_names_evidence_files():
    """evidence_reports/CURRENT (read by .ci/run): every path exists and holds cases of the shape
    evidence_binding needs, so CI's binding step cannot fail on a stale list."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    paths = [ln.strip() for ln in (repo / "evidence_reports" / "CURRENT").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert paths
    for p in paths:  # bundle.json files or older proof JSON: what load_cases reads
        cases = E.load_cases(repo / p)
        assert cases and all({"kernel", "shape", "tunables", "cubin_sha256"} <= set(c) for c in cases), p
    readme = (repo / "README.md").read_text()
    assert "evidence_reports/CURRENT" in readme, "README.md's binding command should read the same list"


def test_code_hashes_are_recorded_from_the_cubins_that_ran(tmp_path, monkeypatch):
    """--record-code-sha: each case whose cubin its plan's folder still holds gets that cubin's
    code sha256; a folder whose cubin is not the case's is refused (exit 2), nothing written."""
    import hashlib

    from kernels.cubin import code_sha256
    from tests.test_cubin import _elf

    monkeypatch.setattr(E, "REPO", tmp_path)
    cub = _elf([(".text.k", b"code"), (".debug_line", b"lines")])
    (tmp_path / "b0").mkdir()
    (tmp_path / "b0" / "kernel.cubin").write_bytes(cub)
    sha = hashlib.sha256(cub).hexdigest()
    case = {"kernel": "k", "shape": {}, "tunables": {}, "cubin_sha256": sha, "dir": "b0"}
    other = dict(case, cubin_sha256="f" * 64, dir="gone")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"cases": [case, other]}))
    assert E.main([str(plan), "--record-code-sha", str(plan)]) == 0
    cases = json.loads(plan.read_text())["cases"]
    assert cases[0]["cubin_code_sha256"] == code_sha256(cub) and "cubin_code_sha256" not in cases[1]
    (tmp_path / "b0" / "kernel.cubin").write_bytes(cub + b"x")
    fresh = tmp_path / "fresh.json"
    fresh.write_text(json.dumps({"cases": [case]}))
    assert E.main([str(fresh), "--record-code-sha", str(fresh)]) == 2
    assert "cubin_code_sha256" not in json.loads(fresh.read_text())["cases"][0]
    (tmp_path / "b0" / "kernel.cubin").unlink()  # a folder without its cubin: one line, exit 2
    text = fresh.read_text()
    assert E.main([str(fresh), "--record-code-sha", str(fresh)]) == 2 and fresh.read_text() == text


def test_a_bundle_binds_by_its_head_binaries(tmp_path):
    """evidence_reports/CURRENT lists bundle.json files: their head binaries are the cases (the
    base's are another revision's); each once; a bundle without head binaries is bad input."""
    b = {"schema": "fasttrack.evidence/1", "binaries": [
        {"kernel": "rmsnorm", "side": "head", "variant": {"batch": 1, "width": 64}, "tunables": {"threads": 64},
         "build_key": "k", "cubin_sha256": "a" * 64, "cubin_code_sha256": "c" * 64},
        {"kernel": "rmsnorm", "side": "head", "variant": {"batch": 1, "width": 64}, "tunables": {"threads": 64},
         "build_key": "k", "cubin_sha256": "a" * 64, "cubin_code_sha256": "c" * 64},
        {"kernel": "rmsnorm", "side": "base", "variant": {"batch": 1, "width": 64}, "tunables": {"threads": 64},
         "build_key": "k", "cubin_sha256": "b" * 64}]}
    f = tmp_path / "bundle.json"
    f.write_text(json.dumps(b))
    cases = E.load_cases(f)
    assert cases == [{"kernel": "rmsnorm", "shape": {"batch": 1, "width": 64}, "tunables": {"threads": 64},
                      "cubin_sha256": "a" * 64, "cubin_code_sha256": "c" * 64}]
    assert E.verdict(cases[0], ("x" * 64, "c" * 64)) == "code"
    b["binaries"] = [x for x in b["binaries"] if x["side"] == "base"]
    f.write_text(json.dumps(b))
    with pytest.raises(E.BindingError, match="no head binaries"):
        E.load_cases(f)
