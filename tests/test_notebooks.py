"""The committed notebooks show what they do: every code cell was run, in order, and no output
is an error or a Python warning. (Running them is `nox -s notebooks`, which CI runs; `nox -s
notebooks -- --write` stores the outputs.)"""

import json
import pathlib

import pytest


NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# What each notebook prints that shows it did its job.


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_executed(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells
    counts = [c["execution_count"] for c in cells]
    assert None not in counts, f"{path.name}: a code cell was never run"
    assert counts == sorted(counts), f"{path.name}: cells were run out of order"
    for cell in cells:
        for out in cell["outputs"]:
            assert out["output_type"] != "error", f"{path.name}: a cell raised"
            text = "".join(out.get("text", ""))
            assert "Warning:" not in text, f"{path.name}: an output shows a warning: {text}"
