"""`plan3d specs show <unknown>` suggests names that contain what was typed before difflib's nearest."""
from __future__ import annotations

import pytest

from plan3d.cli.specs_cmd import similar_names
from plan3d.specs.catalog import bundled_names
from cli_helpers import run_cli  # noqa: E402

EVERY = sorted({n for kind in ("cluster", "model", "gpu", "engine") for n in bundled_names(kind)})


def test_h100_suggests_the_h100_specs_not_the_h200(capsys):
    code, _, err = run_cli(capsys, "specs", "show", "h100")
    assert code == 2 and len(err.strip().splitlines()) == 1
    hint = err.split("did you mean", 1)[1].split("?")[0]
    assert "'h100-sxm' (gpu)" in hint and "'dgx-h100' (cluster)" in hint and "h200" not in hint


@pytest.mark.parametrize("name", EVERY)
def test_a_prefix_of_a_bundled_name_suggests_it_first_among_names_holding_the_prefix(name):
    query = name[:4]
    suggested = similar_names(query.upper(), EVERY)
    assert suggested and all(query in s for s in suggested)
    starts = sorted(n for n in EVERY if n.startswith(query))
    assert suggested[:len(starts)] == starts[:len(suggested)]


def test_without_a_substring_match_difflib_still_helps():
    assert similar_names("lamma3-8b", EVERY) == ["llama3-8b"]
    assert similar_names("zzzz", EVERY) == []
