"""The warnings of one answer, as typed entries: a later step finds an entry by its code and card, never by
its text.

>>> notes = Notes()
>>> notes.add(WarningCode.DOES_NOT_FIT, "resnet50 does not fit on T4-16GB even at batch 1", card="T4-16GB")
>>> notes.find(WarningCode.DOES_NOT_FIT, card="T4-16GB").batch is None
True
>>> [n.code for n in notes.warnings()]
[<WarningCode.DOES_NOT_FIT: 'does-not-fit'>]
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from estimator.plan.results import Note, WarningCode


@dataclass(frozen=True)
class Entry:
    """One warning: its code, the card and batch it is about (None: the whole answer), its message."""

    code: WarningCode
    message: str
    card: str | None = None
    batch: int | None = None


class Notes:
    """The collector every step of an answer adds its warnings to, in order."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def add(self, code: WarningCode, message: str, *, card: str | None = None, batch: int | None = None) -> None:
        self.entries.append(Entry(code, message, card, batch))

    def merge(self, other: Notes) -> None:
        """``other``'s entries that are not here yet (the parts of one answer, e.g. per world size)."""
        self.entries.extend(e for e in other.entries if e not in self.entries)

    def find(self, code: WarningCode, *, card: str | None = None) -> Entry | None:
        """The first entry of ``code`` about ``card``."""
        return next((e for e in self.entries if e.code == code and e.card == card), None)

    def drop(self, code: WarningCode, *, card: str | None = None) -> None:
        """Remove every entry of ``code`` about ``card``."""
        self.entries = [e for e in self.entries if not (e.code == code and e.card == card)]

    def reword(self, entry: Entry, message: str) -> None:
        """Replace ``entry``'s message, in its place."""
        self.entries[self.entries.index(entry)] = replace(entry, message=message)

    def warnings(self) -> list[Note]:
        """The answer's warnings (docs/API.md: code and message)."""
        return [Note(e.code, e.message) for e in self.entries]
