"""Render benchmark results (`benchmarks/results/*.json`) as Markdown tables.

Two uses:

- an mkdocs hook (`hooks:` in mkdocs.yml): replaces the marker `<!-- benchmark-tables -->` in
  `benchmarks.md` with the tables, so the site shows whatever results are present;
- a script: `python docs/gen_bench.py [results directory]` prints the same Markdown.

A results file is a JSON object, as `python -m benchmarks.bench_core --json PATH` writes it:
its scalar entries (machine, jax version, capacity, ...) are listed, and each entry that is a
list of objects (one per row) becomes a table whose columns are the objects' keys, in order of
first appearance; keys starting with `_` (raw figures) are left out.
"""

import json
import pathlib
import sys
from typing import Any


ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- benchmark-tables -->"
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


def render(results: pathlib.Path = RESULTS) -> str:
    """The Markdown for every `*.json` file in `results`, or how to produce them."""
    files = sorted(results.glob("*.json")) if results.is_dir() else []
    if not files:
        return NONE_YET
    parts = []
    for path in files:
        data = json.loads(path.read_text())
        parts.append(f"### `{path.name}`\n")
        scalars = {k: v for k, v in data.items() if not isinstance(v, dict | list)}
        if scalars:
            parts.append("\n".join(f"- {k}: `{_cell(v)}`" for k, v in scalars.items()) + "\n")
        for key, value in data.items():
            if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
                parts.append(f"#### {key}\n\n{table(value)}\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs hook: fill the marker of the benchmarks page."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())


if __name__ == "__main__":
    print(render(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
