"""Changing a kernel's tunable defaults: the one change the tuner makes.

A kernel's defaults live twice and must agree: in its op module (a module-level dict literal such as
`DEFAULT_TUNABLES = {...}`, one of the kernel's declared sources) and in its manifest entry
(`[kernels.K.tunables]`, `name = { choices = [...], default = v }`). Both are rewritten in place,
touching only the default values, and the manifest change is then checked to be exactly that: the
same manifest with this kernel's tunable defaults changed (the gate treats any other manifest change
as a change of scope).
"""

from __future__ import annotations

import ast
import re


class TunableEditError(ValueError):
    """The defaults cannot be rewritten (no dict literal, unknown tunable, value not a choice)."""


def _find_defaults_dict(tree: ast.Module) -> ast.Dict | None:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            if isinstance(t, ast.Name) and "TUNABLES" in t.id.upper() and isinstance(node.value, ast.Dict):
                return node.value
    return None


def module_defaults(source: str) -> dict | None:
    """The module's default-tunables dict literal, or None when it has none."""
    d = _find_defaults_dict(ast.parse(source))
    return None if d is None else ast.literal_eval(d)


def rewrite_module_defaults(source: str, new_values: dict) -> str:
    """`source` with the default-tunables dict's values for the keys of `new_values` replaced."""
    tree = ast.parse(source)
    d = _find_defaults_dict(tree)
    if d is None:
        raise TunableEditError("the op module has no module-level *TUNABLES dict literal")
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def pos(lineno, col):  # ast columns are UTF-8 byte offsets
        line = lines[lineno - 1]
        return offsets[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8"))

    spans = []
    seen = set()
    for k, v in zip(d.keys, d.values):
        if isinstance(k, ast.Constant) and k.value in new_values:
            spans.append((pos(v.lineno, v.col_offset), pos(v.end_lineno, v.end_col_offset), new_values[k.value]))
            seen.add(k.value)
    missing = set(new_values) - seen
    if missing:
        raise TunableEditError(f"the op module's defaults have no key(s) {sorted(missing)}")
    out = source
    for start, end, value in sorted(spans, reverse=True):
        out = out[:start] + repr(value) + out[end:]
    ast.parse(out)
    return out


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
