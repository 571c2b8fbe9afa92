"""The README quickstart, every python block of the pages in `docs/`, and every docstring
`!!! example` run exactly as written."""

import inspect
import pathlib
import re
import textwrap

import pytest

import equibuffer as eb


ROOT = pathlib.Path(__file__).parent.parent


def _python_blocks(page: pathlib.Path) -> list[str]:
    """The fenced ```python blocks of a Markdown page, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def _readme_blocks():
    return _python_blocks(ROOT / "README.md")


def _docs_blocks():
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        blocks = _python_blocks(page)
        found += [pytest.param(b, page.name, id=f"{page.name}-{i}") for i, b in enumerate(blocks)]
    return found


def _docstring_examples():
    found = []
    for name in eb.__all__ if hasattr(eb, "__all__") else dir(eb):
        obj = getattr(eb, name)
        if not getattr(obj, "__module__", "").startswith("equibuffer"):
            continue
        if inspect.isclass(obj):
            members = [obj, *(m for _, m in inspect.getmembers(obj) if callable(m))]
        elif inspect.isfunction(obj):
            members = [obj]
        else:
            continue
        for member in members:
            doc = inspect.getdoc(member) or ""
            for block in re.findall(r"!!! example\n\n(.*?)```\n", doc + "\n", flags=re.S):
                code = textwrap.dedent(block).strip()
                code = re.sub(r"^```python\n", "", code)
                found.append(pytest.param(code, id=f"{name}.{getattr(member, '__name__', '')}"))
    return found


@pytest.mark.parametrize("code", _readme_blocks())
def test_readme_python_blocks_run(code, capsys):
    exec(compile(code, "README.md", "exec"), {})
    if "print(float(loss))" in code:
        assert capsys.readouterr().out.strip() == "1.0"


@pytest.mark.parametrize(("code", "page"), _docs_blocks())
def test_docs_python_blocks_run(code, page):
    """Each block of a page runs on its own (a page's blocks must be self-contained)."""
    exec(compile(code, f"docs/{page}", "exec"), {})


@pytest.mark.parametrize("code", _docstring_examples())
def test_docstring_examples_run(code):
    namespace = {}
    exec("import equibuffer as eb, jax, jax.numpy as jnp\nfrom equibuffer import *", namespace)
    exec(compile(code, "<docstring>", "exec"), namespace)


def test_there_are_docstring_examples():
    assert len(_docstring_examples()) >= 5
