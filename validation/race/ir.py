"""The instruction model both parsers (PTX, SASS) produce and every analysis reads.

An `Instr` is one machine or virtual instruction reduced to what the race rules need: which
registers it defines and reads, which registers form its memory address, what kind of memory or
synchronisation operation it is (with memory semantics and scope), where it branches, and the
Python source line it came from when line info exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Instruction kinds the analyses distinguish.
LOAD = "load"  # global (or generic) memory read
STORE = "store"  # global (or generic) memory write
ATOM = "atom"  # read-modify-write that returns a value
RED = "red"  # read-modify-write without a result
FENCE = "fence"  # gpu/sys-scope fence that orders both ways (fence.acq_rel/sc, membar.gl, MEMBAR.GPU)
FENCE_CTA = "fence_cta"  # fence that orders only inside the CTA (does not order across CTAs)
INVALIDATE = "invalidate"  # SASS CCTL.IVALL: the acquire half of an acquire load or fence
BARRIER = "barrier"  # CTA-wide barrier (bar.sync / BAR.SYNC)
BULK_STORE = "bulk_store"  # async-proxy (TMA / bulk copy) write to global memory
BULK_WAIT = "bulk_wait"  # cp.async.bulk.wait_group (non-.read): drains bulk stores
# griddepcontrol.wait (SASS ACQBULK): under programmatic dependent launch, blocks until the
# previous grid in the stream has completed and its writes are visible.
GRIDDEP_WAIT = "griddep_wait"
BRANCH = "branch"
EXIT = "exit"
OTHER = "other"

MEMORY_KINDS = (LOAD, STORE, ATOM, RED)

# Memory semantics, normalised across PTX and SASS.
WEAK = "weak"
RELAXED = "relaxed"  # also PTX .volatile and SASS .STRONG without a fence
ACQUIRE = "acquire"
RELEASE = "release"
ACQ_REL = "acq_rel"


@dataclass(frozen=True)
class SourceLoc:
    """A Python (or other) source line recovered from PTX .loc or nvdisasm line info."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Instr:
    index: int  # position in the function, 0-based
    text: str  # the instruction as written (one line, no comment)
    opcode: str  # e.g. "ld.global.nc.v4.b32" or "LDG.E.128.CONSTANT"
    kind: str = OTHER
    guard: str | None = None  # predicate register guarding the instruction, if any
    dests: tuple[str, ...] = ()
    srcs: tuple[str, ...] = ()  # registers read (address registers included)
    addr_regs: tuple[str, ...] = ()  # registers forming the memory address
    params_read: tuple[int, ...] = ()  # kernel parameters read directly (ld.param / c[0x0][..])
    reads_tid: bool = False  # reads a thread-varying special register (tid, laneid, ...)
    sem: str = WEAK
    scope: str | None = None  # "cta" | "cluster" | "gpu" | "sys" | None
    nc: bool = False  # non-coherent (read-only cache) load: ld.global.nc / LDG.CONSTANT
    strong: bool = False  # SASS: .STRONG.GPU/.SYS memory op (relaxed or better)
    targets: tuple[str, ...] = ()  # branch target labels
    conditional: bool = False  # a branch/exit that may fall through
    address: int | None = None  # SASS byte offset
    line: int = 0  # 1-based line in the PTX / disassembly text
    loc: SourceLoc | None = None
    extra: dict = field(default_factory=dict)

    @property
    def is_memory(self) -> bool:
        return self.kind in MEMORY_KINDS

    @property
    def writes_memory(self) -> bool:
        return self.kind in (STORE, ATOM, RED, BULK_STORE)

    @property
    def cross_cta_scope(self) -> bool:
        """True when the operation's scope reaches other CTAs (gpu, sys or the default)."""
        return self.scope not in ("cta", "cluster")


@dataclass(frozen=True)
class ParamDecl:
    """One kernel parameter as the PTX entry declares it."""

    index: int
    name: str  # full PTX name, e.g. "<entry>_param_0"
    ptx_type: str  # e.g. "b8" for pointer-sized byte arrays, "u32", "b64"
    size: int  # bytes
    offset: int  # byte offset in the parameter buffer (SASS: c[0x0][base + offset])
    align: int = 8  # its .align (the buffer, and so the SASS base, is aligned to the largest)


@dataclass
class Function:
    """One kernel entry: its parameters (PTX) and instructions with the labels that start blocks."""

    name: str
    instrs: list[Instr]
    labels: dict[str, int]  # label -> index of the first instruction after it
    params: list[ParamDecl] = field(default_factory=list)
    dialect: str = "ptx"  # "ptx" | "sass"

    def location(self, ins: Instr) -> str:
        """A human location: 'ptx line 57' or 'sass 0x00b0'."""
        if self.dialect == "sass" and ins.address is not None:
            return f"sass 0x{ins.address:04x}"
        return f"ptx line {ins.line}"


def split_operands(s: str, opening: str, closing: str) -> list[str]:
    """Split an operand list on the commas outside brackets: `opening`/`closing` name the bracket
    characters of the dialect (PTX nests [], {} and (); SASS [] and ())."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in opening:
            depth += 1
        elif ch in closing:
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out
