"""A portable profile as the planner's ``StepSource``: the steps it was traced with, no model code, no torch.

>>> source = ProfileReplayer(PortableProfile.from_json(doc))               # doctest: +SKIP
>>> answer(source, [get_gpu("T4-16GB")], PlanOptions(confirm=ConfirmMode.NONE)).results[0].max_batch_size

Each card's signature is the attention backends the profile's SDPA calls
get on it (``estimator.simulate.sdpa_choice``, by dtype name); the profile
holds one step per signature it was traced for, and simulates nothing.
"""

from __future__ import annotations

from estimator.errors import SpecError
from estimator.gpus import GPU
from estimator.plan.affine import AffineTrace
from estimator.plan.steps import ModelFacts, Seed
from estimator.portable.profile import PortableProfile
from estimator.simulate.sdpa_choice import SdpaCall, backends_key
from estimator.trace import Trace


class ProfileReplayer:
    """Answers from a portable profile: allocator replays of its affine traces, no model code."""

    can_simulate = False

    def __init__(self, profile: PortableProfile) -> None:
        self.doc = profile
        self.calls = [SdpaCall(c["dtype"], c["dim"], tuple(c["head_dims"]), c["has_mask"], c["requires_grad"])
                      for c in profile.sdpa_calls]
        self.model = ModelFacts(profile.model, profile.parameter_count, dict(profile.request.get("input", {})),
                                tuple(profile.assumptions), min_batch=profile.start)
        self.seeds = {key: Seed(profile.start, profile.first_steps[key], step, profile.flops[key])
                      for key, step in profile.steps.items()}

    def signature(self, gpu: GPU) -> str:
        key = backends_key(self.calls, gpu.capability, self.doc.capability_thresholds)
        if key not in self.doc.steps:
            raise SpecError("gpus", gpu.name, f"a card whose attention backends ({key or 'none'}) the profile "
                            f"was traced for ({', '.join(self.doc.steps) or 'none'}); re-run batchfit profile")
        return key

    def step(self, batch: int, gpu: GPU) -> AffineTrace:
        """The step at ``batch`` on ``gpu``, synthesized: the profile's own at its smallest batch, else its affine
        trace."""
        seed = self.seeds[self.signature(gpu)]
        if batch < seed.start:
            raise SpecError("batch_size", batch, f"at least {seed.start}, the smallest batch the profile answers")
        return seed.first if batch == seed.start else seed.affine

    def speculate(self, batch: int, gpu: GPU, keep: int | None = None) -> None:
        """A profile simulates nothing, beside the caller or otherwise."""

    def simulate(self, batch: int, gpu: GPU) -> tuple[Trace, int]:
        """A profile has no model to simulate: every step it answers is seeded."""
        raise SpecError("batch_size", batch, f"a batch the profile answers (from {self.doc.start}): a profile "
                        "synthesizes its steps and simulates none")
