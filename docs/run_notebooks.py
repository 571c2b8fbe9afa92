"""Execute the notebooks (`notebooks/*.ipynb`) top to bottom, and fail on any error.

    python docs/run_notebooks.py [--write] [NOTEBOOK ...]

(`nox -s notebooks` runs it: `nox -s notebooks -- --write`, `nox -s notebooks --
notebooks/quickstart.ipynb`.) Every notebook runs in a fresh kernel of the Python running this
script, in a temporary working directory (files a notebook writes are thrown away). A notebook
fails when

- a cell raises (a notebook that shows an error catches it in the cell);
- a cell's output shows a Python warning (`SomeWarning: ...` on stderr): a rendered notebook
  should not teach users to ignore warnings;
- without `--write`, the committed notebook has a code cell that was never run: the docs
  render the committed outputs (mkdocs-jupyter does not execute), so they must be there.

With `--write`, each notebook that ran cleanly is saved back with its new outputs. The time each
notebook took is printed.
"""

import argparse
import pathlib
import re
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
TIMEOUT = 900  # seconds per cell
WARNING = re.compile(r"\b\w*Warning: ")


def code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code"]


def not_run(nb: nbformat.NotebookNode) -> list[int]:
    """The (1-based) numbers of the code cells of `nb` that hold no record of a run."""
    return [i for i, c in enumerate(code_cells(nb), 1) if c.execution_count is None]


def warnings_shown(nb: nbformat.NotebookNode) -> list[str]:
    """`cell N: line` for each line of stderr output that shows a Python warning."""
    found = []
    for i, cell in enumerate(code_cells(nb), 1):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                lines = output.get("text", "").splitlines()
                found += [f"code cell {i}: {line}" for line in lines if WARNING.search(line)]
    return found


def execute(path: pathlib.Path) -> tuple[nbformat.NotebookNode, list[str], float]:
    """Run the notebook at `path` in a fresh kernel; returns it with its new outputs, the
    problems found and the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    problems = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{path.stem}-") as cwd:
        client = NotebookClient(
            nb,
            timeout=TIMEOUT,
            kernel_name="python3",
            record_timing=False,
            coalesce_streams=True,  # one stdout block per cell, not one per print
            extra_arguments=["--log-level=ERROR"],  # not the kernel's startup warnings
            resources={"metadata": {"path": cwd}},
        )
        try:
            client.execute()
        except CellExecutionError as error:
            problems.append(f"a cell raised:\n{error}")
    elapsed = time.perf_counter() - start
    problems += [f"shows a warning: {w}" for w in warnings_shown(nb)]
    return nb, problems, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: all of them")
    parser.add_argument("--write", action="store_true", help="save the outputs back")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or sorted(NOTEBOOKS.glob("*.ipynb"))
    if not paths:
        print(f"no notebooks found in {NOTEBOOKS}", file=sys.stderr)
        return 1

    failed = []
    for path in paths:
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"{name}: running ...", flush=True)
        committed = nbformat.read(path, as_version=4)
        nb, problems, elapsed = execute(path)
        if not args.write and (cells := not_run(committed)):
            problems.append(
                f"code cells {cells} have no outputs committed (the docs show the committed "
                "outputs): run `nox -s notebooks -- --write` and commit the notebook"
            )
        if args.write and not problems:
            nbformat.write(nb, path)
        status = "FAILED" if problems else ("ok, written" if args.write else "ok")
        print(f"{name}: {status} in {elapsed:.1f} s", flush=True)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr, flush=True)
        if problems:
            failed.append(str(name))
    if failed:
        print(f"{len(failed)} of {len(paths)} notebooks failed: {failed}", file=sys.stderr)
        return 1
    print(f"all {len(paths)} notebooks ran without errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
