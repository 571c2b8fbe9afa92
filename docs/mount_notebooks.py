"""An mkdocs hook (`hooks:` in mkdocs.yml): the notebooks of `notebooks/` become pages of the
site at `notebooks/NAME.ipynb`, read where they are (nothing copied into `docs/`).

It runs before mkdocs-jupyter's `on_files` (a higher priority), which then renders each one
from its committed outputs. mkdocs-jupyter 0.27 can mount a folder itself (`notebook_dirs`),
but needs Python 3.12; this hook does the same with any release from 0.26, so `nox -s docs`
builds the site on Python 3.11 too.
"""

import pathlib

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files


NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


@event_priority(100)
def on_files(files: Files, config) -> Files:
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(
            File(
                f"notebooks/{path.name}",
                str(NOTEBOOKS.parent),
                config["site_dir"],
                config["use_directory_urls"],
            )
        )
    return files
