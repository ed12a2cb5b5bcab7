"""Per-architecture rules as a table: one entry per rule, a name registered twice refused, at most one match.

>>> rules = Rules("text inputs")
>>> @rules.register("git", named("GitForCausalLM"))
... def _git(*args): ...
>>> rules.find(type("GitForCausalLM", (), {}), None).name
'git'

As ``torch.utils.flop_counter``'s ``register_flop_formula`` keys its formulas by op, a builder keys what an
architecture's step is fed (its inputs beyond the common ones, its loss) by a rule: a name, a test on the
model class and config, and the function that applies it. A class two rules match is a defect of the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Matcher = Callable[[type, Any], bool]


@dataclass(frozen=True)
class Rule:
    name: str
    matches: Matcher
    apply: Callable[..., Any]


class Rules:
    """A table of rules for one kind of thing (``what``), e.g. a transformers model's text inputs."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._rules: dict[str, Rule] = {}

    def register(self, name: str, matches: Matcher) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def add(apply: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._rules:
                raise ValueError(f"{self.what}: rule {name!r} is already registered")
            self._rules[name] = Rule(name, matches, apply)
            return apply
        return add

    def find(self, model_class: type, config: Any) -> Rule | None:
        """The one rule that matches the class and config, or None."""
        found = [r for r in self._rules.values() if r.matches(model_class, config)]
        if len(found) > 1:
            raise RuntimeError(f"{self.what}: {model_class.__name__} matches the rules "
                               f"{', '.join(r.name for r in found)}; one at most may")
        return found[0] if found else None

    def __iter__(self):  # noqa: ANN204  the rules, in registration order
        return iter(self._rules.values())


def named(*classes: str) -> Matcher:
    """A matcher on the model class's name."""
    wanted = frozenset(classes)
    return lambda model_class, config: model_class.__name__ in wanted
