"""The HTML evidence report: rendered from the bundle alone, self-contained, showing what matters."""

from __future__ import annotations

import re

import pytest

from kernels.config import get_config
from validation import bundle as B
from validation import defences as D
from validation.check import judge, matrix_for
from validation.cli import main
from validation.opinputs import op_def
from validation.report import line_plot, render_report


def realistic_bundle(verdict_slow: bool = False) -> dict:
    """Correctness and defences from a real CPU judging run; benchmark cases synthetic."""
    from kernels import reference as R
    import torch

    op, cfg = op_def("rmsnorm"), get_config("tiny")
    subject = D.DestinationSubject(
        lambda i, o: o["out"].copy_(R.rmsnorm(i["x"], i["gamma"], i["eps"])),
        lambda i: {"out": (tuple(i["x"].shape), torch.bfloat16)}, "rmsnorm", "cpu")
    rep = judge(subject, op, cfg, matrix_for(op, cfg, "cpu", quick=True), unseen_reason="cubin")
    cases = []
    for width in (7168, 3584):
        for b in (1, 2, 4, 8, 16, 32, 64):
            head = 3.0 + 0.05 * b
            base = head * (0.9 if verdict_slow and b == 64 else 1.6)
            nbytes = (2 * b + 1) * width * 2
            cases.append({
                "case_id": f"rmsnorm/batch={b} width={width}", "name": f"rmsnorm batch={b} width={width}",
                "kernel": "rmsnorm", "variant": {"batch": b, "width": width}, "batch": b, "bytes": nbytes,
                "head": {"median": head, "p10": head * 0.98, "p90": head * 1.02, "p25": head, "p75": head,
                         "min": head, "n": 10, "rel_iqr": 0.01},
                "base": {"median": base, "p10": base, "p90": base, "p25": base, "p75": base, "min": base,
                         "n": 10, "rel_iqr": 0.01},
                "change": head / base - 1, "speedup": base / head, "p_value": 1e-4, "noise": 0.01,
                "head_bandwidth": {"achieved_tbps": nbytes / head / 1e6, "fraction_of_read": nbytes / head / 1e6 / 4.6,
                                   "noise_margin": 0.02, "impossible": False},
                "base_bandwidth": {"achieved_tbps": nbytes / base / 1e6, "fraction_of_read": nbytes / base / 1e6 / 4.6,
                                   "noise_margin": 0.02, "impossible": False},
                "graph": True, "l2_rotated": b > 8, "copies": 64,
                "verdict": "SLOW" if base < head else "FAST", "reason": "synthetic <script>x</script>",
            })
    return B.new_bundle(
        change={"kernel": "rmsnorm", "base": "torch", "head": "0123456789abcdef", "files": ["kernels/ops/rmsnorm.py"],
                "title": "rmsnorm foundation", "summary": "s"},
        environment={"gpu": "NVIDIA H200", "gpu_count": 1, "sm_count": 132, "driver": "580", "cuda_runtime": "13.0",
                     "torch": "2.11", "dsl_version": "4.8.1", "commit": "0123456789abcdef", "dirty": False,
                     "hostname_hash": "abc"},
        binaries=[{"kernel": "rmsnorm", "side": "head", "variant": c["variant"], "tunables": {"threads": 256},
                   "build_key": "k" * 64, "cubin_sha256": "f" * 64} for c in cases],
        correctness=rep.correctness(), defences=rep.defences(),
        race={"passed": True, "static": {"passed": True, "variants": 14, "findings": []}, "dynamic": None,
              "stress": {"passed": True, "runs_per_variant": 32, "failing_variants": []}},
        benchmark={"ceilings": {"read_tbps": 4.6, "read_noise": 0.01, "read_kernel": "triton", "copy_tbps": 4.25},
                   "cases": cases, "passed": not verdict_slow, "base_name": "torch",
                   "policy": {"min_effect": 0.03, "alpha": 0.01, "max_noise": 0.1}},
        not_covered=["race.dynamic: compute-sanitizer not run"])


@pytest.fixture(scope="module")
def bundle():
    return realistic_bundle()


def test_report_is_self_contained_and_complete(bundle):
    html = render_report(bundle)
    # Self-contained: no scripts, no external resources of any kind.
    assert "<script" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and "url(" not in html
    # The one-screen summary, then every section.
    for heading in ("Summary", "Risks", "Not covered", "Correctness", "Defences", "Race audit",
                    "Performance", "Environment and provenance"):
        assert heading in html
    assert "PASS" in html and "race.dynamic: compute-sanitizer not run" in html
    assert html.count("<svg") == 2  # speedup and fraction-of-read plots
    assert "f" * 64 in html  # the cubin hashes the evidence is bound to
    for d in D.DEFENCE_NAMES:
        assert d in html
    assert "&lt;script&gt;" in html  # bundle text is escaped, never markup


def test_report_shows_a_failing_bundle_as_failing():
    b = realistic_bundle(verdict_slow=True)
    assert b["verdict"] == "fail"
    html = render_report(b)
    assert "FAIL" in html and "benchmark: failed" in html
    assert "SLOW against the base" in html  # listed among the risks


def test_report_renders_a_bundle_without_gpu_results():
    b = B.new_bundle(change={"kernel": "gemv", "base": None, "head": None, "files": [], "title": "", "summary": ""},
                     environment={}, binaries=[], correctness=None, defences=None, race=None, benchmark=None,
                     not_covered=["GPU stages: no CUDA device"])
    html = render_report(b)
    assert "GPU stages: no CUDA device" in html and "No benchmark results" in html


def test_same_bundle_renders_identical_bytes(bundle):
    assert render_report(bundle) == render_report(bundle)


def test_line_plot_handles_empty_and_degenerate_data():
    assert "no data" in line_plot({}, title="t", y_label="y")
    svg = line_plot({"one": [(8, 1.5)]}, title="t", y_label="y", ref_y=1.0)
    assert svg.startswith("<svg") and "<circle" in svg


def test_report_cli_rerenders_and_rejects_bad_bundles(bundle, tmp_path, capsys):
    p = tmp_path / "bundle.json"
    B.write_bundle_atomic(p, bundle)
    assert main(["report", str(p)]) == 0
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["report", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_report_renders_policies_written_as_plain_strings(bundle):
    # A bundle from another writer may name its policy instead of embedding it: render, don't crash.
    import copy

    b = copy.deepcopy(bundle)
    b["correctness"]["policy"] = "validation/tolerances.toml"
    if b.get("benchmark"):
        b["benchmark"]["policy"] = "default"
    html = render_report(b)
    assert "validation/tolerances.toml" in html


# -- what the page says about trust -----------------------------------------------------------

def _signed(bundle, tmp_path):
    from gate_fixtures import new_keypair, sign

    priv, pem = new_keypair()
    keys = tmp_path / "keys"
    keys.mkdir()
    from gate_fixtures import key_id_from_pem

    (keys / f"{key_id_from_pem(pem)}.pub").write_bytes(pem)
    return sign(bundle, priv), keys


def test_a_tampered_bundle_page_says_its_signature_does_not_verify(bundle, tmp_path, capsys):
    import copy

    signed, keys = _signed(bundle, tmp_path)
    p = tmp_path / "bundle.json"
    B.write_bundle_atomic(p, signed)
    assert main(["report", str(p), "--trusted", str(keys), "--build-root", str(tmp_path / "nobuild")]) == 0
    html = (tmp_path / "report.html").read_text()
    assert 'id="verdict">PASS' in html and "verifies</span>, trusted key" in html
    tampered = copy.deepcopy(signed)
    tampered["benchmark"]["cases"][0]["head"]["median"] = 1.0  # a faster head than measured
    B.write_bundle_atomic(p, tampered)
    assert main(["report", str(p), "--trusted", str(keys), "--build-root", str(tmp_path / "nobuild")]) == 0
    html = (tmp_path / "report.html").read_text()
    assert 'id="verdict">NOT VERIFIED' in html and "does not verify</span>" in html
    assert "PASS" not in html.split('id="design"')[0]
    assert "does not verify" in capsys.readouterr().out


def test_the_page_never_shows_pass_above_a_stage_that_failed_or_did_not_run(bundle, tmp_path):
    import copy

    from validation.report import page_verdict

    ok = {"signature": {"status": "ok", "key_id": "k"}, "binding": {"status": "bound", "detail": ""}}
    assert page_verdict(bundle, ok)["label"] == "PASS"
    for stage in ("correctness", "defences", "race", "benchmark"):
        b = copy.deepcopy(bundle)
        b[stage]["passed"] = False
        assert page_verdict(b, ok)["label"] == "FAIL", stage
        b[stage] = None
        assert page_verdict(b, ok)["label"] in ("INCOMPLETE", "FAIL"), stage
        html = render_report(b, ok)
        assert 'id="verdict">PASS' not in html
    assert page_verdict(bundle, None)["label"] == "NOT VERIFIED"  # nothing checked: not PASS
    assert page_verdict(bundle, {**ok, "binding": {"status": "unbound", "detail": "x"}})["label"] == "NOT BOUND"


def test_first_screen_holds_counts_geomean_reproduce_and_provenance(bundle):
    ok = {"signature": {"status": "ok", "key_id": "k"}, "binding": {"status": "bound", "detail": "all"}}
    html = render_report(bundle, ok)
    top = html.split("<h2>Summary</h2>")[0]
    assert 'id="batches"' in top and "geomean speedup" in top and "fasttrack verify bundle.json" in top
    assert "NVIDIA H200" in top and "driver 580" in top and "0123456789ab" in top
    assert "Design:</b> rmsnorm foundation" in top


def test_plot_axis_spans_the_data_and_draws_noise_bands():
    svg = line_plot({"a": [(1, 0.97), (8, 1.05)]}, title="t", y_label="y", ref_y=1.0,
                    bands={"a": [(1, 0.95, 0.99), (8, 1.03, 1.07)]})
    ticks = [float(t) for t in re.findall(r'class="tk">(-?\d+\.\d+)</text>', svg)]
    assert min(ticks) > 0.9 and max(ticks) < 1.1  # not from zero: the 0.97-1.05 spread is visible
    assert "<polygon" in svg and "noise band" in svg


def test_timeline_from_stamps_and_its_svg():
    from validation.report import timeline_svg
    from validation.timeline import timeline_from_stamps

    stamps = [[[1000, 3000], [4000, 9000]],   # worker 0: both stages
              [[1500, 2500], [0, 0]],         # worker 1: stage "b" not run
              [[1000, 2000], [5000, 11000]]]
    t = timeline_from_stamps(stamps, ["a", "b"], batch=1)
    assert t["spans"] == [[0, 0, 1000, 3000], [0, 1, 4000, 9000], [1, 0, 1500, 2500],
                          [2, 0, 1000, 2000], [2, 1, 5000, 11000]]
    svg = timeline_svg(t)
    assert svg.count("<rect") == 1 + 5 + 2  # frame, one bar per span, one legend swatch per stage
    # first start, last end and summed busy time per stage, in us from the first timestamp
    assert "a: 0-2 us, busy 4 us" in svg and "b: 3-10 us, busy 11 us" in svg
    with pytest.raises(ValueError, match="not a span"):
        timeline_from_stamps([[[5, 4]]], ["a"], batch=1)
    with pytest.raises(ValueError, match="1 stamp pairs for 2 stages"):
        timeline_from_stamps([[[1, 2]]], ["a", "b"], batch=1)


def test_a_timeline_is_summed_up_per_stage_with_its_stragglers():
    from validation.report import timeline_table
    from validation.timeline import stage_summary, timeline_from_stamps

    stamps = [[[1000, 3000], [4000, 9000]],
              [[1500, 2500], [0, 0]],
              [[1000, 2000], [5000, 11000]],
              [[1000, 6000], [6000, 7000]]]
    t = timeline_from_stamps(stamps, ["a", "b"], batch=2)
    a, b = stage_summary(t)
    assert (a["stage"], a["workers"], a["first_start_us"]) == ("a", 4, 0.0)
    # ends 1, 1.5, 2, 5 us: median 1.75, the slowest worker 3.25 us behind it
    assert (a["end_min_us"], a["end_median_us"], a["end_max_us"]) == (1.0, 1.75, 5.0)
    assert a["straggle_us"] == 3.25 and (a["busy_median_us"], a["busy_max_us"]) == (1.5, 5.0)
    assert (b["workers"], b["end_median_us"], b["straggle_us"]) == (3, 8.0, 2.0)
    assert stage_summary({"stages": ["a"], "spans": []}) == []
    html_ = timeline_table(t)
    assert "1.0 / 1.8 / 5.0" in html_ and "<td>3.2</td>" in html_ and "batch 2" in html_
    assert timeline_table({"stages": ["a"], "unit": "cycles", "spans": [[0, 0, 1, 2]]}) == ""
    # cycles at the timeline's clock: 2000 cycles at 1000 MHz are 2 us
    (c,) = stage_summary({"stages": ["a"], "unit": "cycles", "clock_mhz": 1000, "spans": [[0, 0, 0, 2000]]})
    assert c["end_max_us"] == 2.0 and c["busy_max_us"] == 2.0


def test_a_stage_with_weight_bytes_gets_its_bandwidth_against_the_read_ceiling():
    """With `stage_bytes` (and `read_tbps`) on the timeline, a stage that streamed weights gets
    its bytes over its workers' median start to its last end, and that over the ceiling; a
    stage of no bytes gets none, and the table shows the column only when some stage has it."""
    from validation.report import timeline_table
    from validation.timeline import stage_summary, timeline_from_stamps

    # stage a: starts 1000, 1000, 2000 ns (median 1000), last end 5000 ns; stage b: no weights
    stamps = [[[1000, 3000], [5000, 6000]], [[1000, 5000], [5000, 7000]], [[2000, 4000], [5000, 5500]]]
    t = timeline_from_stamps(stamps, ["a", "b"], batch=1)
    t.update({"stage_bytes": {"a": 8_000_000, "b": 0}, "read_tbps": 4.0})
    a, b = stage_summary(t)
    assert (a["bytes"], a["span_us"], a["tbps"], a["of_read"]) == (8e6, 4.0, 2.0, 0.5)
    assert "tbps" not in b and "span_us" not in b
    page = timeline_table(t)
    assert "8.0 MB in 4.0 us: 2.000 TB/s (50.0% of read)" in page and "weights streamed" in page
    del t["read_tbps"]
    (a, _) = stage_summary(t)
    assert a["tbps"] == 2.0 and "of_read" not in a
    assert "of read)" not in timeline_table(t)
    del t["stage_bytes"]
    assert "weights streamed" not in timeline_table(t)


def test_a_bundle_timeline_is_drawn_on_the_page():
    from validation.report import render_report

    b = {"schema": "fasttrack.evidence/1", "verdict": "pass",
         "timeline": [{"batch": 4, "unit": "ns", "stages": ["norm", "w13"], "spans": [[0, 0, 10, 20], [0, 1, 30, 90]]}]}
    page = render_report(b)
    assert "Per-stage timeline, batch 4" in page and "w13: 0.02-0.08 us" in page
