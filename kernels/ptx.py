"""Read what the launcher and the audit need from PTX text: entries, their parameters, launch bounds.

Only the kernel signatures are parsed (`.entry NAME( .param ... ) .reqntid ...`), not the body.
Pure Python; no toolkit needed.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_TYPE_SIZES = {
    "b8": 1, "u8": 1, "s8": 1,
    "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
    "b32": 4, "u32": 4, "s32": 4, "f32": 4,
    "b64": 8, "u64": 8, "s64": 8, "f64": 8,
    "pred": 1,
}

# `.visible .entry NAME(` ... `)` then performance directives up to the body's `{`.
_ENTRY_RE = re.compile(
    r"^[ \t]*(?:\.visible[ \t]+|\.weak[ \t]+)?\.entry[ \t]+([A-Za-z_$%][\w$]*)\s*\((.*?)\)([^{;]*)\{",
    re.S | re.M,
)
_DIRECTIVE_RE = re.compile(r"\.(reqntid|maxntid|minnctapersm|maxnreg|maxclusterrank|reqnctapercluster)\s+([\d,\s]+)")
_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


class PtxError(ValueError):
    """PTX text that does not hold the expected kernel signature."""


@dataclass(frozen=True)
class PtxParam:
    index: int
    name: str
    type: str  # element type without the dot: "u64", "f32", "b8", ...
    size: int  # bytes
    align: int  # bytes
    array: int | None = None  # element count of a `.b8 name[N]` style byte array
    state_space: str | None = None  # for `.ptr .global` style pointers

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PtxEntry:
    name: str
    params: tuple[PtxParam, ...]
    directives: dict  # e.g. {"reqntid": (64, 1, 1), "maxnreg": (128,)}

    def block_bound(self) -> tuple[str, tuple[int, int, int]] | None:
        """("reqntid" | "maxntid", (x, y, z)) when the PTX pins or bounds the block size."""
        for key in ("reqntid", "maxntid"):
            if key in self.directives:
                dims = tuple(self.directives[key]) + (1, 1, 1)
                return key, dims[:3]
        return None


def _parse_param(index: int, text: str) -> PtxParam:
    tokens = text.split()
    if not tokens or tokens[0] != ".param":
        raise PtxError(f"parameter {index}: expected '.param ...', got {text!r}")
    align = None
    typ = None
    space = None
    name = None
    i = 1
    while i < len(tokens):
        tok = tokens[i]
        if tok == ".align":
            try:
                align = int(tokens[i + 1])
            except (IndexError, ValueError):
                raise PtxError(f"parameter {index}: bad .align in {text!r}") from None
            i += 2
            continue
        if tok == ".ptr":
            i += 1
            continue
        if tok in (".global", ".const", ".shared", ".local"):
            space = tok[1:]
            i += 1
            continue
        if tok.startswith(".") and tok[1:] in _TYPE_SIZES:
            typ = tok[1:]
            i += 1
            continue
        if tok.startswith("."):
            raise PtxError(f"parameter {index}: unknown qualifier {tok!r} in {text!r}")
        name = tok
        i += 1
    if typ is None or name is None:
        raise PtxError(f"parameter {index}: no type or name in {text!r}")
    array = None
    m = re.fullmatch(r"([A-Za-z_$%][\w$]*)\[(\d+)\]", name)
    if m:
        name, array = m.group(1), int(m.group(2))
    size = _TYPE_SIZES[typ] * (array or 1)
    return PtxParam(index, name, typ, size, align or _TYPE_SIZES[typ], array, space)


def parse_entries(ptx: str) -> list[PtxEntry]:
    """Every `.entry` in `ptx`, with its parameters (in order) and launch-bound directives."""
    text = _COMMENT_RE.sub("", ptx)
    entries = []
    for m in _ENTRY_RE.finditer(text):
        name, params_text, tail = m.group(1), m.group(2), m.group(3)
        params = []
        chunks = [c.strip() for c in params_text.split(",")]
        if chunks == [""]:
            chunks = []
        for i, chunk in enumerate(chunks):
            params.append(_parse_param(i, chunk))
        directives = {}
        for dm in _DIRECTIVE_RE.finditer(tail):
            directives[dm.group(1)] = tuple(int(v) for v in dm.group(2).replace(",", " ").split())
        entries.append(PtxEntry(name, tuple(params), directives))
    return entries


_EXTERN_SHARED_RE = re.compile(r"^[ \t]*\.extern[ \t]+\.shared\b[^;]*?([A-Za-z_$%][\w$]*)\s*\[\s*\]", re.M)


def dynamic_shared_symbols(ptx: str) -> list[str]:
    """Names of `.extern .shared name[]` arrays: the kernel addresses dynamic shared memory."""
    return _EXTERN_SHARED_RE.findall(_COMMENT_RE.sub("", ptx))


def parse_single_entry(ptx: str, what: str = "PTX") -> PtxEntry:
    """The one `.entry` of `ptx`; PtxError naming `what` if there is none or several."""
    entries = parse_entries(ptx)
    if len(entries) != 1:
        names = ", ".join(e.name for e in entries) or "none"
        raise PtxError(f"{what}: expected exactly one .entry, found {len(entries)} ({names})")
    return entries[0]
