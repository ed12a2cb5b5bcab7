"""Tokens of a deep model's trace (estimator/simulate/depth.py): what each event is, not which storage.

An allocation by its bytes, phase, module (its layer number written relative
to the previous allocation's layer: ``+1`` as the forward goes up), op,
category, stream and iteration; a free by what it frees and its rank among
the live allocations of that kind, counted from the newest or the oldest
(whichever is nearer). ``decode`` gives back the same allocations and events.

>>> codec = BlockCodec("model.layers")
>>> codec.decode(codec.tokens(trace, 3), 3) == (trace.allocations, trace.events)  # doctest: +SKIP
True
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence

from estimator.plan.periodic import NotPeriodic, Token
from estimator.trace import Allocation, Trace

# How a free as far from the newest as from the oldest of its kind (the only one live, or the middle of an odd
# number) is named: as the newest, else as the oldest. depth.py tries the first reading, the second where no rule
# holds of it. A kind with one live allocation at depth 1 has one per block deeper: freed in a queue (LoRA's
# adapter gradients, by the optimizer), its frees are the oldest of their kind there, and reading depth 1's as the
# oldest too lets the rule hold from depth 1 (LoRA: depths 1 to 4 instead of 2 to 5).
TIES = ("newest", "oldest")


class BlockCodec:
    """Tokens of a trace whose blocks live under ``container`` (module ``<container>.<k>...``); ``ties``: the
    name of a free as far from the newest as from the oldest of its kind (one of ``TIES``)."""

    def __init__(self, container: str, ties: str = TIES[0]) -> None:
        if ties not in TIES:
            raise ValueError(f"ties: {ties!r}, expected one of {TIES}")
        self.layer = re.compile(rf"(?<![^.]){re.escape(container)}\.(\d+)(?![^.])")
        self.container = container
        self.ties = ties

    def _kind(self, a: Allocation) -> tuple[Hashable, int | None]:
        """(what allocation ``a`` is, without its layer number; its layer number or None)."""
        found = self.layer.search(a.module)
        module = a.module if found is None else f"{a.module[:found.start(1)]}#{a.module[found.end(1):]}"
        return (a.nbytes, a.phase, module, a.op, a.category, a.stream, a.iteration), (
            None if found is None else int(found.group(1)))

    def tokens(self, trace: Trace, depth: int) -> list[Token]:
        out: list[Token] = []
        live: dict[Hashable, list[int]] = {}
        kinds: dict[int, Hashable] = {}
        previous: int | None = None
        for is_alloc, k in trace.events:
            if is_alloc:
                kind, layer = self._kind(trace.allocations[k])
                kinds[k] = kind
                live.setdefault(kind, []).append(k)
                code: Hashable = None
                if layer is not None:
                    if previous is not None and abs(layer - previous) <= 1:
                        code = layer - previous
                    else:
                        code = "first" if layer == 0 else "last" if layer == depth - 1 else ("at", layer)
                    previous = layer
                out.append(("A", kind, code))
            else:
                kind = kinds.pop(k)
                stack = live[kind]
                pos = stack.index(k)
                del stack[pos]
                newest = len(stack) - pos  # 0: the newest of its kind
                nearer = newest < pos or (newest == pos and self.ties == "newest")
                out.append(("F", kind, ("newest", newest) if nearer else ("oldest", pos)))
        return out

    def decode(self, tokens: Sequence[Token], depth: int) -> tuple[list[Allocation], list[tuple[bool, int]]]:
        allocations: list[Allocation] = []
        events: list[tuple[bool, int]] = []
        live: dict[Hashable, list[int]] = {}
        previous: int | None = None
        for op, kind, code in tokens:
            if op == "A":
                fields: tuple[int, str, str, str, str, int, int] = kind
                nbytes, phase, module, name, category, stream, iteration = fields
                if code is not None:
                    layer: int = (previous + code if isinstance(code, int) and previous is not None
                                  else 0 if code == "first" else depth - 1 if code == "last" else code[1])
                    if not 0 <= layer < depth:
                        raise NotPeriodic(f"layer {layer} of {depth}")
                    module = module.replace(f"{self.container}.#", f"{self.container}.{layer}", 1)
                    previous = layer
                live.setdefault(kind, []).append(len(allocations))
                events.append((True, len(allocations)))
                allocations.append(Allocation(nbytes, phase, module, name, iteration, category, stream))
            else:
                stack = live.get(kind, [])
                where: tuple[str, int] = code
                side, rank = where
                pos = len(stack) - 1 - rank if side == "newest" else rank
                if not 0 <= pos < len(stack):
                    raise NotPeriodic(f"a free of rank {rank} among {len(stack)}")
                events.append((False, stack.pop(pos)))
        return allocations, events
