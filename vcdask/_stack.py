"""Where vcdask's warnings point: the user's line, however deep in vcdask they are raised (:func:`user_level`).

A fixed ``stacklevel`` counts vcdask's own frames between the warning and the user's call (``fit`` -> ``plan``
-> a check), and points into vcdask as soon as a frame is added on the way (a decorator of ``fit``, a helper).
Python 3.12's ``warnings.warn(skip_file_prefixes=...)`` does this; vcdask supports 3.11.
"""

from __future__ import annotations

import os
import sys
import types

__all__ = ["user_level"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_level() -> int:
    """The ``stacklevel`` of the first frame outside vcdask, for a warning raised by this function's caller
    (``warnings.warn(..., stacklevel=user_level())``): 1 is the caller itself, as ``warnings.warn`` counts."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
