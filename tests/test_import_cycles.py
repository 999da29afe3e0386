"""``make lint``'s import check (``.ci/import_cycles.py``, issue 39): it finds cycles wherever the imports are,
keeps its list of known cycles true, guards the engine's shell, and passes on vcdask itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / ".ci" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


def test_a_cycle_through_a_lazy_or_type_checking_import_is_found(tmp_path):
    check = _checker()
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
            "b.py": "def f():\n    from . import c\n",
            "c.py": "from pkg.a import x\n",
            "d.py": "from . import a\n",  # into the cycle, not part of it
        },
    )
    [problem] = check.problems(package, known={})
    assert problem.startswith("import cycle among 3 modules: pkg.a -> pkg.b; pkg.b -> pkg.c; pkg.c -> pkg.a")


def test_a_known_cycle_passes_only_as_listed_and_one_gone_must_be_struck(tmp_path):
    check = _checker()
    files = {"__init__.py": "", "a.py": "from . import b\n", "b.py": "from . import a\n"}
    known = {frozenset({"pkg.a", "pkg.b"}): "issue 0"}
    assert check.problems(_package(tmp_path / "1", files), known=known) == []
    grown = {**files, "c.py": "from . import a\n", "a.py": "from . import b, c\n"}
    assert check.problems(_package(tmp_path / "2", grown), known=known)[0].startswith("import cycle among 3 modules")
    gone = {**files, "b.py": ""}
    [problem] = check.problems(_package(tmp_path / "3", gone), known=known)
    assert "the known cycle of issue 0 is gone or changed: strike it from KNOWN" in problem


def test_only_the_plugin_imports_the_runs_shell(tmp_path):
    check = _checker()
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/run.py": "",
            "engine/plugin.py": "from .run import Run\n",
            "engine/policy.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .run import Run\n",
        },
    )
    package = package.rename(tmp_path / "vcdask")
    assert check.problems(package, known={}) == [
        "vcdask.engine.policy imports the run's shell vcdask.engine.run: only the plugin may"
    ]


def test_the_runs_core_imports_no_shell_and_no_io_boundary(tmp_path):
    check = _checker()
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/run.py": "",
            "engine/lane.py": "",
            "engine/policy.py": "",
            "engine/core/__init__.py": "from .. import policy\n",
            "engine/core/arrivals.py": "def f():\n    from ..lane import MergeLane\n",
        },
    )
    package = package.rename(tmp_path / "vcdask")
    assert check.problems(package, known={}) == [
        "vcdask.engine.core.arrivals (the run's core) imports vcdask.engine.lane: "
        "the core does no I/O and knows no shell"
    ]


def test_vcdask_has_no_import_cycle_but_the_known_ones():
    assert _checker().problems(ROOT / "vcdask") == []
