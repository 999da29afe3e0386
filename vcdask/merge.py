"""Merge rules as pure functions over flat parameters.

VC-ASGD (the paper's equation 1)::

    W_s <- alpha * W_s + (1 - alpha) * W_c

applied in place with ``torch.lerp_`` (``W_s + (1 - alpha) * (W_c - W_s)``), one call
per dtype vector.  Floating-point vectors are mixed; integer and boolean state (e.g.
BatchNorm's ``num_batches_tracked``) cannot be averaged and takes the client's value.
"""

from __future__ import annotations

from .params import FlatParams

__all__ = ["vc_asgd"]


def vc_asgd(server: FlatParams, client: FlatParams, alpha: float) -> FlatParams:
    """Apply ``server <- alpha * server + (1 - alpha) * client`` in place and return ``server``.

    Parameters
    ----------
    server : FlatParams
        The server parameters ``W_s``; modified in place.
    client : FlatParams
        The client's parameters ``W_c`` after training; not modified.
    alpha : float
        Weight of the server copy, in [0, 1].  ``alpha = 0`` replaces the server copy
        with the client's; ``alpha = 1`` ignores the client.

    Raises
    ------
    ParameterMismatchError
        The two layouts differ (names, shapes or dtypes).
    """
    from .rules import _check, lerp

    _check(server, client)
    lerp(server, client, 1.0 - alpha)
    return server
