"""Changing a kernel's tunable defaults: the one change the tuner makes.

A kernel's defaults are declared once, in its manifest entry (`[kernels.K.tunables]`,
`name = { choices = [...], default = v }`); the op modules know their tunables by name only and read
the defaults from the manifest (kernels/ops/base.py `op_tunables`). The manifest is rewritten in
place, touching only the default values, and the change is then checked to be exactly that: the
same manifest with this kernel's tunable defaults changed (the gate treats any other manifest change
as a change of scope).
"""

from __future__ import annotations

import re


class TunableEditError(ValueError):
    """The defaults cannot be rewritten (no dict literal, unknown tunable, value not a choice)."""


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def rewrite_manifest_defaults(text: str, kernel: str, new_values: dict) -> str:
    """Manifest text with `default = ...` replaced for the named tunables of `kernel`.

    Handles the inline-table form `name = { choices = [...], default = v }` inside the kernel's
    `[kernels.<kernel>.tunables]` table, which is how the manifest declares tunables.
    """
    lines = text.splitlines(keepends=True)
    header = f"[kernels.{kernel}.tunables]"
    in_table = False
    done = set()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            in_table = stripped == header
            continue
        if not in_table:
            continue
        m = re.match(r"\s*([A-Za-z0-9_\-]+)\s*=", line)
        if not m or m.group(1) not in new_values:
            continue
        name = m.group(1)
        new_line, n = re.subn(r"(\bdefault\s*=\s*)([^,}\s]+)", lambda mm: mm.group(1) + _toml_value(new_values[name]),
                              line, count=1)
        if n != 1:
            raise TunableEditError(f"manifest line for tunable {name!r} has no inline default")
        lines[i] = new_line
        done.add(name)
    missing = set(new_values) - done
    if missing:
        raise TunableEditError(f"manifest table {header} has no tunable(s) {sorted(missing)}")
    return "".join(lines)


def manifest_change_reason(base_text: str, new_text: str, kernel: str) -> str | None:
    """None when `new_text` differs from `base_text` only in `kernel`'s tunable defaults (each still
    one of its choices); otherwise the reason it does not."""
    from kernels.manifest import ManifestError, parse_manifest

    try:
        old, new = parse_manifest(base_text), parse_manifest(new_text)
    except ManifestError as e:
        return f"the changed manifest does not parse: {e}"
    if set(old.kernels) != set(new.kernels):
        return "the manifest change adds or removes kernels"
    for name, o in old.kernels.items():
        n = new.kernels[name]
        if name != kernel:
            if n != o:
                return f"the manifest change touches kernel {name!r}, not only {kernel!r}"
            continue
        same_tunables = [(t.name, t.choices) for t in o.tunables] == [(t.name, t.choices) for t in n.tunables]
        if not same_tunables:
            return f"the manifest change alters {kernel!r}'s tunables' names or choices"
        rest_o = {**o.__dict__, "tunables": None}
        rest_n = {**n.__dict__, "tunables": None}
        if rest_o != rest_n:
            changed = sorted(k for k in rest_o if rest_o[k] != rest_n[k])
            return f"the manifest change alters {kernel!r}'s {', '.join(changed)}, not only tunable defaults"
    return None
