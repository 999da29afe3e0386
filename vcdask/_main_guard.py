"""The main-guard check: a script that starts the embedded cluster's spawned worker processes from its
unguarded top level is refused before any process starts (:func:`check_main_guard`)."""

from __future__ import annotations

import ast
import sys
import threading
import types

from .errors import MainGuardError

__all__ = ["MAIN_GUARD_DOCS", "check_main_guard", "may_start_here"]

#: Python's guide to the spawn start method's "Safe importing of main module".
MAIN_GUARD_DOCS = "https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods"


def check_main_guard(stacklevel: int = 2) -> None:
    """Refuse to start worker processes from the unguarded top level of a script.

    The embedded cluster's worker processes are started with the ``spawn`` method
    (``distributed.worker.multiprocessing-method``): each imports the ``__main__`` script again.  A
    script that calls :func:`vcdask.fit` at its top level, outside ``if __name__ == "__main__":``,
    would make every worker call ``fit`` again (a dozen tracebacks ending in "Nanny failed to
    start").  This looks, before any process starts, for the script's module-level frame in the
    call stack and whether the line it executes lies inside that guard (read from the script's source);
    called from another thread than the main one without such a frame, in the main thread's stack (a
    script that starts a thread calling ``fit`` at its top level is as unguarded).

    Raises
    ------
    MainGuardError
        The call comes from the top level of ``__main__`` outside the guard.
    """
    import dask.config

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not str(path).endswith(".py"):
        return  # an interactive session, a notebook, python -c: nothing is imported again
    if dask.config.get("distributed.worker.multiprocessing-method", "spawn") == "fork":
        return
    try:
        frame: types.FrameType | None = sys._getframe(stacklevel)
    except ValueError:  # a call stack shallower than stacklevel: start from here
        frame = sys._getframe(0)
    frame, via = _top_level(frame, main), ""
    if frame is None and threading.current_thread() is not threading.main_thread():
        # a thread the script started (threading.Thread, asyncio.to_thread, an executor): the script's own
        # top level is on the main thread's stack, where the thread was started from (or is being waited on)
        via = f" (in thread {threading.current_thread().name!r}, which it started)"
        frame = _top_level(sys._current_frames().get(threading.main_thread().ident or -1), main)
    if frame is None or _guarded(str(path), frame.f_lineno):
        return
    raise MainGuardError(
        f"vcdask started its embedded cluster from the top level of {path} (line {frame.f_lineno}){via}, outside "
        'an `if __name__ == "__main__":` guard.  The worker processes are spawned: each imports the script '
        "again and would start training (and another cluster) itself.  Move the call under "
        '`if __name__ == "__main__":` (Python\'s "Safe importing of main module": '
        f"{MAIN_GUARD_DOCS}), or pass client= a cluster started elsewhere."
    )


def _top_level(frame: types.FrameType | None, main: types.ModuleType) -> types.FrameType | None:
    """The frame of ``main``'s module-level code on the stack ``frame`` is the top of, or None."""
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    return frame


def may_start_here() -> bool:
    """Whether the embedded cluster may start from the caller's place (:func:`check_main_guard` passes):
    where it may not, ``fit`` stages no data early; starting the cluster raises the error."""
    try:
        check_main_guard(stacklevel=3)
    except MainGuardError:
        return False
    return True


def _guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script at ``path`` lies inside an ``if __name__ == "__main__":`` block
    (True when the source cannot be read: then nothing is claimed)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            body = node.body
            if body and body[0].lineno <= line <= (body[-1].end_lineno or body[-1].lineno):
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    """Whether an ``if`` test holds a comparison of ``__name__`` with ``"__main__"`` by ``==`` or ``in``
    (``__name__ == "__main__"``, ``... and other``, ``__name__ in {"__main__", ...}``): a guard,
    however it is spelled (``!=`` is not one)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Eq, ast.In)) for op in node.ops):
            parts = [n for side in (node.left, *node.comparators) for n in ast.walk(side)]
            named = any(isinstance(n, ast.Name) and n.id == "__name__" for n in parts)
            if named and any(isinstance(n, ast.Constant) and n.value == "__main__" for n in parts):
                return True
    return False
