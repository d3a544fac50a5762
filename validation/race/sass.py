"""Disassemble a cubin (nvdisasm from the `nvidia-cuda-nvdisasm` wheel) and parse the SASS.

The SASS is what runs, so the rules that ptxas could invalidate by moving or rewriting code are
checked here too. Parameters reach SASS as constant-bank reads `c[0x0][PARAM_BASE + offset]`,
with the offsets of the PTX parameter list; line info comes from `nvdisasm -g`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from . import ir

# sm_90: kernel parameters start at this offset of constant bank 0, rounded up to the largest
# parameter alignment: a kernel with 64-byte-aligned parameters (TMA tensor maps) has them from
# 0x240 (`_param_base`; measured: moe_w2's `wg` path reads its pointer at PTX offset 0x108 from
# c[0x0][0x348]).
PARAM_BASE = 0x210
# A by-value parameter whose address is taken (a TMA tensor map, read by `UTMALDG` through its
# generic address) is addressed from a pointer the driver keeps at this constant-bank offset,
# which stands for PARAM_BASE: parameter offset `o` lies at [c[0x0][0x198]] + (base - 0x210) + o.
# Measured on this DSL's sm_90a cubins (gemv with wg_tma: the maps at parameter offsets 0 and 128
# are reached as + 0x30 and + 0xb0; tests/test_race_static.py checks it on a fresh build).
PARAM_SPACE_POINTER = 0x198
_UREG = re.compile(r"^(UR\d+|R\d+)$")

# The instruction text is cut from the rest of the line in code, not by the pattern: a lazy body
# followed by optional `;`, comment and whitespace backtracks cubically on the long whitespace
# runs nvdisasm pads some lines with (25 s for one router kernel).
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*)$")
_LABEL = re.compile(r"^\s*(\.L_x_\d+|\.L_\w+):\s*$")
_FUNC = re.compile(r"^\s*\.text\.([\w$]+):\s*$")
_LINEINFO = re.compile(r'^\s*//## File "([^"]*)", line (\d+)')
_REG = re.compile(r"(?<![\w.])(UR\d+|URZ|UP\d|UPT|R\d+|RZ|P\d|PT|SR_[\w.]+)(?:\.(64|128|reuse))?")
_CBANK = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
_TARGET = re.compile(r"`\(([^)]+)\)")
_NO_DEST = (
    "ST", "STG", "STS", "STL", "RED", "REDG", "REDUX_NO", "BRA", "BRX", "JMP", "JMX", "EXIT",
    "RET", "CALL", "BAR", "MEMBAR", "ERRBAR", "CGAERRBAR", "CCTL", "NOP", "BSSY", "BSYNC",
    "WARPSYNC", "YIELD", "DEPBAR", "FENCE", "UTMASTG", "UTMALDG", "UBLKCP", "UTMAREDG", "UTMACCTL",
    "UTMAPF", "SYNCS", "ARRIVES", "BPT", "KILL", "NANOSLEEP", "WARPGROUP", "WARPGROUPSET",
    "ACQBULK", "PREEXIT",
)
_SETP = ("ISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "UISETP", "PLOP3", "UPLOP3", "FCHK")
_CARRY = ("IADD3", "UIADD3", "LEA", "ULEA", "IMAD", "UIMAD")
_THREAD_VARYING = ("SR_TID", "SR_LANEID", "SR_LTMASK", "SR_LEMASK", "SR_GTMASK", "SR_GEMASK", "SR_VIRTUALSMID")


class SassError(RuntimeError):
    """The cubin cannot be disassembled (no nvdisasm, not a cubin)."""


def find_tool(name: str) -> str | None:
    """Path of `name` (nvdisasm, cuobjdump) from the PyPI wheels beside this Python, else PATH."""
    try:
        import nvidia

        for base in getattr(nvidia, "__path__", []):
            for cand in sorted(Path(base).glob(f"*/bin/{name}")):
                if cand.is_file():
                    return str(cand)
    except ImportError:
        pass
    venv_bin = Path(sys.executable).parent / name
    if venv_bin.is_file():
        return str(venv_bin)
    return shutil.which(name)


def disassemble(cubin: str | Path) -> str:
    """SASS text of every function in `cubin`, with line info (`nvdisasm -c -g`)."""
    tool = find_tool("nvdisasm")
    if tool is None:
        raise SassError("nvdisasm not found: install the nvidia-cuda-nvdisasm wheel")
    p = Path(cubin)
    if not p.is_file():
        raise SassError(f"cannot read cubin {p}")
    res = subprocess.run([tool, "-c", "-g", str(p)], capture_output=True, text=True)
    if res.returncode != 0 or "/*0000*/" not in res.stdout:
        msg = (res.stderr or res.stdout).strip().splitlines()
        raise SassError(f"nvdisasm failed on {p.name}: {msg[-1] if msg else 'no output'}")
    return res.stdout


def _expand(reg: str, width: str | None) -> list[str]:
    n = {"64": 2, "128": 4}.get(width or "", 1)
    m = re.match(r"^(U?R)(\d+)$", reg)
    if n == 1 or not m:
        return [reg]
    return [f"{m.group(1)}{int(m.group(2)) + k}" for k in range(n)]


def _operand_regs(op: str) -> list[str]:
    out = []
    for m in _REG.finditer(_CBANK.sub("", op)):
        r, w = m.group(1), m.group(2)
        if r in ("RZ", "PT", "URZ", "UPT"):
            continue
        out += _expand(r, w if w in ("64", "128") else None)
    return out


def _dest_width(opcode: str) -> str | None:
    toks = opcode.split(".")
    if "128" in toks:
        return "128"
    if "64" in toks or "WIDE" in toks or toks[0].startswith("D"):
        return "64"
    return None


def _is_pred(op: str) -> bool:
    return bool(re.fullmatch(r"!?U?(P\d|PT)", op.strip()))


def _classify(ins: ir.Instr, toks: list[str], operands: list[str]) -> None:
    base = toks[0]
    scope = "sys" if "SYS" in toks else "gpu" if "GPU" in toks else "cta" if ("SM" in toks or "CTA" in toks) else None
    if base in ("LDG", "LD"):
        ins.kind = ir.LOAD
        ins.nc = "CONSTANT" in toks
    elif base in ("STG", "ST"):
        ins.kind = ir.STORE
    elif base in ("REDG", "RED"):
        ins.kind = ir.RED
    elif base in ("ATOMG", "ATOM"):
        ins.kind = ir.ATOM
    elif base == "MEMBAR":
        ins.kind = ir.FENCE if scope in ("gpu", "sys") else ir.FENCE_CTA
        ins.sem = ir.ACQ_REL
    elif base == "CCTL" and "IVALL" in toks:
        ins.kind = ir.INVALIDATE
    elif base == "BAR" and any(t in ("SYNC", "RED", "SYNCALL") for t in toks[1:]):
        ins.kind = ir.BARRIER
    elif base in ("BRA", "BRX", "JMP", "JMX"):
        ins.kind = ir.BRANCH
        m = _TARGET.search(" ".join(operands))
        ins.targets = (m.group(1),) if m else ()
        ins.conditional = ins.guard is not None
        if not m:
            ins.extra["indirect"] = True
    elif base in ("WARPSYNC", "SHFL", "VOTE", "MATCH", "REDUX"):
        ins.extra["warp_sync"] = True  # see ptx.py: warp-synchronous operations
    elif base in ("EXIT", "RET", "KILL"):
        ins.kind = ir.EXIT
        ins.conditional = ins.guard is not None
    elif base == "ACQBULK":  # what ptxas emits for griddepcontrol.wait on sm_90
        ins.kind = ir.GRIDDEP_WAIT
    elif base in ("UTMASTG", "UTMAREDG") or (base == "UBLKCP" and ".G.S" in ins.opcode):
        ins.kind = ir.BULK_STORE
        if operands and base == "UBLKCP":  # the global destination is the first operand
            o = operands[0]
            ins.addr_regs = tuple(_operand_regs(o[o.rfind("["):] if "[" in o else o))
        return
    elif base in ("LDGSTS", "UTMALDG") or (base == "UBLKCP" and ".S.G" in ins.opcode):
        # Global -> shared copies (cp.async, TMA and bulk loads) read global memory: weak loads
        # whose address is the second (global) operand, not the shared destination.
        ins.kind = ir.LOAD
        ins.sem = ir.WEAK
        if len(operands) > 1:
            o = operands[1]
            ins.addr_regs = tuple(_operand_regs(o[o.rfind("["):] if "[" in o else o))
        return
    if ins.kind in ir.MEMORY_KINDS:
        ins.strong = "STRONG" in toks
        ins.scope = scope
        # Without the .STRONG qualifier a SASS memory op is weak; ordering comes from the
        # surrounding MEMBAR / CCTL.IVALL, which the analyses track.
        ins.sem = ir.RELAXED if ins.strong else ir.WEAK
        for o in operands:
            if "[" in o and not o.lstrip().startswith("c["):
                last = o[o.rfind("[") :]
                ins.addr_regs = tuple(_operand_regs(last))
                im = re.search(r"\+\s*(-?0x[0-9a-f]+)\s*\]", last)
                ins.extra["addr_imm"] = int(im.group(1), 16) if im else 0
                break


def parse_sass(text: str, params: list[ir.ParamDecl] | None = None) -> list[ir.Function]:
    """Every function in nvdisasm output `text`. `params` (from the PTX) maps c[0x0][..] reads."""
    funcs: list[ir.Function] = []
    cur: ir.Function | None = None
    loc: ir.SourceLoc | None = None
    params = params or []
    for lineno, raw in enumerate(text.splitlines(), 1):
        m = _FUNC.match(raw)
        if m:
            cur = ir.Function(name=m.group(1), instrs=[], labels={}, params=list(params), dialect="sass")
            funcs.append(cur)
            loc = None
            continue
        if cur is None:
            continue
        m = _LINEINFO.match(raw)
        if m:
            loc = ir.SourceLoc(m.group(1), int(m.group(2)))
            continue
        m = _LABEL.match(raw)
        if m:
            cur.labels[m.group(1)] = len(cur.instrs)
            continue
        m = _INSTR.match(raw)
        if not m:
            continue
        ins = _parse_instr(_instr_text(m.group(2)), len(cur.instrs), int(m.group(1), 16), lineno, loc, params)
        if ins is not None:
            cur.instrs.append(ins)
    for f in funcs:
        _param_space_addresses(f, params)
    if not funcs:
        raise SassError("no function found in the disassembly")
    return funcs


def _param_space_addresses(fn: ir.Function, params: list[ir.ParamDecl]) -> None:
    """Tag the address arithmetic that reaches a by-value parameter through the parameter
    space's generic pointer (see PARAM_SPACE_POINTER): `ULDC.64 URa, c[0x0][0x198]` makes URa
    that pointer (offset 0); `UIADD3 URb, UPx, URa, imm, URZ` makes URb the pointer plus imm
    (chains add up, in place or not); a move (`MOV`, `UMOV`, `R2UR`: ptxas spills a uniform
    register through a vector one) copies the offset. An add that lands on the address of a
    parameter (see PARAM_SPACE_POINTER) is tagged with that parameter, so a TMA copy
    through it is attributed to it like a load through a pointer parameter. Straight-line last
    definitions only: an address formed any other way keeps no parameter (the rules then warn
    of unknown provenance, and refuse it before griddepcontrol.wait)."""
    offset: dict[str, int] = {}  # register -> its offset from the parameter space pointer
    pointer = f"c[0x0][{PARAM_SPACE_POINTER:#x}]"
    for ins in fn.instrs:
        op = ins.opcode.split(".")[0]
        new: int | None = None
        if op in ("ULDC", "LDC") and pointer in ins.text:
            new = 0
        elif offset and op in ("UIADD3", "MOV", "UMOV", "R2UR"):
            parts = ir.split_operands(ins.text.split(None, 1)[1], "[(", "])") if " " in ins.text else []
            srcs = [p.split(".")[0] for p in parts if not p.startswith(("UP", "!UP", "P", "!P"))][1:]
            if op == "UIADD3":
                regs = [p for p in srcs if _UREG.match(p)]
                imms = [p for p in srcs if p.startswith("0x")]
                if len(regs) == 1 and regs[0] in offset and len(imms) == 1:
                    new = offset[regs[0]] + int(imms[0], 16)
                    pi = _param_at(PARAM_BASE + new, params)
                    if pi is not None:
                        ins.extra["param_exact"] = pi  # this parameter only, not what the chain passed
            elif len(srcs) == 1 and srcs[0] in offset:
                new = offset[srcs[0]]
        # every register this instruction writes no longer holds a known offset, except its
        # first destination when it now holds `new`
        for d in ins.dests:
            offset.pop(d, None)
        if new is not None and ins.dests:
            offset[ins.dests[0]] = new


def _instr_text(rest: str) -> str:
    """The instruction of a disassembly line's remainder: up to its `/* encoding */` comment,
    without the trailing `;` and whitespace."""
    cut = rest.find("/*")
    body = (rest[:cut] if cut >= 0 else rest).strip()
    return body[:-1].rstrip() if body.endswith(";") else body


def _param_base(params: list[ir.ParamDecl]) -> int:
    """The constant-bank offset of parameter offset 0: PARAM_BASE rounded up to the largest
    parameter alignment."""
    a = max([8] + [p.align for p in params])
    return (PARAM_BASE + a - 1) // a * a


def _param_at(offset: int, params: list[ir.ParamDecl]) -> int | None:
    """The parameter at constant-bank offset `offset` (None: none)."""
    rel = offset - _param_base(params)
    for p in params:
        if p.offset <= rel < p.offset + p.size:
            return p.index
    return None


def _parse_instr(body, index, address, lineno, loc, params) -> ir.Instr | None:
    body = body.strip().rstrip(";").strip()
    guard = guard_raw = None
    if body.startswith("@"):
        g, _, body = body.partition(" ")
        guard_raw = g[1:]
        guard = guard_raw.lstrip("!")
        body = body.strip()
        if guard in ("PT", "UPT"):
            guard = guard_raw = None
    parts = body.split(None, 1)
    if not parts:
        return None
    opcode = parts[0]
    operands = ir.split_operands(parts[1], "[(", "])") if len(parts) > 1 else []
    toks = opcode.split(".")
    ins = ir.Instr(index=index, text=body, opcode=opcode, guard=guard, address=address, line=lineno, loc=loc)
    _classify(ins, toks, operands)
    if guard_raw:
        ins.extra["guard_raw"] = guard_raw
    base = toks[0]
    dest_ops: list[str] = []
    if base not in _NO_DEST and ins.kind not in (ir.STORE, ir.RED, ir.BULK_STORE) and operands:
        if base in _SETP:
            dest_ops = [o for o in operands[:2] if _is_pred(o)]
        else:
            k = 0
            while k < len(operands) and _is_pred(operands[k]):
                dest_ops.append(operands[k])
                k += 1
            if k < len(operands) and not operands[k].startswith(("c[", "desc", "[", "0x", "-", "|", "!", "~")):
                dest_ops.append(operands[k])
                k += 1
                if base in _CARRY and "X" not in toks and k < len(operands) and _is_pred(operands[k]):
                    dest_ops.append(operands[k])
    dests: list[str] = []
    width = _dest_width(opcode)
    for o in dest_ops:
        for m in _REG.finditer(o):
            r = m.group(1)
            if r not in ("RZ", "PT", "URZ", "UPT"):
                dests += _expand(r, width)
    src_ops = operands[len(dest_ops):]
    srcs: list[str] = []
    pread: list[int] = []
    for o in src_ops:
        srcs += _operand_regs(o)
        for cm in _CBANK.finditer(o):
            pi = _param_at(int(cm.group(1), 16), params)
            if pi is not None:
                pread.append(pi)
    if guard:
        srcs.append(guard)
    ins.dests = tuple(dests)
    ins.srcs = tuple(srcs)
    ins.params_read = tuple(pread)
    if base in ("IADD3", "IADD", "UIADD3") and not guard:
        imms = [o for o in src_ops if re.fullmatch(r"-?0x[0-9a-f]+", o.strip())]
        if len(imms) == 1 and len([r for r in srcs if not r.startswith(("P", "UP"))]) == 1:
            ins.extra["imm_add"] = int(imms[0].strip(), 16)
    elif base in ("IMAD", "UIMAD", "SHF", "USHF", "IMUL", "LEA", "ULEA") and "MOV" not in toks:
        # the addend keeps its offset: IMAD d, a, b, c (operand c), LEA d, a, b (operand b)
        k = {"IMAD": 2, "UIMAD": 2, "LEA": 1, "ULEA": 1}.get(base)
        ins.extra["scales"] = _operand_regs(src_ops[k]) if k is not None and k < len(src_ops) else []
    ins.reads_tid = any(s.startswith(_THREAD_VARYING) for s in srcs)
    if ins.reads_tid and all(s.startswith("SR_LANEID") for s in srcs if s.startswith(_THREAD_VARYING)):
        ins.extra["lane_src"] = True  # varies only between the lanes of a warp
    return ins
