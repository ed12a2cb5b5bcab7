"""The README's first example is one a newcomer can act on: it fits on every card it names and recommends a
batch there, and its table prints what the library answers."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from estimator.cli.main import main

pytestmark = pytest.mark.zoo
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _first_example() -> list[str]:
    line = next(m.group(1) for m in re.finditer(r"^batchfit (estimate --preset [^\n#]+)$", README, re.M))
    return shlex.split(line)


def test_the_first_example_fits_every_card_it_names(capsys) -> None:
    argv = _first_example()
    assert main([*argv, "--json", "--quiet"]) == 0
    import json

    response = json.loads(capsys.readouterr().out)
    assert response["results"] and all(r["recommended_batch_size"] is not None for r in response["results"])
    # the table the README shows is this answer's
    table = README[README.index("```\ngpu ") + 4:]
    rows = [line.split() for line in table[:table.index("```")].splitlines()[1:]]
    assert [(row[0], int(row[2]), int(row[3])) for row in rows] == [
        (r["gpu"], r["max_batch_size"], r["recommended_batch_size"]) for r in response["results"]]
