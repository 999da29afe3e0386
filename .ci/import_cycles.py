"""No import cycles between vcdask's modules, and the engine's layers kept (issue 39); run by ``make lint``.

usage: python .ci/import_cycles.py [PACKAGE_DIR]   (default: vcdask)

Every import counts, wherever it is: at module level, inside a function (a lazy import), or under
``if TYPE_CHECKING:``.  A lazy import only moves a cycle from import time to run time, and a
type-checking one still ties the two modules together for whoever reads or changes them.  The graph is
built from the source with :mod:`ast` (nothing is imported), and its strongly connected components of
more than one module are the cycles.

Layers: inside ``vcdask.engine`` only the plugin imports the run's shell (``vcdask.engine.run``), and
the run's core (``vcdask.engine.core``) imports neither the shell nor the modules at its I/O boundary.

:data:`KNOWN` lists what is still to be untangled, each with its issue: a cycle listed there must be
exactly as listed (one that grows, or a new one, fails; one that is gone fails too, until it is struck
from the list, so the list stays true).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

#: Cycles still to go, each with its issue (none now: issue 39's core with no I/O removed the last, the
#: run's shell and the nine modules of functions of ``run: Run`` around it).
KNOWN: dict[frozenset[str], str] = {}
#: The run's shell: only the plugin imports it.
SHELL = "vcdask.engine.run"
SHELL_USERS = {"vcdask.engine.plugin"}
#: The run's core (no I/O) imports neither the shell nor what stands at the merge boundary or talks to
#: the tasks: it gets the server's head and Dask's task table as values, and returns effects.
CORE = "vcdask.engine.core"
NOT_FOR_CORE = {
    "vcdask.engine.run",
    "vcdask.engine.plugin",
    "vcdask.engine.lane",
    "vcdask.engine.params_server",
    "vcdask.engine.results",
    "vcdask.engine.handshake",
    "vcdask.engine.views",
    "vcdask.engine.end",
}


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> its file, for every ``.py`` file under ``package``."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (at ``path``) imports, anywhere in it."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:  # ``from pkg import module`` imports the module; else the names' module
                found.add(f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix)
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def problems(package: Path, known: dict[frozenset[str], str] | None = None) -> list[str]:
    """What is wrong with ``package``'s imports (empty: nothing)."""
    known = KNOWN if known is None else known
    mods = modules(package)
    graph = {name: imports(name, path, mods) for name, path in mods.items()}
    out = []
    found = cycles(graph)
    for component in found:
        if component in known:
            continue
        edges = sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in component)
        out.append(f"import cycle among {len(component)} modules: " + "; ".join(edges))
    for component, why in known.items():
        if component <= set(mods) and component not in found:
            out.append(f"the known cycle of {why} is gone or changed: strike it from KNOWN in {__file__}")
    if SHELL in mods:
        for name, deps in graph.items():
            if SHELL in deps and name not in SHELL_USERS:
                out.append(f"{name} imports the run's shell {SHELL}: only the plugin may")
    for name, deps in graph.items():
        if name == CORE or name.startswith(CORE + "."):
            for dep in sorted(deps & NOT_FOR_CORE):
                out.append(f"{name} (the run's core) imports {dep}: the core does no I/O and knows no shell")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    found = problems(Path(args[0] if args else "vcdask"))
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
