"""The request's ``model.moe_routing``, as the model's builder hands it to the simulation.

The transformers builder's factory sets it each time it builds the model (each simulation builds its model
first, in the thread that simulates it); ``estimator/simulate/virtual_gpu/moe.py`` reads it when the eager
experts loop asks which tokens each expert receives. It lives here, below the simulation, so that the
builder sets it without importing the simulation (docs/DESIGN.md, "Who imports whom").
"""

from __future__ import annotations

from contextvars import ContextVar

ROUTING: ContextVar[str] = ContextVar("batchfit_moe_routing", default="balanced")
