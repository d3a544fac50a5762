"""kernels/cubin.py: a cubin's code hash ignores its line tables and nothing else."""

from __future__ import annotations

import struct

import pytest

from kernels import cubin as C


def _elf(sections: list[tuple[str, bytes]]) -> bytes:
    """A minimal ELF64 little-endian file: a null section, `sections`, then .shstrtab."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in sections) + b".shstrtab\0"
    body = b"".join(b for _, b in sections)
    data_off = 64
    shstr_off = data_off + len(body)
    shoff = shstr_off + len(names)
    hdr = bytearray(64)
    hdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", hdr, 0x28, shoff)
    struct.pack_into("<HHH", hdr, 0x3A, 64, len(sections) + 2, len(sections) + 1)
    table = bytearray(64)  # the null section
    off, name_off = data_off, 1
    for n, b in sections:
        table += struct.pack("<IIQQQQIIQQ", name_off, 1, 0, 0, off, len(b), 0, 0, 1, 0)
        off += len(b)
        name_off += len(n) + 1
    table += struct.pack("<IIQQQQIIQQ", name_off, 3, 0, 0, shstr_off, len(names), 0, 0, 1, 0)
    return bytes(hdr) + body + names + bytes(table)


def test_code_hash_ignores_the_line_tables_only():
    base = [(".text.k", b"\x01\x02\x03\x04"), (".nv.info.k", b"info"), (".debug_line", b"lines 1-9"),
            (".nv_debug_line_sass", b"sass lines")]
    a = _elf(base)
    assert [n for n, _ in C.sections(a)] == ["", ".text.k", ".nv.info.k", ".debug_line", ".nv_debug_line_sass",
                                             ".shstrtab"]
    moved = _elf([base[0], base[1], (".debug_line", b"lines 3-11 and more"), (".nv_debug_line_sass", b"moved")])
    assert a != moved and C.code_sha256(a) == C.code_sha256(moved)
    for changed in ([(".text.k", b"\x01\x02\x03\x05")] + base[1:], [base[0], (".nv.info.k", b"INFO")] + base[2:],
                    base + [(".debug_frame", b"frame")]):
        assert C.code_sha256(_elf(changed)) != C.code_sha256(a)


@pytest.mark.parametrize("data", [b"", b"\x7fELF\x01\x01" + bytes(60), b"not an elf" * 10])
def test_not_a_cubin_is_refused(data):
    with pytest.raises(C.CubinError):
        C.code_sha256(data)


@pytest.mark.slow
def test_a_built_cubin_records_its_code_hash(tmp_path):
    pytest.importorskip("cutlass")
    from kernels.build import build_variant

    art = build_variant("rmsnorm", {"batch": 1, "width": 3584}, root=tmp_path)
    data = art.paths["cubin"].read_bytes()
    names = [n for n, _ in C.sections(data)]
    assert any(n.startswith(".text.") for n in names) and ".debug_line" in names
    assert art.meta["hashes"]["cubin_code_sha256"] == C.code_sha256(data) == art.cubin_code_sha256
