"""Sphinx configuration for the vcdask documentation.

Build: ``make docs`` (or ``sphinx-build -W --keep-going -b html docs docs/_build/html``).
"""

from __future__ import annotations

from pathlib import Path

import vcdask
from vcdask._docstrings import markdown_table
from vcdask.merge import DEFAULT_RULE, ONE_IN_FLIGHT

project = "vcdask"
author = "the vcdask developers"
copyright = "the vcdask developers"
version = release = vcdask.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# -- MyST (markdown pages) ------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# -- API reference ----------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = False
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
autodoc_member_order = "bysource"
numpydoc_show_class_members = False  # members come from the autosummary class template
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = True

# -- HTML -----------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = "vcdask"
html_static_path = ["_static"]
html_theme_options = {
    "github_url": "https://github.com/vcdask/vcdask",
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "icon_links": [
        {
            "name": "Binder",
            "url": "https://mybinder.org/v2/gh/vcdask/vcdask/main?labpath=notebooks%2Fquickstart.ipynb",
            "icon": "fa-solid fa-rocket",
        },
    ],
}
html_context = {"default_mode": "auto"}


# -- Generated from the code ----------------------------------------------------------------
# The options tables of the user guide come from the docstrings and signatures (vcdask._docstrings),
# so they cannot drift from the code; tests/test_documented_defaults.py checks the docstrings themselves.
def _write_generated() -> None:
    out = Path(__file__).parent / "generated"
    out.mkdir(exist_ok=True)
    table = markdown_table(vcdask.fit, skip=("model", "data"))
    table = table.replace("{data}`vcdask.merge.DEFAULT_RULE`", f"`{DEFAULT_RULE!r}`")
    table = table.replace("{data}`vcdask.merge.ONE_IN_FLIGHT`", f"`{ONE_IN_FLIGHT!r}`")
    path = out / "fit-options.md"
    if not path.exists() or path.read_text() != table:  # unchanged files keep Sphinx's cache valid
        path.write_text(table)


_write_generated()
