"""The HTML evidence report, rendered with jinja2 from the bundle alone (`fasttrack report`).

One self-contained file: inline CSS, inline SVG plots, no scripts, no external resources, so it
reads the same from a CI artifact, an e-mail or a laptop without a server.

Plots are hand-rolled SVG rather than matplotlib: two small line plots need ~80 lines, add no
dependency to the CPU venv or the GPU host, and give byte-identical output for the same bundle
(matplotlib's SVG carries generated ids and a creation date, which would make re-rendered reports
differ for no reason). Each has a noise band per series and a y axis that spans the data.

What the page says about the bundle's trust comes from `trust` (`fasttrack report` verifies the
signature against the trusted keys and the cubin binding against the local build cache): the
verdict at the top is PASS only when the bundle says pass, every stage it needs ran and passed,
and the signature verifies; a tampered bundle's page says that its signature does not verify.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from pathlib import Path

from validation.timeline import stage_summary, us_per_unit

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "rfc_templates"
TEMPLATE = "report.html.j2"
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def _num(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def line_plot(series: dict[str, list[tuple[float, float]]], *, title: str, y_label: str,
              x_label: str = "batch size", ref_y: float | None = None, ref_label: str = "",
              width: int = 560, height: int = 300, styles: dict[str, tuple[int, bool]] | None = None,
              bands: dict[str, list[tuple[float, float, float]]] | None = None) -> str:
    """An inline SVG line plot, x on a log2 axis (batch sizes), one polyline per series.

    `styles` maps a series to (colour index, dashed): a base series takes its head's colour, dashed.
    `bands` maps a series to (x, low, high) points: its noise band, drawn shaded. The y axis spans
    the data, its bands and `ref_y` with a small margin, not from zero: a 0.97-1.05 speedup must
    not look flat.
    """
    pts = [(x, y) for s in series.values() for x, y in s if _num(x) and _num(y) is not None]
    if not pts:
        return f'<p class="muted">{html.escape(title)}: no data</p>'
    left, right, top, bottom = 58, 190, 28, 42
    pw, ph = width - left - right, height - top - bottom
    xs = sorted({x for x, _ in pts})
    lx = [math.log2(x) for x in xs]
    x0, x1 = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1
    ys = [y for _, y in pts] + ([ref_y] if ref_y is not None else [])
    for b in (bands or {}).values():
        ys += [v for _, lo, hi in b for v in (lo, hi) if _num(v) is not None]
    lo_y, hi_y = min(ys), max(ys)
    pad = (hi_y - lo_y) * 0.08 or abs(hi_y) * 0.05 or 1.0
    y0, y1 = lo_y - pad, hi_y + pad

    def X(x):
        return left + (math.log2(x) - x0) / (x1 - x0) * pw

    def Y(y):
        return top + ph - (y - y0) / (y1 - y0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">',
           f'<text x="{left}" y="16" class="pt">{html.escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for i in range(5):  # y grid and ticks
        v = y0 + (y1 - y0) * i / 4
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{Y(v) + 4:.1f}" text-anchor="end" class="tk">{v:.2f}</text>')
    for x in xs:
        out.append(f'<text x="{X(x):.1f}" y="{top + ph + 16}" text-anchor="middle" class="tk">{x:g}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" class="tk">{html.escape(x_label)}</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" '
               f'text-anchor="middle" class="tk">{html.escape(y_label)}</text>')
    if ref_y is not None and y0 <= ref_y <= y1:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(ref_y):.1f}" y2="{Y(ref_y):.1f}" '
                   f'stroke="#555" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{left + pw - 4}" y="{Y(ref_y) - 4:.1f}" text-anchor="end" class="tk">{html.escape(ref_label)}</text>')
    for i, (name, s) in enumerate(series.items()):
        s = sorted((x, y) for x, y in s if _num(x) and _num(y) is not None)
        if not s:
            continue
        ci, dashed = (styles or {}).get(name, (i, False))
        c = PALETTE[ci % len(PALETTE)]
        band = sorted((x, lo, hi) for x, lo, hi in (bands or {}).get(name, [])
                      if _num(x) and _num(lo) is not None and _num(hi) is not None)
        if band:
            poly = [f"{X(x):.1f},{Y(hi):.1f}" for x, _, hi in band] + [f"{X(x):.1f},{Y(lo):.1f}" for x, lo, _ in reversed(band)]
            out.append(f'<polygon fill="{c}" fill-opacity="0.15" stroke="none" points="{" ".join(poly)}">'
                       f'<title>{html.escape(name)}: noise band</title></polygon>')
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="'
                   + " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in s) + '"/>')
        for x, y in s:
            out.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{c}"><title>'
                       f'{html.escape(name)} batch {x:g}: {y:.3f}</title></circle>')
        ly = top + 12 + 16 * i
        out.append(f'<line x1="{left + pw + 10}" x2="{left + pw + 26}" y1="{ly - 4}" y2="{ly - 4}" stroke="{c}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{left + pw + 30}" y="{ly}" class="tk">{html.escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def timeline_svg(timeline: dict, *, width: int = 720) -> str:
    """An inline SVG of a persistent kernel's per-stage timeline (the bundle's `timeline`: in-kernel
    timestamps, see validation/BUNDLE.md): one thin row per worker, one bar per (worker, stage)
    span, coloured by stage, x in microseconds from the launch's first timestamp. The legend gives
    each stage's first start, last end and summed busy time across workers, so a stage that
    waits (its bars start late everywhere) or one that straggles (one long bar) shows at a glance.
    """
    stages = list(timeline.get("stages") or [])
    spans = [s for s in timeline.get("spans") or []
             if isinstance(s, (list, tuple)) and len(s) == 4 and all(_num(v) is not None for v in s)
             and 0 <= int(s[1]) < len(stages) and s[3] >= s[2]]
    title = f"Per-stage timeline, batch {timeline.get('batch', '?')}"
    if not stages or not spans:
        return f'<p class="muted">{html.escape(title)}: no timestamps</p>'
    try:
        scale = us_per_unit(timeline)
    except ValueError:  # drawn anyway: cycles without a clock as if at 1 MHz, an unknown unit as ns
        scale = 1.0 if timeline.get("unit") == "cycles" else 1e-3
    t0 = min(s[2] for s in spans)
    t1 = max(s[3] for s in spans)
    span_us = max((t1 - t0) * scale, 1e-9)
    workers = sorted({int(s[0]) for s in spans})
    row = {w: i for i, w in enumerate(workers)}
    rh = 2 if len(workers) > 64 else 4
    left, right, top = 58, 230, 28
    pw, ph = width - left - right, rh * len(workers)
    height = max(top + ph + 42, top + 16 * len(stages) + 20)  # the plot, or the legend where it is taller

    def X(t):
        return left + (t - t0) * scale / span_us * pw

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">',
           f'<text x="{left}" y="16" class="pt">{html.escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for i in range(5):
        v = span_us * i / 4
        x = left + pw * i / 4
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle" class="tk">{v:.3g}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{top + ph + 34}" text-anchor="middle" class="tk">us from the first timestamp</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" '
               f'text-anchor="middle" class="tk">worker ({len(workers)})</text>')
    for w, si, a, b in sorted(spans, key=lambda s: (s[1], s[0], s[2])):
        c = PALETTE[int(si) % len(PALETTE)]
        out.append(f'<rect x="{X(a):.1f}" y="{top + row[int(w)] * rh}" width="{max(X(b) - X(a), 0.5):.1f}" '
                   f'height="{rh}" fill="{c}"/>')
    for si, name in enumerate(stages):
        mine = [s for s in spans if int(s[1]) == si]
        c = PALETTE[si % len(PALETTE)]
        ly = top + 12 + 16 * si
        out.append(f'<rect x="{left + pw + 10}" y="{ly - 9}" width="12" height="10" fill="{c}"/>')
        if mine:
            first, last = (min(s[2] for s in mine) - t0) * scale, (max(s[3] for s in mine) - t0) * scale
            busy = sum(s[3] - s[2] for s in mine) * scale
            text = f"{name}: {first:.3g}-{last:.3g} us, busy {busy:.3g} us"
        else:
            text = f"{name}: no span"
        out.append(f'<text x="{left + pw + 26}" y="{ly}" class="tk">{html.escape(text)}</text>')
    out.append("</svg>")
    return "".join(out)


def timeline_table(timeline: dict) -> str:
    """The timeline's per-stage summary (validation/timeline.py stage_summary) as an HTML table:
    where each stage's workers end, and how long its slowest ones keep the rest waiting."""
    try:
        rows = stage_summary(timeline)
    except (ValueError, TypeError, IndexError):
        return ""
    if not rows:
        return ""
    rates = any("tbps" in r for r in rows)

    def rate(r) -> str:
        if not rates:
            return ""
        if "tbps" not in r:
            return "<td></td>"
        of = f" ({100 * r['of_read']:.1f}% of read)" if "of_read" in r else ""
        return f"<td>{r['bytes'] / 1e6:.1f} MB in {r['span_us']:.1f} us: {r['tbps']:.3f} TB/s{of}</td>"

    head = ("<tr><th>stage</th><th>workers</th><th>first start</th><th>end min / median / max</th>"
            "<th>straggle (max - median end)</th><th>busy median / max</th>"
            + ("<th>weights streamed (median start to last end)</th>" if rates else "") + "</tr>")
    body = "".join(
        f"<tr><td>{html.escape(r['stage'])}</td><td>{r['workers']}</td><td>{r['first_start_us']:.1f}</td>"
        f"<td>{r['end_min_us']:.1f} / {r['end_median_us']:.1f} / {r['end_max_us']:.1f}</td>"
        f"<td>{r['straggle_us']:.1f}</td><td>{r['busy_median_us']:.1f} / {r['busy_max_us']:.1f}</td>{rate(r)}</tr>"
        for r in rows)
    return (f'<table class="timeline"><caption>Stages at batch {html.escape(str(timeline.get("batch", "?")))}, '
            f"us from the first timestamp</caption>{head}{body}</table>")


def _problem_label(variant: dict) -> str:
    """A short legend label: the problem without the batch; the default bf16 output dtype omitted."""
    parts = []
    for k, v in sorted(variant.items()):
        if k == "batch" or (k == "out_dtype" and v == "bfloat16"):
            continue
        parts.append(f"{v} out" if k == "out_dtype" else f"{k}={v}")
    return " ".join(parts) or "default"


def _correctness_rows(bundle: dict) -> list[dict]:
    """Per (kernel, variant or op problem): cases, failures, worst ratio and errors."""
    groups: dict[str, list] = defaultdict(list)
    for c in (bundle.get("correctness") or {}).get("cases") or []:
        v = c.get("variant") or {**(c.get("problem") or {}), "batch": c.get("batch")}
        groups[" ".join(f"{k}={x}" for k, x in v.items())].append(c)
    rows = []
    for label, cs in groups.items():
        outs = [o for c in cs for o in c.get("outputs") or []]

        def worst(key):
            vals = [_num(o.get(key)) for o in outs]
            vals = [v for v in vals if v is not None]
            return max(vals) if vals else None

        rows.append({"label": label, "n": len(cs), "failed": sum(1 for c in cs if not c.get("passed")),
                     "ratio": worst("ratio"), "rel_fro": worst("rel_fro"), "ref_rel_fro": worst("ref_rel_fro"),
                     "ulp_max": worst("ulp_max"), "mismatch": worst("mismatch_fraction"),
                     "nan": sum(int(o.get("nan") or 0) + int(o.get("inf") or 0) for o in outs),
                     "dists": sorted({c.get("distribution") for c in cs if c.get("distribution")})})
    return rows


def _risks(bundle: dict) -> list[str]:
    risks = []
    bench = bundle.get("benchmark") or {}
    cases = bench.get("cases") or []
    amb = [c.get("name") or c.get("case_id") for c in cases if c.get("verdict") == "AMBIGUOUS"]
    if amb and bench.get("base_name"):
        risks.append(f"{len(amb)} benchmark case(s) AMBIGUOUS (no speed claim holds there): {', '.join(map(str, amb[:4]))}"
                     + (" ..." if len(amb) > 4 else ""))
    slow = [c.get("name") for c in cases if c.get("verdict") == "SLOW"]
    if slow:
        risks.append(f"{len(slow)} case(s) SLOW against the base: {', '.join(map(str, slow[:4]))}")
    env = bundle.get("environment") or {}
    if env.get("dirty"):
        risks.append("the kernel's sources had uncommitted changes when validated")
    if not bundle.get("signature"):
        risks.append("the bundle is unsigned: its origin is not shown (fasttrack sign on the runner)")
    for d in (bundle.get("defences") or {}).get("checks") or []:
        if not d.get("passed"):
            risks.append(f"defence {d.get('name')} failed: {d.get('detail')}")
    if (bundle.get("race") or {}).get("passed") is False:
        risks.append("the race audit did not pass")
    return risks


def _fmt(v, spec=".3g"):
    n = _num(v)
    return "–" if n is None else format(n, spec)


STAGES = ("correctness", "defences", "race", "benchmark")


def page_verdict(bundle: dict, trust: dict | None) -> dict:
    """{label, css, why}: what the top of the page says. PASS only when the bundle's verdict is
    pass, every stage ran and passed, and the signature verifies (the binding, when checked,
    holds); otherwise the first thing that is not so."""
    trust = trust or {}
    sig = trust.get("signature") or {"status": "unchecked", "reason": "the signature was not checked"}
    bind = trust.get("binding") or {"status": "not_checked", "detail": "the cubin binding was not checked"}
    failed = [n for n in STAGES if isinstance(bundle.get(n), dict) and bundle[n].get("passed") is not True]
    missing = [n for n in STAGES if not isinstance(bundle.get(n), dict)]
    if sig["status"] == "invalid":
        return {"label": "NOT VERIFIED", "css": "fail", "why": f"the signature does not verify: {sig.get('reason')}"}
    if bundle.get("verdict") != "pass" or failed:
        return {"label": "FAIL", "css": "fail",
                "why": "failed: " + ", ".join(failed or ["the bundle's own verdict"])}
    if missing:
        return {"label": "INCOMPLETE", "css": "warn", "why": "did not run: " + ", ".join(missing)}
    if sig["status"] != "ok":
        return {"label": "NOT VERIFIED", "css": "warn", "why": sig.get("reason") or sig["status"]}
    if bind["status"] == "unbound":
        return {"label": "NOT BOUND", "css": "fail", "why": bind.get("detail")}
    return {"label": "PASS", "css": "pass", "why": f"signed by trusted key {sig.get('key_id')}; "
            + ("cubins bound to this checkout's builds" if bind["status"] == "bound" else bind.get("detail", ""))}


def batch_summary(cases: list[dict]) -> list[dict]:
    """Per batch: FAST/SAME/SLOW/other counts and the geomean speedup of its cases."""
    per: dict = defaultdict(list)
    for c in cases:
        b = (c.get("variant") or {}).get("batch", c.get("batch"))
        per[b].append(c)
    rows = []
    for b in sorted(per, key=lambda x: (x is None, x if isinstance(x, (int, float)) else 0)):
        cs = per[b]
        sp = [_num(c.get("speedup")) for c in cs]
        sp = [x for x in sp if x and x > 0]
        verdicts = defaultdict(int)
        for c in cs:
            verdicts[c.get("verdict") or "?"] += 1
        rows.append({"batch": b, "n": len(cs), "FAST": verdicts.pop("FAST", 0), "SAME": verdicts.pop("SAME", 0),
                     "SLOW": verdicts.pop("SLOW", 0), "other": dict(verdicts),
                     "geomean": math.exp(sum(math.log(x) for x in sp) / len(sp)) if sp else None})
    return rows


def reproduce_commands(bundle: dict) -> list[str]:
    """The commands that re-check and re-produce this evidence."""
    ch = bundle.get("change") or {}
    k = ch.get("kernel") or "KERNEL"
    base = ch.get("base")
    cmds = ["fasttrack verify bundle.json   # the signature, against validation/trusted_keys/",
            "fasttrack report bundle.json   # this page, with the signature and cubin binding checked"]
    head = ch.get("head")
    if head:
        cmds.append(f"git checkout {str(head)[:12]}")
    if base and base not in ("torch", "none"):
        cmds += [f"fasttrack validate {k} --base {str(base)[:12]} --prepare",
                 f"PYTHONPATH=. python3 -m validation.cli validate {k} --plan build/validate/{k}/plan.json --out DIR   # GPU host"]
    else:
        cmds.append(f"fasttrack validate {k}" + (f" --base {base}" if base else "") + "   # on a GPU host")
    return cmds


def render_report(bundle: dict, trust: dict | None = None) -> str:
    """The report page for `bundle` (a dict following fasttrack.evidence/1). `trust`:
    {"signature": {status ok|invalid|unsigned|untrusted|unchecked, key_id, reason},
    "binding": {status bound|unbound|not_checked, detail, problems}} as `fasttrack report`
    checked them; absent, the page says they were not checked."""
    from jinja2 import ChainableUndefined, Environment, FileSystemLoader, select_autoescape

    # Optional bundle keys render as empty (ChainableUndefined): a report of a partial bundle
    # still shows what is there.
    env = Environment(loader=FileSystemLoader(str(TEMPLATE_DIR)), autoescape=select_autoescape(["html", "j2"]),
                      undefined=ChainableUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt"] = _fmt
    env.filters["pct"] = lambda v: "–" if _num(v) is None else f"{_num(v):.1%}"
    bench = bundle.get("benchmark") or {}
    cases = bench.get("cases") or []
    speed, frac_head, frac_base = defaultdict(list), defaultdict(list), defaultdict(list)
    speed_band, head_band = defaultdict(list), defaultdict(list)
    for c in cases:
        v = c.get("variant") or {}
        label = _problem_label(v)
        b = v.get("batch", c.get("batch"))
        if _num(c.get("speedup")) is not None:
            speed[label].append((b, c["speedup"]))
            h, bs = c.get("head") or {}, c.get("base") or {}
            if all(_num(x) for x in (h.get("p10"), h.get("p90"), bs.get("p10"), bs.get("p90"))):
                speed_band[label].append((b, bs["p10"] / h["p90"], bs["p90"] / h["p10"]))
            elif _num(c.get("noise")) is not None:
                speed_band[label].append((b, c["speedup"] * (1 - c["noise"]), c["speedup"] * (1 + c["noise"])))
        hb = (c.get("head_bandwidth") or {}).get("fraction_of_read")
        if _num(hb) is not None:
            frac_head[f"{label}"].append((b, hb))
            nm = _num((c.get("head_bandwidth") or {}).get("noise_margin"))
            if nm is not None:
                head_band[label].append((b, hb * (1 - nm), hb * (1 + nm)))
        bb = (c.get("base_bandwidth") or {}).get("fraction_of_read")
        if _num(bb) is not None:
            frac_base[f"{label} (base)"].append((b, bb))
    plots = []
    if speed:
        plots.append(line_plot(dict(speed), title="Speedup over the base (base median / head median)",
                               y_label="speedup", ref_y=1.0, ref_label="1.0 = same", bands=dict(speed_band)))
    if frac_head:
        styles = {}
        for i, label in enumerate(frac_head):
            styles[label] = (i, False)
            styles[f"{label} (base)"] = (i, True)
        plots.append(line_plot({**frac_head, **frac_base}, title="Fraction of the read-only ceiling (dashed: base)",
                               y_label="fraction of read BW", ref_y=1.0, ref_label="ceiling", styles=styles,
                               bands=dict(head_band)))
    timelines = bundle.get("timeline") or []
    for t in timelines if isinstance(timelines, list) else [timelines]:
        if isinstance(t, dict):
            plots.append(timeline_svg(t) + timeline_table(t))
    corr = bundle.get("correctness") or {}
    n_cases = len(corr.get("cases") or [])
    tmpl = env.get_template(TEMPLATE)
    return tmpl.render(b=bundle, change=bundle.get("change") or {}, envd=bundle.get("environment") or {},
                       corr=corr, corr_rows=_correctness_rows(bundle),
                       failed_cases=[c for c in corr.get("cases") or [] if not c.get("passed")][:30],
                       n_cases=n_cases, defences=(bundle.get("defences") or {}).get("checks") or [],
                       race=bundle.get("race"), bench=bench, bench_cases=cases, plots=plots,
                       ceilings=bench.get("ceilings") or {}, risks=_risks(bundle),
                       binaries=bundle.get("binaries") or [], signature=bundle.get("signature"),
                       page=page_verdict(bundle, trust), trust=trust or {}, batches=batch_summary(cases),
                       reproduce=reproduce_commands(bundle))


def check_trust(bundle: dict, trusted_keys_dir, build_root, manifest=None, repo_root=None) -> dict:
    """The `trust` of `render_report`: the signature verified against `trusted_keys_dir`, and
    each head binary compared with this checkout's build of it in `build_root` (found, never
    compiled: `kernels.build.find_artifact`), by cubin sha256 or, when recorded, code sha256."""
    from .bundle import verify_bundle

    res = verify_bundle(bundle, trusted_keys_dir)
    if res.ok:
        sig = {"status": "ok", "key_id": res.key_id, "reason": ""}
    else:
        r = res.reason or ""
        status = ("unsigned" if "not signed" in r else "untrusted" if "not among the trusted" in r
                  else "invalid")
        sig = {"status": status, "key_id": res.key_id, "reason": r}
    heads = [x for x in bundle.get("binaries") or [] if isinstance(x, dict) and x.get("side", "head") == "head"]
    if not heads:
        return {"signature": sig, "binding": {"status": "not_checked", "detail": "the bundle records no head binaries"}}
    try:
        from kernels.build import BuildError, find_artifact
        from kernels.manifest import REPO_ROOT, ManifestError
    except ImportError as e:
        return {"signature": sig, "binding": {"status": "not_checked", "detail": f"cannot read builds here ({e})"}}
    mismatched, missing, bound = [], [], 0
    for x in heads:
        label = f"{x.get('kernel')} {variant_text(x.get('variant'))}"
        try:
            art = find_artifact(x["kernel"], x.get("variant") or {}, x.get("tunables") or {}, root=build_root,
                                manifest=manifest, repo_root=repo_root or REPO_ROOT)
        except (BuildError, ManifestError, KeyError, TypeError) as e:
            missing.append(f"{label}: {str(e).split(': ', 1)[-1][:160]}")
            continue
        code = x.get("cubin_code_sha256")
        if art.cubin_sha256 == x.get("cubin_sha256") or (code and code == art.cubin_code_sha256):
            bound += 1
        else:
            mismatched.append(f"{label}: this checkout builds {art.cubin_sha256[:16]}, the bundle measured "
                              f"{str(x.get('cubin_sha256'))[:16]}")
    if mismatched:
        return {"signature": sig, "binding": {"status": "unbound", "problems": mismatched + missing,
                                              "detail": f"{len(mismatched)} of {len(heads)} cubin(s) differ from this "
                                                        f"checkout's builds ({mismatched[0]})"}}
    if missing:
        return {"signature": sig, "binding": {"status": "not_checked", "problems": missing,
                                              "detail": f"{bound} of {len(heads)} cubin(s) bound; {len(missing)} not "
                                                        f"built here for this checkout ({missing[0]}); "
                                                        "run `fasttrack build` to check them"}}
    return {"signature": sig, "binding": {"status": "bound",
                                          "detail": f"all {len(heads)} cubin(s) equal this checkout's builds"}}


def variant_text(variant) -> str:
    return " ".join(f"{k}={v}" for k, v in (variant or {}).items()) if isinstance(variant, dict) else str(variant)
