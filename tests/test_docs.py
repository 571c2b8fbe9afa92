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
    """The fenced ```python blocks of a Markdown page, in order (dedented: a block may sit in
    a list item)."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    return [textwrap.dedent(b) for b in blocks]


def _readme_blocks():
    return _python_blocks(ROOT / "README.md")


def _docs_blocks():
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        name = page.relative_to(ROOT / "docs").as_posix()
        blocks = _python_blocks(page)
        found += [pytest.param(b, name, id=f"{name}-{i}") for i, b in enumerate(blocks)]
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


def _public_names() -> list[str]:
    """Every public name of `equibuffer`'s namespace (what `from equibuffer import *` gives)."""
    names = eb.__all__ if hasattr(eb, "__all__") else dir(eb)
    return sorted(
        n for n in names if not n.startswith("_") and not inspect.ismodule(getattr(eb, n))
    )


def test_every_public_name_is_in_the_api_reference():
    """Each public name has a `::: equibuffer.Name` entry in a page of `docs/api/` (rendered
    from its docstring by mkdocstrings), so a new public name without docs fails here."""
    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: equibuffer\.(\w+)\s*$", page.read_text(), flags=re.M))
    assert _public_names(), "no public names found"
    missing = [n for n in _public_names() if n not in documented]
    assert not missing, f"public names missing from docs/api/*.md: {missing}"
    unknown = sorted(documented - set(_public_names()))
    assert not unknown, f"docs/api/*.md documents names equibuffer does not export: {unknown}"


def test_every_page_is_in_the_nav():
    """Every Markdown page under `docs/` is reachable from the site's navigation."""
    nav = set(
        re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    )
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"
