"""A cubin's code hash: what a source edit that moves no instruction leaves unchanged.

A cubin carries line tables (DWARF `.debug_line` and NVIDIA's `.nv_debug_line_sass`, with their
relocations) that map each instruction to a source line. An edit to a comment or docstring above
a kernel shifts those lines, so the cubin's bytes, and its sha256, change while every instruction,
constant, resource count and kernel attribute stays the same (measured on moe_w13: two builds a
docstring apart differed in `.debug_line` alone). `code_sha256` hashes every ELF section but the
line tables, by name and contents, in file order: evidence that records it still describes a
rebuilt cubin whose code sha matches, whatever its line numbers (`scripts/evidence_binding.py`).

Pure Python (the GPU host imports it too): a minimal ELF64 little-endian section-table reader.
"""

from __future__ import annotations

import hashlib
import struct

# Sections that hold line information only (and their relocations)
LINE_TABLE_SECTIONS = frozenset({".debug_line", ".rela.debug_line", ".nv_debug_line_sass",
                                 ".rela.nv_debug_line_sass"})
_SHT_NOBITS = 8


class CubinError(ValueError):
    """Bytes that are not a 64-bit little-endian ELF file."""


def sections(data: bytes) -> list[tuple[str, bytes]]:
    """(name, contents) of every section, in section-table order (NOBITS sections: empty)."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise CubinError("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shentsize < 64 or shoff + shnum * shentsize > len(data) or not shstrndx < shnum:
        raise CubinError("section table outside the file")
    hdrs = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = hdrs[shstrndx][4]
    out = []
    for name_off, typ, _flags, _addr, off, size in hdrs:
        start = names_off + name_off
        end = data.find(b"\0", start)
        if end < 0:
            raise CubinError("section name outside the file")
        body = b"" if typ == _SHT_NOBITS else data[off:off + size]
        if typ != _SHT_NOBITS and off + size > len(data):
            raise CubinError("section contents outside the file")
        out.append((data[start:end].decode("latin-1"), body))
    return out


def code_sha256(data: bytes) -> str:
    """sha256 over every section but the line tables: name, length and contents, in order."""
    h = hashlib.sha256()
    for name, body in sections(data):
        if name in LINE_TABLE_SECTIONS:
            continue
        n = name.encode("latin-1")
        h.update(struct.pack("<I", len(n)) + n + struct.pack("<Q", len(body)) + body)
    return h.hexdigest()
