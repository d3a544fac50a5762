"""Control-flow graph of one function: basic blocks, dominators, post-dominators, natural loops
and control dependence. Built the same way from PTX and from SASS (branch targets are labels).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import ir

EXIT_NODE = -1  # virtual exit for post-dominators


@dataclass
class Block:
    id: int
    start: int  # first instruction index
    end: int  # one past the last instruction index
    succs: list[int] = field(default_factory=list)
    preds: list[int] = field(default_factory=list)


@dataclass
class Loop:
    header: int
    body: frozenset[int]  # block ids, header included
    back_edges: tuple[tuple[int, int], ...]


class CFG:
    """Blocks of `fn`, reachable from the entry, with the derived relations the rules use."""

    def __init__(self, fn: ir.Function):
        self.fn = fn
        self.blocks: list[Block] = []
        self.block_of: list[int] = []  # instruction index -> block id
        self._build()
        self.rpo = self._rpo()
        self.reachable = set(self.rpo)
        self.idom = self._dominators()
        self.ipdom = self._post_dominators()
        self.loops = self._loops()
        self.control_deps = self._control_dependence()

    # -- construction --------------------------------------------------------------------------
    def _build(self) -> None:
        instrs = self.fn.instrs
        n = len(instrs)
        leaders = {0} if n else set()
        for idx in self.fn.labels.values():
            if idx < n:
                leaders.add(idx)
        for ins in instrs:
            if ins.kind in (ir.BRANCH, ir.EXIT) and ins.index + 1 < n:
                leaders.add(ins.index + 1)
        starts = sorted(leaders)
        self.block_of = [0] * n
        for bid, s in enumerate(starts):
            e = starts[bid + 1] if bid + 1 < len(starts) else n
            self.blocks.append(Block(bid, s, e))
            for k in range(s, e):
                self.block_of[k] = bid
        for b in self.blocks:
            last = instrs[b.end - 1]
            succs: list[int] = []
            falls = True
            if last.kind == ir.BRANCH:
                for t in last.targets:
                    if t in self.fn.labels and self.fn.labels[t] < n:
                        succs.append(self.block_of[self.fn.labels[t]])
                if last.extra.get("indirect"):
                    # Unknown targets: conservatively every labelled block.
                    succs += [self.block_of[i] for i in self.fn.labels.values() if i < n]
                falls = last.conditional
            elif last.kind == ir.EXIT:
                falls = last.conditional
            if falls and b.end < n:
                succs.append(self.block_of[b.end])
            b.succs = list(dict.fromkeys(succs))
        for b in self.blocks:
            for s in b.succs:
                self.blocks[s].preds.append(b.id)

    def _rpo(self) -> list[int]:
        if not self.blocks:
            return []
        seen, order = set(), []
        stack = [(0, iter(self.blocks[0].succs))]
        seen.add(0)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                order.append(node)
                stack.pop()
            elif nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, iter(self.blocks[nxt].succs)))
        return order[::-1]

    @staticmethod
    def _idoms(order: list[int], preds) -> dict[int, int]:
        """Cooper-Harvey-Kennedy iterative dominators over `order` (a reverse post-order)."""
        pos = {b: i for i, b in enumerate(order)}
        idom = {order[0]: order[0]}

        def intersect(a: int, b: int) -> int:
            while a != b:
                while pos[a] > pos[b]:
                    a = idom[a]
                while pos[b] > pos[a]:
                    b = idom[b]
            return a

        changed = True
        while changed:
            changed = False
            for b in order[1:]:
                ps = [p for p in preds(b) if p in idom]
                if not ps:
                    continue
                new = ps[0]
                for p in ps[1:]:
                    new = intersect(p, new)
                if idom.get(b) != new:
                    idom[b] = new
                    changed = True
        return idom

    def _dominators(self) -> dict[int, int]:
        if not self.rpo:
            return {}
        return self._idoms(self.rpo, lambda b: self.blocks[b].preds)

    def _post_dominators(self) -> dict[int, int]:
        if not self.rpo:
            return {}
        # Reverse graph rooted at a virtual exit joined to every block that leaves the function.
        exits = [b for b in self.rpo if not self.blocks[b].succs or self._may_exit(b)]
        rsucc = {EXIT_NODE: exits}
        for b in self.rpo:
            rsucc[b] = [p for p in self.blocks[b].preds if p in self.reachable]
        seen, order = {EXIT_NODE}, []
        stack = [(EXIT_NODE, iter(rsucc[EXIT_NODE]))]
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                order.append(node)
                stack.pop()
            elif nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, iter(rsucc[nxt])))
        order = order[::-1]

        def rpreds(b: int) -> list[int]:
            out = [s for s in self.blocks[b].succs] if b != EXIT_NODE else []
            if b != EXIT_NODE and b in exits:
                out.append(EXIT_NODE)
            return out

        return self._idoms(order, rpreds)

    def _may_exit(self, b: int) -> bool:
        blk = self.blocks[b]
        return any(self.fn.instrs[k].kind == ir.EXIT for k in range(blk.start, blk.end))

    # -- relations -----------------------------------------------------------------------------
    def dominates(self, a: int, b: int) -> bool:
        """Block `a` dominates block `b` (every path from the entry to `b` passes `a`)."""
        if b not in self.idom:
            return False
        while True:
            if a == b:
                return True
            nb = self.idom[b]
            if nb == b:
                return False
            b = nb

    def instr_dominates(self, i: int, j: int) -> bool:
        """Instruction `i` executes before `j` on every path from the entry to `j`."""
        bi, bj = self.block_of[i], self.block_of[j]
        if bi == bj:
            return i < j
        return self.dominates(bi, bj)

    def _loops(self) -> list[Loop]:
        by_header: dict[int, tuple[set[int], list]] = {}
        for b in self.rpo:
            for s in self.blocks[b].succs:
                if self.dominates(s, b):
                    body, edges = by_header.setdefault(s, (set([s]), []))
                    edges.append((b, s))
                    stack = [b]
                    while stack:
                        x = stack.pop()
                        if x not in body:
                            body.add(x)
                            stack.extend(p for p in self.blocks[x].preds if p in self.reachable)
        return [Loop(h, frozenset(body), tuple(edges)) for h, (body, edges) in by_header.items()]

    def innermost_loop(self, block: int, among: list[Loop] | None = None) -> Loop | None:
        cands = [lp for lp in (among if among is not None else self.loops) if block in lp.body]
        return min(cands, key=lambda lp: len(lp.body)) if cands else None

    def _control_dependence(self) -> dict[int, set[int]]:
        """Block -> the branch blocks it is control dependent on (Ferrante et al.)."""
        deps: dict[int, set[int]] = {b: set() for b in self.rpo}
        for x in self.rpo:
            succs = self.blocks[x].succs
            if len(succs) < 2:
                continue
            stop = self.ipdom.get(x)
            for s in succs:
                y = s
                while y != stop and y != EXIT_NODE and y in self.ipdom:
                    deps[y].add(x)
                    ny = self.ipdom[y]
                    if ny == y:
                        break
                    y = ny
        return deps

    def branch_instr(self, block: int) -> ir.Instr:
        return self.fn.instrs[self.blocks[block].end - 1]
