"""The README quickstart, every python block of the pages in `docs/`, and every docstring
`!!! example` run exactly as written (the last two marked `examples`: `nox -s docs` runs them
with the site's build, `nox -s tests-all` and CI with everything)."""

import inspect
import pathlib
import re
import textwrap

import pytest

import equibuffer as eb
import equibuffer.testing as ebt


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
    names = [(n, getattr(eb, n)) for n in (eb.__all__ if hasattr(eb, "__all__") else dir(eb))]
    names += [(f"testing.{n}", getattr(ebt, n)) for n in ebt.__all__]
    for name, obj in names:
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


@pytest.mark.examples
@pytest.mark.parametrize(("code", "page"), _docs_blocks())
def test_docs_python_blocks_run(code, page):
    """Each block of a page runs on its own (a page's blocks must be self-contained)."""
    # (An unreal file name: Hypothesis reads the source of a test it runs, and would try to
    # parse the Markdown page as Python.)
    exec(compile(code, f"<docs/{page}>", "exec"), {})


@pytest.mark.examples
@pytest.mark.parametrize("code", _docstring_examples())
def test_docstring_examples_run(code):
    namespace = {}
    exec("import equibuffer as eb, jax, jax.numpy as jnp\nfrom equibuffer import *", namespace)
    exec(compile(code, "<docstring>", "exec"), namespace)


def test_there_are_docstring_examples():
    assert len(_docstring_examples()) >= 5
    testing = [p for p in _docstring_examples() if p.id.startswith("testing.")]
    assert len(testing) >= len(ebt.__all__)


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


def test_every_testing_name_is_in_the_api_reference():
    """The same for `equibuffer.testing`: each public name (its `__all__`) has a
    `::: equibuffer.testing.Name` entry in a page of `docs/api/`, and a docstring example."""
    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        pattern = r"^::: equibuffer\.testing\.(\w+)\s*$"
        documented |= set(re.findall(pattern, page.read_text(), flags=re.M))
    public = {
        n for n in dir(ebt) if not n.startswith("_") and not inspect.ismodule(getattr(ebt, n))
    }
    assert set(ebt.__all__) == public, "equibuffer.testing.__all__ is not its public names"
    missing = sorted(public - documented)
    assert not missing, f"equibuffer.testing names missing from docs/api/*.md: {missing}"
    unknown = sorted(documented - public)
    assert not unknown, f"docs/api/*.md documents names equibuffer.testing lacks: {unknown}"
    examples = {p.id.split(".")[1] for p in _docstring_examples() if p.id.startswith("testing.")}
    assert public <= examples, f"without a docstring example: {sorted(public - examples)}"


def test_every_page_is_in_the_nav():
    """Every Markdown page under `docs/` is reachable from the site's navigation."""
    config = (ROOT / "mkdocs.yml").read_text()
    section = re.search(r"^nav:\n((?:[ \t]+.*\n?)*)", config, flags=re.M)
    assert section, "mkdocs.yml has no nav"
    nav = set(re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", section.group(1), flags=re.M))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"


def test_every_notebook_is_in_the_nav():
    """Every notebook of `notebooks/` is a page of the site (docs/mount_notebooks.py mounts
    the folder at `notebooks/`), listed in the nav; every notebook in the nav exists."""
    config = (ROOT / "mkdocs.yml").read_text()
    section = re.search(r"^nav:\n((?:[ \t]+.*\n?)*)", config, flags=re.M)
    assert section, "mkdocs.yml has no nav"
    nav = set(re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.ipynb)\s*$", section.group(1), flags=re.M))
    notebooks = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert notebooks, "no notebooks found"
    assert notebooks - nav == set(), (
        f"notebooks missing from mkdocs.yml's nav (section Notebooks): {sorted(notebooks - nav)}"
    )
    assert nav - notebooks == set(), f"nav entries without a notebook: {sorted(nav - notebooks)}"


def _message_templates() -> list[str]:
    """Every string the package builds (literals and f-strings, with a formatted value, or a
    local variable holding one, written `{}`): the error messages among them."""
    import ast

    def template(node, env):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = template(node.left, env), template(node.right, env)
            if left is None and right is None:
                return None
            return (left if left is not None else "{}") + (right if right is not None else "{}")
        if isinstance(node, ast.Name):
            return env.get(node.id)
        return None

    found = []
    for path in sorted(pathlib.Path(eb.__file__).parent.rglob("*.py")):  # the package imported
        tree = ast.parse(path.read_text())
        scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)] + [tree]
        for scope in scopes:
            env: dict[str, str] = {}
            for node in ast.walk(scope):
                if (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                ):
                    value = template(node.value, env)
                    if value is not None:
                        env[node.targets[0].id] = value
                if isinstance(node, ast.Constant | ast.JoinedStr | ast.BinOp):
                    value = template(node, env)
                    if value is not None:
                        found.append(value)
    return found


def _quoted_messages():
    """The ```text blocks of docs/troubleshooting.md: one error message each, with
    `{placeholders}` where the library formats a value in."""
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    return re.findall(r"```text\n(.*?)```", page, flags=re.S)


def _fills(pieces: list[str], text: str) -> bool:
    """Whether `text` is the literal `pieces` in order with anything between them (as
    `re.fullmatch` of the pieces joined by `.*?`, without its backtracking: several
    placeholders in a row made that take minutes over every template): the first piece
    starts it, the last ends it, each middle one is found leftmost after the one before."""
    first, *middle, last = pieces if len(pieces) > 1 else (pieces[0], pieces[0])
    if len(pieces) == 1:
        return text == first
    if not (text.startswith(first) and text.endswith(last)):
        return False
    at, end = len(first), len(text) - len(last)
    if at > end:
        return False
    for piece in middle:
        found = text.find(piece, at, end)
        if found < 0:
            return False
        at = found + len(piece)
    return True


def test_troubleshooting_quotes_the_library_messages():
    """Every message quoted in docs/troubleshooting.md is one the library builds, word for
    word (whitespace aside; a `{placeholder}` stands for any formatted value): a reworded
    message fails here until the page follows it."""
    templates = [" ".join(t.split()) for t in _message_templates()]
    quotes = _quoted_messages()
    assert len(quotes) >= 20
    stale = []
    for quote in quotes:
        pieces = re.split(r"\{[^{}]*\}", " ".join(quote.split()))
        if not any(_fills(pieces, t) for t in templates):
            stale.append(quote.strip())
    assert not stale, "quoted in docs/troubleshooting.md but not built by the library:\n" + (
        "\n".join(stale)
    )


def test_benchmark_tables_render(tmp_path):
    """docs/gen_bench.py (the site's hook) turns results JSON into Markdown tables, and says
    how to produce results when there are none."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gen_bench", ROOT / "docs" / "gen_bench.py")
    assert spec is not None and spec.loader is not None
    gen_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_bench)
    assert "--json benchmarks/results/" in gen_bench.render(tmp_path)
    rows = [{"op": "add", "fbx/ours": "2.00", "_raw": [1.0]}, {"op": "a|b", "fbx/ours": "0.90"}]
    machine = {"cpu": "AMD EPYC", "cores": 2}
    (tmp_path / "core.json").write_text(
        json.dumps({"jax": "0.12", "ops": rows, "machine": machine})
    )
    out = gen_bench.render(tmp_path)
    assert "- jax: `0.12`" in out and "#### ops" in out
    assert "Machine:\n\n- cpu: `AMD EPYC`\n- cores: `2`" in out
    assert "| op | fbx/ours |\n| --- | --- |\n| add | 2.00 |\n| a\\|b | 0.90 |" in out
    # Each ratio column is drawn too: one inline SVG per column, bars labelled by the row.
    assert out.count("<figure>\n<svg") == 1 and "<?xml" not in out
    assert "fbx/ours" in gen_bench._ratio_columns(rows) and gen_bench._label(rows[1]) == "a|b"
    page = "# Benchmarks\n\n" + gen_bench.MARKER + "\n"
    assert gen_bench.on_page_markdown(page, None, None, None) == page.replace(
        gen_bench.MARKER, gen_bench.render()
    )


def test_gpu_figures_render(tmp_path):
    """The benchmarks page shows `gpu.json` apart, headed by the card's name, or says that no
    GPU figures are recorded yet; the other results never include it."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gen_bench", ROOT / "docs" / "gen_bench.py")
    assert spec is not None and spec.loader is not None
    gen_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_bench)
    assert "No GPU figures recorded yet" in gen_bench.render_gpu(tmp_path)
    rows = [{"op": "sample", "fbx/ours": "1.10", "fbx/ours off": "1.20"}]
    figures = {"device": "NVIDIA H200", "jax": "0.11.2", "date": "2026-11-28", "ops": rows}
    (tmp_path / "gpu.json").write_text(json.dumps(figures))
    out = gen_bench.render_gpu(tmp_path)
    assert out.startswith("Measured on **NVIDIA H200** (jax 0.11.2, 2026-11-28).")
    assert "#### ops" in out and out.count("<figure>\n<svg") == 2
    assert "gpu.json" not in gen_bench.render(tmp_path)
    page = "# Benchmarks\n\n" + gen_bench.MARKER + "\n\n" + gen_bench.GPU_MARKER + "\n"
    filled = gen_bench.on_page_markdown(page, None, None, None)
    assert gen_bench.MARKER not in filled and gen_bench.GPU_MARKER not in filled
