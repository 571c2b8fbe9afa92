"""Render benchmark results (`benchmarks/results/*.json`) as Markdown tables.

Two uses:

- an mkdocs hook (`hooks:` in mkdocs.yml): replaces the marker `<!-- benchmark-tables -->` in
  `benchmarks.md` with the tables, so the site shows whatever results are present, and the
  marker `<!-- benchmark-gpu -->` with the GPU's (`gpu.json`, which only a run of
  `benchmarks/gpu.sh` on a lent GPU writes), headed by the card's name, or a line saying that
  none are recorded yet;
- a script: `python docs/gen_bench.py [results directory]` prints the same Markdown.

A results file is a JSON object, as `python -m benchmarks.bench_core --json PATH` writes it:
its scalar entries (capacity, ...) are listed, its `machine` object (what
`benchmarks/_machine.py` describes) becomes a list headed "Machine", and each entry that is a
list of objects (one per row) becomes a table whose columns are the objects' keys, in order of
first appearance; keys starting with `_` (raw figures) are left out. Each ratio column of a
table (a name holding `/`, such as `fbx/ours cpu`) is also drawn as a bar chart, an inline SVG
made with matplotlib, with the line at 1 marked.
"""

import io
import json
import pathlib
import sys
from typing import Any


ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- benchmark-tables -->"
GPU_MARKER = "<!-- benchmark-gpu -->"
GPU_FILE = "gpu.json"
NO_GPU = """\
No GPU figures recorded yet. A session lent a GPU runs `bash benchmarks/gpu.sh` in one device
call (see "On a GPU" in `benchmarks/README.md` in the repository) and commits the `gpu.json`
it writes to `benchmarks/results/`.
"""
NONE_YET = """\
No results are checked in yet. To produce them, run a benchmark with `--json` into
`benchmarks/results/` and rebuild the site (`nox -s docs`):

```bash
python -m benchmarks.bench_core --quick --json benchmarks/results/core.json
```
"""


def _cell(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, dict | list) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of `rows` (dicts), columns in order of first appearance."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if not k.startswith("_") and k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _label(row: dict[str, Any]) -> str:
    """A bar's label: the row's cells that are not figures (`buffer`, `R`, `op`, ...)."""
    keys = [k for k in row if not k.startswith("_") and "/" not in k]
    names = [k for k in keys if not _is_figure(row[k])] or keys[:1]
    return ", ".join(f"{k}={row[k]}" if k in ("R", "T") else str(row[k]) for k in names)


def _is_figure(value: Any) -> bool:
    text = str(value)
    return any(text.endswith(unit) for unit in (" us", " ms", " s", " ns")) or " / " in text


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def plot(rows: list[dict[str, Any]], column: str) -> str:
    """An inline SVG bar chart of the ratio `column` over `rows`, one bar per row, with a line
    at 1 (above it: the first-named side takes longer, e.g. Flashbax in `fbx/ours`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [(_label(r), _float(r.get(column))) for r in rows]
    pairs = [(label, v) for label, v in pairs if v is not None]
    fig, ax = plt.subplots(figsize=(7.5, 0.28 * len(pairs) + 0.9))
    labels = [label for label, _ in pairs][::-1]
    values = [v for _, v in pairs][::-1]
    colours = ["tab:green" if v >= 1 else "tab:orange" for v in values]
    ax.barh(range(len(values)), values, color=colours)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.set_xlabel(column, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=6)
    fig.tight_layout()
    out = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": column}):  # the same file for the same data
        fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    svg = out.getvalue()
    return svg[svg.index("<svg") :]  # no XML prologue inside the page


def _ratio_columns(rows: list[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if "/" in k and not k.startswith("_") and k not in columns]
    return [c for c in columns if any(_float(r.get(c)) is not None for r in rows)]


def _file(path: pathlib.Path) -> list[str]:
    """The Markdown of one results file: its name, scalars, machine, tables and charts."""
    data = json.loads(path.read_text())
    parts = [f"### `{path.name}`\n"]
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict | list)}
    if scalars:
        parts.append("\n".join(f"- {k}: `{_cell(v)}`" for k, v in scalars.items()) + "\n")
    machine = data.get("machine")
    if isinstance(machine, dict):
        lines = [f"- {k}: `{_cell(v)}`" for k, v in machine.items()]
        parts.append("Machine:\n\n" + "\n".join(lines) + "\n")
    for key, value in data.items():
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            parts.append(f"#### {key}\n\n{table(value)}\n")
            for column in _ratio_columns(value):
                parts.append(f"<figure>\n{plot(value, column)}\n</figure>\n")
    return parts


def render(results: pathlib.Path = RESULTS) -> str:
    """The Markdown for every `*.json` file in `results` but the GPU's, or how to produce
    them."""
    files = sorted(results.glob("*.json")) if results.is_dir() else []
    files = [f for f in files if f.name != GPU_FILE]
    if not files:
        return NONE_YET
    return "\n".join(part for path in files for part in _file(path))


def render_gpu(results: pathlib.Path = RESULTS) -> str:
    """The Markdown of `results/gpu.json`, headed by the card it ran on, or `NO_GPU`."""
    path = results / GPU_FILE
    if not path.is_file():
        return NO_GPU
    data = json.loads(path.read_text())
    card = data.get("device") or data.get("device_kind") or "an unnamed GPU"
    head = f"Measured on **{card}** (jax {data.get('jax', '?')}, {data.get('date', '?')}).\n"
    return "\n".join([head, *_file(path)])


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs hook: fill the markers of the benchmarks page."""
    for marker, fill in ((MARKER, render), (GPU_MARKER, render_gpu)):
        if marker in markdown:
            markdown = markdown.replace(marker, fill())
    return markdown


if __name__ == "__main__":
    folder = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS
    print(render_gpu(folder) + "\n" + render(folder))
