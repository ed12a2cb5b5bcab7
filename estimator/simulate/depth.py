"""A deep model's step from three shallow ones: blocks that repeat, simulated three times instead of 32.

>>> trace = Deepener(built, recipe).record(2, get_gpu("A100-80GB"))           # doctest: +SKIP

A decoder of 32 identical layers records the same events for every layer:
its trace at depth ``d + 1`` is the trace at ``d`` with the same segments
inserted at fixed points (one layer's forward, its backward, its gradients,
its optimizer step, ...), and the trace at ``d + 2`` has each segment twice.
When the traces at depths 1, 2 and 3 are periodic so, the trace at the full
depth is the one at depth 1 with each segment inserted ``depth - 1`` times:
recorded with 6 layers simulated instead of 32.

Events are compared as tokens that name what they are, not which storage:
an allocation by its bytes, phase, module (its layer number written relative
to the previous allocation's layer: ``+1`` as the forward goes up), op,
category, stream and iteration; a free by what it frees and its rank among
the live allocations of that kind, counted from the newest or the oldest
(whichever is nearer: activations go LIFO, a foreach op's outputs FIFO).
Decoding tokens gives back the same allocations, in order, and the same
events: ``tokens`` and ``decode`` are checked to round-trip on each trace.

Anything that does not repeat falls back to the full simulation, which is
the answer by definition: a segment that is not inserted the same way
twice, a free whose rank changes with depth, notes or SDPA calls that
change, an error at a shallow depth. Not tried where the memory groups
layers across block boundaries (DDP's gradient buckets, ZeRO-1's optimizer
partitions) or for models under 8 blocks (where three shallow runs save
little). tests/test_depth.py checks the shortcut byte for byte against full
simulations, the golden requests included.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
from collections.abc import Hashable, Sequence

from estimator.errors import SimulationError, SpecError
from estimator.gpus import GPU
from estimator.models import BuiltModel
from estimator.plan.periodic import NotPeriodic, Rule, Token, holds, inserts
from estimator.simulate import background
from estimator.simulate.block_tokens import TIES, BlockCodec
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_built
from estimator.trace import Trace

log = logging.getLogger(__name__)

BASE = 1  # the shallowest depth recorded: then BASE + 1 and BASE + 2
MIN_LAYERS = 8  # below this, three shallow runs (BASE * 3 + 3 layers) save too little
# strategies whose memory groups parameters across blocks: DDP's 25 MiB buckets, ZeRO-1's partitions by rank
_GROUPING = frozenset({"ddp", "zero1"})


def _line_at(same: Sequence[str], depths: Sequence[int], depth: int) -> str:
    """One note line at ``depth`` from the line at ``depths``: each number in it that differs between them is
    the depth ("on each of 3 blocks"), the rest stay ("over 8 ranks"); NotPeriodic for a line that changes
    otherwise."""
    parts = [re.split(r"(\d+)", line) for line in same]  # odd places: the numbers
    if len({len(p) for p in parts}) > 1:
        raise NotPeriodic(f"a note changes with depth: {same[-1]}")
    out = []
    for k, values in enumerate(zip(*parts, strict=True)):
        if len(set(values)) == 1:
            out.append(values[0])
        elif k % 2 and [int(v) for v in values] == list(depths):
            out.append(str(depth))
        else:
            raise NotPeriodic(f"a note changes with depth: {same[-1]}")
    return "".join(out)


def _lines_at(lines: Sequence[Sequence[str]], depths: Sequence[int], depth: int) -> list[str]:
    """Note lines at ``depth`` from the same lines at ``depths`` (``_line_at``)."""
    if len({len(x) for x in lines}) != 1:
        raise NotPeriodic("notes come and go with depth")
    return [_line_at(same, depths, depth) for same in zip(*lines, strict=True)]


def deepen(traces: dict[int, Trace], container: str, depth: int, known: Rule | None = None) -> tuple[Trace, Rule]:
    """The trace at ``depth`` from shallow ``traces`` (by depth), and the rule it grew by: ``known`` (checked at
    another batch) with this batch's segments when their shape is the same, read as it was read there, else the
    first rule that holds (``_rule``) of the first reading of ties that has one (``TIES``). NotPeriodic when none
    does; Deeper when a deeper shallow trace may tell."""
    failed: NotPeriodic | None = None
    for ties in (known.reading or TIES[0],) if known is not None else TIES:
        codec = BlockCodec(container, ties)
        tokens: dict[int, list[Token]] = {}
        for n, trace in traces.items():
            t = codec.tokens(trace, n)
            if codec.decode(t, n) != (trace.allocations, trace.events):
                raise NotPeriodic(f"the trace at depth {n} does not round-trip")
            tokens[n] = t
        try:
            rule = dataclasses.replace(_rule(tokens, known), reading=ties)
            break
        except NotPeriodic as exc:  # Deeper included: the same depths read the other way may hold
            failed = failed or exc
    else:
        assert failed is not None
        raise failed
    depths = list(rule.again if known is not None else rule.depths)
    used = [traces[n] for n in depths]
    if len({(repr(t.sdpa_calls), tuple(t.card_queries), tuple(t.capability_thresholds)) for t in used}) > 1:
        raise NotPeriodic("the SDPA calls or the card's kernels change with depth")
    a, b = used[0], used[1]
    if len(used) > 2 and used[2].flops - b.flops != b.flops - a.flops:
        raise NotPeriodic("the FLOPs are not affine in depth")
    allocations, events = codec.decode(rule.grown(tokens[rule.base], depth - rule.base), depth)
    return dataclasses.replace(
        used[-1], allocations=allocations, events=events, flops=a.flops + (b.flops - a.flops) * (depth - depths[0]),
        unsupported=_lines_at([t.unsupported for t in used], depths, depth),
        assumptions=_lines_at([t.assumptions for t in used], depths, depth)), rule


DEEPEST = 5  # the deepest shallow trace a first search records: rules checked by it, drifting ones fitted below


class Deeper(NotPeriodic):
    """No rule holds of the depths recorded so far; one more may tell."""


def _rule(tokens: dict[int, list[Token]], known: Rule | None) -> Rule:
    if known is not None:  # checked at another batch: the same shape again, with this batch's segments
        found = inserts(tokens[known.base], tokens[known.base + 1])
        # its moves per block as where it was checked (a repeated rule's follow from the segments' lengths)
        rule = dataclasses.replace(known, positions=tuple(p for p, _ in found),
                                   segments=tuple(tuple(s) for _, s in found))
        if rule.shape != known.shape:
            raise NotPeriodic(f"the blocks do not repeat as they did at another batch ({known.kind})")
        return rule
    # in the order of the depths they need: 1-3, 2-4 (twice), 2-5
    for kind, base in (("repeated", 1), ("repeated", 2), ("drifting", 2), ("drifting", 3)):
        held = holds(kind, base, tokens)
        if held is not None:
            return held
    if any(n not in tokens for n in range(1, DEEPEST + 1)):  # a first search may start past depth 1
        raise Deeper(f"no rule holds at depths {', '.join(map(str, sorted(tokens)))}")
    raise NotPeriodic(f"the blocks do not repeat alike at depths 1 to {DEEPEST}")





def worth_it(built: BuiltModel, recipe: Recipe) -> bool:
    """Whether the shortcut may be tried for ``built`` trained with ``recipe``."""
    depth = built.depth
    return (depth is not None and depth.layers >= MIN_LAYERS and built.step_fn is None
            and not (recipe.distributed.active and recipe.distributed.strategy in _GROUPING))


# (model name, parameters, build notes (LoRA's, a quantization's), container, blocks, strategy, checkpointing,
# optimizer) -> (kind, base) of the rule its step grew by: which shallow depths a step of the same model and
# recipe family simulates first (``Deepener._plan``)
_FOUND: dict[tuple[Hashable, ...], tuple[str, int]] = {}
MAX_FAMILIES = 1024


# what a shallow simulation ran with besides its batch and depth: (recipe, card, notes); compared, not hashed
_With = tuple[Recipe, GPU | None, tuple[str, ...]]


# ``Deepener.found``: whether the blocks repeat (None: not tried), the rule, and ``_FOUND``
Found = tuple[bool | None, Rule | None, dict[tuple[Hashable, ...], tuple[str, int]]]


def _family(built: BuiltModel, recipe: Recipe) -> tuple[Hashable, ...]:
    depth = built.depth
    assert depth is not None
    return (built.name, built.parameter_count, tuple(built.assumptions), depth.container, depth.layers,
            recipe.distributed.strategy, recipe.gradient_checkpointing, recipe.optimizer)


# (family, input, the recipe but its world size and rank) -> the rule the first distributed step of it grew by,
# with the reading it was found with: another world size's (or rank's) first simulation of the same model, input
# and recipe follows it, as a later batch does (``Deepener._deepened``); searched again where it does not hold.
# The parent's own (a child's stay there).
_WORLD_RULES: dict[tuple[Hashable, ...], Rule] = {}


def _worlds(built: BuiltModel, recipe: Recipe) -> tuple[Hashable, ...]:
    """The key of ``_WORLD_RULES``: what a step's rule depends on but its world size and rank."""
    d = recipe.distributed
    others = [(f.name, getattr(recipe, f.name)) for f in dataclasses.fields(recipe) if f.name != "distributed"]
    strategy = [(f.name, getattr(d, f.name)) for f in dataclasses.fields(d) if f.name not in ("world_size", "rank")]
    return (*_family(built, recipe), repr(sorted(built.input.items())), repr(others), repr(strategy))


def _bounded(table: dict) -> None:
    """The oldest entries of ``table`` forgotten past ``MAX_FAMILIES`` (a long-lived worker's)."""
    while len(table) > MAX_FAMILIES:
        del table[next(iter(table))]


def _remember(families: dict[tuple[Hashable, ...], tuple[str, int]]) -> None:
    """Note the rules ``families`` grew by in ``_FOUND``, the oldest forgotten past ``MAX_FAMILIES``."""
    _FOUND.update(families)
    _bounded(_FOUND)


def _checked_on(kind: str, base: int) -> range:
    """The shallow depths a rule of ``kind`` at ``base`` is found and checked on (``holds``)."""
    return range(base if kind == "repeated" else base - 1, base + 3)


def _lanes(jobs: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Shallow simulations ``(batch, depth)`` split in two, here and in a child, as evenly as their costs allow (a
    fixed part and one per block: depth ``n`` costs about ``n + 1`` at any small batch); among even splits, the
    deepest to the child (it starts at once) and as few of the first batch's as may be (a child that fails leaves
    them to this process). Each lane in order: the first batch's depths, then the others'."""
    first = jobs[0][0] if jobs else 0
    deepest = max(jobs, key=lambda j: (j[1], j[0] == first), default=None)

    def cost(lane: Sequence[tuple[int, int]]) -> int:
        return sum(n + 1 for _, n in lane)

    best: tuple[tuple[int, ...], list[tuple[int, int]], list[tuple[int, int]]] | None = None
    for mask in range(2 ** len(jobs)):  # a handful of jobs: every split
        child = [j for k, j in enumerate(jobs) if mask >> k & 1]
        here = [j for k, j in enumerate(jobs) if not mask >> k & 1]
        key = (max(cost(here), cost(child)), deepest not in child, sum(b == first for b, _ in child), cost(child))
        if best is None or key < best[0]:
            best = key, here, child
    assert best is not None
    order = lambda j: (j[0] != first, j[0], j[1])  # noqa: E731 - the sort key of both lanes
    return sorted(best[1], key=order), sorted(best[2], key=order)


class Deepener:
    """``record_built`` for one model, through shallow simulations where its blocks repeat (``deepen``): depths
    1 to 3 (and deeper the first time, when the rule needs them); in full once they turn out not to repeat.
    The rule found at the first batch is the one later batches must follow. Where a core is spare
    (``background.spare_core``), the deepest shallow simulations of a round run in a forked child beside the
    others, and a first search starts at the depths the last rule of the same model and recipe family needed
    (the rules are searched and checked on them as always: only the order of the simulations changes). A batch
    the planner will ask for next (``expect``) has its shallow depths simulated in the first search's split."""

    def __init__(self, built: BuiltModel) -> None:
        self.built = built
        self.periodic: bool | None = None  # None: not tried yet
        self.rule: Rule | None = None
        self.shallow: dict[int, BuiltModel | None] = {}
        self._expected: tuple[int, _With] | None = None  # the batch ``expect`` named
        self._early: dict[tuple[int, int], tuple[_With, Trace]] = {}  # (batch, depth): simulated before asked for

    def expect(self, batch: int, recipe: Recipe, gpu: GPU | None, notes: Sequence[str] = ()) -> None:
        """The planner asks for ``batch`` next (every search needs batch 2 beside the first): where the first
        search splits its depths with a child, the depths ``batch`` will simulate by the rule the search is likely
        to find (the family's, else the prior) run in the same split; ``record`` takes them from there."""
        self._expected = batch, (recipe, gpu, tuple(notes))

    def will_search(self, recipe: Recipe) -> bool:
        """Whether the next simulation may search the blocks' rule (none known yet, the shortcut not refused; a
        distributed step may follow another world's, ``_WORLD_RULES``)."""
        return self.periodic is None and self.rule is None and worth_it(self.built, recipe)

    def found(self) -> Found:
        """What the simulations so far found: whether the blocks repeat, by which rule, and the rules of the
        model and recipe families this process has seen."""
        return self.periodic, self.rule, dict(_FOUND)

    def learn(self, found: Found) -> None:
        """Take what another simulator of the same model ``found`` (a forked child's), where this one has not
        tried yet: the rule saves the search, a refusal the shallow simulations that would be refused again."""
        periodic, rule, families = found
        _remember(families)
        if self.periodic is None and periodic is not None:
            self.periodic, self.rule = periodic, rule

    def record(self, batch: int, recipe: Recipe, gpu: GPU | None, notes: Sequence[str] = ()) -> Trace:
        if self.periodic is not False and worth_it(self.built, recipe):
            try:
                trace = self._deepened(batch, recipe, gpu, notes)
                self.periodic = True
                return trace
            except (NotPeriodic, SimulationError, SpecError) as exc:
                log.info("%s: simulated at full depth (%s)", self.built.name, exc)
                self.periodic = self.periodic or False  # a rule that held at another batch stays tried
        return record_built(self.built, batch, recipe, gpu, notes=notes)

    def _shallow(self, n: int, batch: int, recipe: Recipe, gpu: GPU | None, notes: Sequence[str]) -> Trace:
        depth = self.built.depth
        assert depth is not None
        if n not in self.shallow:  # the build is the model's (shared); its worst-case flag this simulator's own
            built = depth.at(n)
            self.shallow[n] = None if built is None else dataclasses.replace(built)
        shallow = self.shallow[n]
        if shallow is None:
            raise NotPeriodic(f"the model built with {n} blocks is not the full model's blocks repeated")
        was = shallow.worst_case = shallow.worst_case or self.built.worst_case
        trace = record_built(shallow, batch, recipe, gpu, notes=notes)
        if shallow.worst_case and not was:
            raise NotPeriodic("the worst-case policy was needed at a shallow depth")  # the full step decides
        return trace

    def _plan(self, recipe: Recipe) -> tuple[range, range]:
        """The depths a first search simulates first: those the family's last rule was found and checked on,
        else those of the rule such steps grow by: depths 1 to 3, 2 to 4 under FSDP, those the builder names
        (``Depth.grows_by``: 1 to 4 with adapters). And the depths that rule simulates at another batch
        (``Rule.again``)."""
        depth = self.built.depth
        assert depth is not None
        # FSDP keeps the last block's gathered parameters: depth 1 is unlike the others (the rule at 2)
        prior = ("repeated", 2) if recipe.distributed.strategy == "fsdp" else depth.grows_by or ("repeated", 1)
        kind, base = _FOUND.get(_family(self.built, recipe), prior)
        if sum(_checked_on(kind, base)) >= depth.layers:  # never more blocks than the full model
            kind, base = "repeated", 1
        return _checked_on(kind, base), range(base, base + 2)  # (the second: ``Rule.again`` of that rule)

    def _shallows(self, depths: Sequence[int], batch: int, recipe: Recipe, gpu: GPU | None,
                  notes: Sequence[str], also: Sequence[tuple[int, int]] = ()) -> dict[int, Trace]:
        """The shallow traces at ``depths`` (those simulated early taken from there): split with a forked child
        where a core is spare (``_lanes``), and with them the ``(batch, depth)`` simulations ``also`` names, kept
        for when their batch is asked for; here when no core is spare (``also`` then waits), or the child fails (an
        error raised as it would have been)."""
        with_: _With = (recipe, gpu, tuple(notes))
        traces = {}
        for n in depths:
            early = self._early.pop((batch, n), None)
            if early is not None and early[0] == with_:
                traces[n] = early[1]
        jobs = [(batch, n) for n in depths if n not in traces]
        spare = background.spare_core()
        if spare:
            jobs += [j for j in also if j not in self._early]
        here, there = _lanes(jobs) if len(jobs) > 1 and spare else (jobs, [])

        def run() -> dict[tuple[int, int], Trace]:
            done = {}
            for b, n in there:
                try:
                    done[b, n] = self._shallow(n, b, recipe, gpu, notes)
                except Exception:  # noqa: BLE001 - its batch, asked for, simulates it again (and raises)
                    if b == batch:
                        break  # this batch's own: the parent needs it anyway
            return done

        child = background.Background(run) if there else None
        try:
            done = {j: self._shallow(j[1], j[0], recipe, gpu, notes) for j in here}
            fetched = child.result(timeout=background.STUCK_S) if child is not None else None
        finally:
            if child is not None:
                child.close()
        done.update(fetched or {})
        for (b, n), trace in done.items():
            if b == batch:
                traces[n] = trace
            else:
                self._early[b, n] = with_, trace
        for n in depths:  # the child's that failed, or none ran there
            if n not in traces:
                traces[n] = self._shallow(n, batch, recipe, gpu, notes)
        return dict(sorted(traces.items()))

    def _also(self, batch: int, again: Sequence[int], recipe: Recipe, gpu: GPU | None,
              notes: Sequence[str]) -> list[tuple[int, int]]:
        """The ``(batch, depth)`` simulations of the batch ``expect`` named, at the depths ``again`` (a rule's
        at another batch), where it was named with this recipe, card and notes; taken, once."""
        expected, self._expected = self._expected, None
        if expected is None or expected[0] == batch or expected[1] != (recipe, gpu, tuple(notes)):
            return []
        return [(expected[0], n) for n in again]

    def _ahead(self, n: int, traces: dict[int, Trace], batch: int, recipe: Recipe, gpu: GPU | None,
               notes: Sequence[str]) -> tuple[int, background.Background] | None:
        """Where a core is spare, the depth after ``n`` started in a child while ``n`` is simulated here: a
        search one depth short of a rule needs it next (LoRA's drifting rule, depths 1 to 5), and one that
        finds its rule at ``n`` kills it."""
        depth = self.built.depth
        assert depth is not None
        m = next(k for k in itertools.count(n + 1) if k not in traces)
        if not background.spare_core() or sum(traces) + n + m >= depth.layers:
            return None
        return m, background.Background(lambda: self._shallow(m, batch, recipe, gpu, notes))

    def _deepened(self, batch: int, recipe: Recipe, gpu: GPU | None, notes: Sequence[str]) -> Trace:
        depth = self.built.depth
        assert depth is not None
        known = self.rule
        elsewhere = known is None and recipe.distributed.active  # another world's rule, where one is known
        if elsewhere:
            known = _WORLD_RULES.get(_worlds(self.built, recipe))
        if known is None:
            plan, again = self._plan(recipe)
            traces = self._shallows(plan, batch, recipe, gpu, notes, self._also(batch, again, recipe, gpu, notes))
        else:
            also = self._also(batch, known.again, recipe, gpu, notes) if elsewhere else []
            traces = self._shallows(known.again, batch, recipe, gpu, notes, also)
            try:
                trace, rule = deepen(traces, depth.container, depth.layers, known)
                if elsewhere:
                    self.rule = rule  # this world's segments, the shape checked at another world
                return self._noted(trace, known.kind, sorted(traces))
            except NotPeriodic as exc:  # an alignment that came out otherwise at this batch: search again,
                log.info("%s at batch %d: %s; the rule searched again", self.built.name, batch, exc)
                # from the depths the rule was found and checked on at its first batch, simulated side by side
                more = [n for n in _checked_on(known.kind, known.base) if n not in traces]
                if sum(traces) + sum(more) < depth.layers:  # else the search below gives up as it would
                    traces = {**traces, **self._shallows(more, batch, recipe, gpu, notes)}
        ahead: tuple[int, background.Background] | None = None  # the depth after the next, in a child
        try:
            while True:
                try:
                    trace, rule = deepen(traces, depth.container, depth.layers)
                    break
                except Deeper:
                    n = next(k for k in itertools.count(1) if k not in traces)
                    if sum(traces) + n >= depth.layers:  # no cheaper than the full simulation any more
                        raise
                    if ahead is not None and ahead[0] == n:
                        fetched = ahead[1].result(timeout=background.STUCK_S)
                        ahead = None
                        if fetched is not None:
                            traces[n] = fetched
                            continue
                    elif ahead is None:
                        ahead = self._ahead(n, traces, batch, recipe, gpu, notes)
                    traces[n] = self._shallow(n, batch, recipe, gpu, notes)
        finally:
            if ahead is not None:  # a rule held without it
                ahead[1].close()
        self.rule = self.rule or rule
        _remember({_family(self.built, recipe): (rule.kind, rule.base)})
        if recipe.distributed.active:  # the first world's (another rank of uneven shards may step otherwise)
            _WORLD_RULES.setdefault(_worlds(self.built, recipe), rule)
            _bounded(_WORLD_RULES)
        return self._noted(trace, rule.kind, list(rule.depths))

    def _noted(self, trace: Trace, kind: str, depths: Sequence[int]) -> Trace:
        depth = self.built.depth
        assert depth is not None
        shallow = ", ".join(str(n) for n in depths)
        line = (f"the {depth.layers} blocks of {depth.container} simulated at depths {shallow} and the step deepened "
                f"to {depth.layers} ({kind} blocks: the events a full simulation records)")
        return dataclasses.replace(trace, assumptions=[*trace.assumptions, line])
