"""Full simulations of one model and recipe, as the planner's ``StepSource`` (``estimator.plan.steps``).

>>> sim = Simulator(built, recipe)                                         # doctest: +SKIP
>>> trace, runs = sim.simulate(8, get_gpu("A100-80GB"))

A trace depends on the card only through the attention backends its SDPA
calls get and the capability thresholds its kernels turned on (cuDNN
convolutions in bf16 from sm80), unless the step asked torch.cuda about the
card (then it is the card's own): that is the ``signature`` the planner
shares traces by. The cuBLAS workspace (8 MiB + 128 KiB, 32 MiB on Hopper) is
one allocation of category ``workspace`` whose size each report takes from
its card.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from estimator.gpus import GPU
from estimator.models import BuiltModel
from estimator.plan.steps import ModelFacts, Seed
from estimator.simulate import background
from estimator.simulate.depth import Deepener
from estimator.simulate.distributed import candidate_ranks_of
from estimator.simulate.recipe import Recipe
from estimator.simulate.sdpa_choice import backends_key
from estimator.trace import Trace

# (simulations done so far, what the last one was): called after each full simulation
Progress = Callable[[int, str], None]


class Simulator:
    """Full simulations of ``built`` trained with ``recipe``: a ``StepSource`` that can simulate."""

    can_simulate = True

    def __init__(self, built: BuiltModel, recipe: Recipe, progress: Progress | None = None, *,
                 keep: bool = False, label: str = "") -> None:
        self.built = built
        self.recipe = recipe
        self.progress = progress
        self.label = label  # what this job is, for progress lines (", with training.precision=bf16")
        self.model = ModelFacts(built.name, built.parameter_count, dict(built.input), tuple(built.assumptions),
                                built.max_seq_len)
        self.seeds: dict[tuple, Seed] = {}  # a simulator is seeded by nothing: it simulates
        self.runs = 0  # full simulations run
        self._pending: dict[tuple[int, GPU], background.Background] = {}  # prefetched, running
        self._guesses: set[tuple[int, GPU]] = set()  # speculative prefetches (``speculate``)
        self._probe: Trace | None = None  # the first trace: what the step asks of a card
        self._ranks: list[int] | None = None  # distributed: the ranks that may need the most (one once known)
        self.rank_note: str | None = None  # which rank stands for the world, and why (every trace's assumption)
        # ``keep``: every trace simulated, by (batch, signature), for ``step`` to hand out again
        self.kept: dict[tuple[int, tuple], Trace] | None = {} if keep else None
        self.deepener = Deepener(built)  # each simulation: three shallow ones where the blocks repeat

    def signature(self, gpu: GPU) -> tuple:
        probe = self._probe
        if probe is None or probe.card_queries:
            return ("card", gpu.name, gpu.capability, gpu.memory_bytes, gpu.cublas_workspace_bytes)
        return ("shared", backends_key(probe.sdpa_calls, gpu.capability, probe.capability_thresholds))

    def backend_key(self, gpu: GPU) -> str:
        """The attention backends the step's SDPA calls get on ``gpu``, as a profile key."""
        probe = self._probe
        return backends_key(probe.sdpa_calls, gpu.capability, probe.capability_thresholds) if probe is not None else ""

    def simulate(self, batch: int, gpu: GPU) -> tuple[Trace, int]:
        """A full simulation at ``batch`` on ``gpu`` (collected from ``prefetch`` when one ran it), and how many
        simulations it took."""
        runs, started = self.runs, time.perf_counter()
        trace = self._collect(batch, gpu) if self._pending else None
        if trace is None:
            trace = self._record(batch, gpu)
        else:
            self.runs += 1
        self._probe = self._probe or trace
        if self.kept is not None:
            self.kept[batch, self.signature(gpu)] = trace
        if self.progress is not None:
            self.progress(self.runs, f"batch {batch} on {gpu.name}{self.label} "
                                     f"({time.perf_counter() - started:.1f} s)")
        return trace, self.runs - runs

    def step(self, batch: int, gpu: GPU) -> Trace:
        """The step at ``batch`` on ``gpu``: one simulated already (with ``keep``), else a new simulation."""
        known = None if self.kept is None else self.kept.get((batch, self.signature(gpu)))
        return known if known is not None else self.simulate(batch, gpu)[0]

    def _record(self, batch: int, gpu: GPU) -> Trace:
        if len(self._resolve_ranks()) > 1:
            return self._pick_rank(batch, gpu)
        self.runs += 1
        return self.deepener.record(batch, self.recipe, gpu, notes=[self.rank_note] if self.rank_note else [])

    def _resolve_ranks(self) -> list[int]:
        """The ranks a distributed step may need the most on; with one, the recipe stands for it."""
        if self._ranks is None:
            d = self.recipe.distributed
            self._ranks = candidate_ranks_of(self.built.factory, d)
            if len(self._ranks) == 1 and d.strategy == "zero1" and d.world_size > 1:
                self.rank_note = (f"rank {self._ranks[0]} of {d.world_size} simulated: its ZeroRedundancyOptimizer "
                                  "partition holds the most parameters, so the most optimizer state")
            if len(self._ranks) == 1 and self._ranks[0] != d.rank:
                self.recipe = dataclasses.replace(self.recipe, distributed=d.at(d.world_size, self._ranks[0]))
        return self._ranks

    def _pick_rank(self, batch: int, gpu: GPU) -> Trace:
        """Simulate each candidate rank at ``batch`` once; the one whose step needs more stands for the
        world from then on (estimator/simulate/distributed: uneven shards)."""
        d = self.recipe.distributed
        traces = {r: self.deepener.record(batch, dataclasses.replace(self.recipe, distributed=d.at(d.world_size, r)),
                                          gpu) for r in self._ranks or ()}
        self.runs += len(traces)
        peaks = {r: t.live_peak()[0] for r, t in traces.items()}
        rank = max(peaks, key=lambda r: (peaks[r], -r))
        self.recipe = dataclasses.replace(self.recipe, distributed=d.at(d.world_size, rank))
        self._ranks = [rank]
        others = ", ".join(f"{peaks[r] / 2**20:.1f} MiB on rank {r}" for r in sorted(peaks) if r != rank)
        self.rank_note = (f"rank {rank} of {d.world_size} simulated: its step's live peak at batch {batch} is "
                          f"{peaks[rank] / 2**20:.1f} MiB ({others}); FSDP's shards differ between ranks")
        trace = traces[rank]
        return dataclasses.replace(trace, assumptions=[*trace.assumptions, self.rank_note])

    def prefetch(self, batch: int, gpu: GPU) -> None:
        """Start the full simulation at ``batch`` in a forked child now (estimator/simulate/background.py);
        ``simulate`` collects it, or runs it itself if the child fails. Not before the rank a distributed
        step stands for is known (with uneven shards, the first simulations pick it)."""
        if len(self._resolve_ranks()) > 1:
            return
        if background.enabled() and (batch, gpu) not in self._pending:
            note = [self.rank_note] if self.rank_note else []
            def run() -> tuple[Trace, tuple]:
                trace = self.deepener.record(batch, self.recipe, gpu, notes=note)
                return trace, self.deepener.found()  # what the child learnt of the blocks, for the parent

            job = background.Background(run)
            self._pending[batch, gpu] = job

    def prefetch_second(self, batch: int, gpu: GPU) -> None:
        """``prefetch`` the second batch every search needs beside the first, unless the first simulation
        searches the blocks' rule (estimator/simulate/depth.py): two searches side by side would simulate the
        same shallow depths twice, so the second batch's shallow depths join the first search's split instead
        (``Deepener.expect``)."""
        if not self.deepener.will_search(self.recipe):
            self.prefetch(batch, gpu)
        elif len(self._resolve_ranks()) == 1:  # the rank known (with two candidates, the first batch picks it)
            self.deepener.expect(batch, self.recipe, gpu, [self.rank_note] if self.rank_note else [])

    def speculate(self, batch: int, gpu: GPU, keep: int | None = None) -> None:
        """``prefetch`` a simulation a search may ask for next (it may not): the guesses running before this one
        are dropped (their children killed), but for one at ``keep``, the batch the caller asks for now; one never
        collected costs no simulation."""
        for old in [g for g in self._guesses if g[0] != keep and g != (batch, gpu)]:
            self._guesses.discard(old)
            if old in self._pending:
                self._pending.pop(old).close()
        self._guesses.add((batch, gpu))
        self.prefetch(batch, gpu)

    def _collect(self, batch: int, gpu: GPU) -> Trace | None:
        sig = self.signature(gpu)
        for (b, card), job in list(self._pending.items()):
            if b == batch and self.signature(card) == sig:
                del self._pending[b, card]
                # as long as the child works: it is further along than a simulation started here now
                result = job.result(timeout=background.STUCK_S)
                if result is None:
                    return None
                trace, found = result
                self.deepener.learn(found)
                return trace
        return None
