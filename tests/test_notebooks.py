"""Every notebook in `notebooks/` runs top to bottom (code cells executed in order)."""

import json
import pathlib

import pytest


NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# What each notebook prints that shows it did its job.
PRINTS = {
    "quickstart.ipynb": ["leaf ['obs'] has shape (2, 4)", "cannot be sampled yet"],
    "property_testing.ipynb": [
        "FAILED. Hypothesis' minimal failing example:",
        "n_step_return_fixed agrees with the reference",
        "train_step holds on every configuration tried",
    ],
}


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {}
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}[{i}]", "exec"), namespace)
    out = capsys.readouterr().out
    for text in PRINTS.get(path.name, []):
        assert text in out
