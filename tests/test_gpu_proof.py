"""scripts/gpu_proof.py on CPU: the sweep's problem filter, including an earlier plan's cases for
side-by-side timing (and its errors), and how the summary names a variant's tunables."""

import json
from pathlib import Path

import pytest

from kernels.manifest import load_manifest
from scripts import gpu_proof as P


def test_sweep_variants_keep_only_the_listed_problems():
    spec = load_manifest().kernel("gemv")
    got = list(P._sweep_variants(spec, [1, 64], {"k_unroll": [4]}, [{"n": 896, "k": 7168}]))
    assert [(s["batch"], s["n"]) for s, _ in got] == [(1, 896), (64, 896)]
    assert all(t == {"k_unroll": 4} for _, t in got)
    every = list(P._sweep_variants(spec, [1], {"k_unroll": [4]}))
    assert len(every) == len({(p["n"], p["k"]) for p in (dict(s) for s in spec.shapes)})


def _plan(tmp_path, dirs):
    cases = [{"kernel": "gemv", "shape": {"batch": 1, "n": 64, "k": 512}, "tunables": {"prefetch": 1},
              "default_tunables": True, "dir": d, "build_key": f"key{i}", "cubin_sha256": "0" * 64}
             for i, d in enumerate(dirs)]
    path = tmp_path / "old_plan.json"
    path.write_text(json.dumps({"commit": "4a36f3936454", "cases": cases}))
    return path


def test_included_cases_are_marked_and_never_defaults(tmp_path, monkeypatch):
    (tmp_path / "b0").mkdir()
    monkeypatch.setattr(P, "REPO", tmp_path)
    got = P._included_cases(_plan(tmp_path, ["b0", "b0"]), ["gemv"])
    assert [c["build_key"] for c in got] == ["key0", "key1"]
    assert all(c["from_plan"] == "4a36f3936454" and c["default_tunables"] is False for c in got)
    assert P._included_cases(_plan(tmp_path, ["b0"]), ["rmsnorm"]) == []


@pytest.mark.parametrize("dirs, fragment", [(["gone"], "build folder gone is missing"), (None, "cannot read")])
def test_included_plan_errors_name_the_problem(tmp_path, monkeypatch, dirs, fragment):
    monkeypatch.setattr(P, "REPO", tmp_path)
    path = _plan(tmp_path, dirs) if dirs else tmp_path / "absent.json"
    with pytest.raises(P.ProofError, match=fragment):
        P._included_cases(path, ["gemv"])


def test_plan_with_a_missing_include_exits_2_and_builds_nothing(tmp_path, capsys):
    """The include is read before any build: a bad path costs no compile time."""
    out = tmp_path / "plan.json"
    rc = P.main(["plan", "--kernels", "rmsnorm", "--root", str(tmp_path / "b"), "--out", str(out),
                 "--include", str(tmp_path / "absent.json")])
    assert rc == 2 and not out.exists() and not (tmp_path / "b").exists()
    assert "cannot read the plan to include" in capsys.readouterr().err


def test_problem_parsing_and_refusals(tmp_path, capsys):
    """`--problem N,K` (gemv only) parses to (n, k); a malformed one or another kernel is one
    clear error and exit 2, before anything is built."""
    assert P._parse_problems(["49152,7168", "64,512"]) == [(49152, 7168), (64, 512)]
    for bad in ("49152", "a,7168", "0,7168", "1,2,3"):
        with pytest.raises(P.ProofError, match="expected N,K"):
            P._parse_problems([bad])
    out = tmp_path / "plan.json"
    rc = P.main(["plan", "--kernels", "rmsnorm", "gemv", "--root", str(tmp_path / "b"), "--out", str(out),
                 "--problem", "64,512"])
    assert rc == 2 and not out.exists() and not (tmp_path / "b").exists()
    assert "--problem applies to gemv alone" in capsys.readouterr().err


def test_summary_names_only_the_tunables_that_differ():
    defaults = {"prefetch": 1, "tile_min_ctas": 264}
    assert P._tun({"tunables": defaults, "default_tunables": True}, defaults) == ""
    assert P._tun({"tunables": {"prefetch": 2, "tile_min_ctas": 132}, "default_tunables": False},
                  defaults) == "p2 mc132"
    old = {"tunables": {"prefetch": 1}, "default_tunables": False, "from_plan": "4a36f3936454"}
    assert P._tun(old, defaults) == "@4a36f39"


def test_gemv_cases_without_a_gpu_is_one_clear_error(tmp_path, capsys, monkeypatch):
    """scripts/gemv_cases.py (what the profiler and the sanitizers run on the GPU host): on a
    host without a GPU, one line and exit 2, whichever mode."""
    import torch

    from scripts import gemv_cases

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for mode in ("launch", "check"):
        assert gemv_cases.main([mode, str(tmp_path / "plan.json"), "0"]) == 2
        assert capsys.readouterr().err == "gemv_cases: no CUDA device: run this on the GPU host\n"


def test_a_hanging_case_stops_the_run_with_one_line_and_keeps_what_was_measured(tmp_path):
    """The watchdog: a case that does not finish (here a sleep in place of a kernel that never
    completes) ends the process with exit 3 and one line naming it; the JSON keeps the cases
    measured before it and names the hung one."""
    import subprocess
    import sys

    out = tmp_path / "gpu_proof.json"
    code = (
        "import json, time, sys\n"
        "from pathlib import Path\n"
        "sys.path.insert(0, 'scripts')\n"
        "import gpu_proof\n"
        f"out = Path({str(out)!r})\n"
        "doc = {'cases': [{'kernel': 'gemv', 'measured': True}]}\n"
        "out.write_text(json.dumps(doc))\n"
        "w = gpu_proof.CaseWatchdog(0.5, out, doc)\n"
        "w.arm('1/1 fine'); w.cancel()\n"
        "w.arm('2/2 gemv {\"batch\": 64}')\n"
        "time.sleep(30)\n"
    )
    repo = Path(P.__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, (r.returncode, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpu_proof: case 2/2 gemv") and "did not finish within 0.5 s" in lines[0]
    doc = json.loads(out.read_text())
    assert doc["hung"] == {"case": '2/2 gemv {"batch": 64}', "after_s": 0.5} and doc["cases"] == [{"kernel": "gemv", "measured": True}]


def test_experts_cases_refuses_with_one_line(tmp_path, capsys, monkeypatch):
    """scripts/experts_cases.py (a profiler's launcher on the GPU host): ids in pairs, a carried
    plan that exists and names them, a GPU; each refusal is one line and exit 2."""
    import json

    import torch

    from scripts import experts_cases

    with pytest.raises(SystemExit) as e:
        experts_cases.main(["b64_w13_blk"])
    assert e.value.code == 2 and "pairs" in capsys.readouterr().err
    assert experts_cases.main(["a", "b", "--carry", str(tmp_path / "none")]) == 2
    assert "cannot read the carried plan" in capsys.readouterr().err
    (tmp_path / "plan.json").write_text(json.dumps({"entries": [{"id": "a"}, {"id": "b"}]}))
    assert experts_cases.main(["a", "c", "--carry", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith("['c']")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert experts_cases.main(["a", "b", "--carry", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "experts_cases: no CUDA device: run this on the GPU host\n"
