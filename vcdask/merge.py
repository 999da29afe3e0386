"""Merge rules as pure functions over flat parameters.

VC-ASGD (the paper's equation 1)::

    W_s <- alpha * W_s + (1 - alpha) * W_c

applied in place with ``torch.lerp_`` (``W_s + (1 - alpha) * (W_c - W_s)``), one call
per dtype vector.  Floating-point vectors are mixed; integer and boolean state (e.g.
BatchNorm's ``num_batches_tracked``) cannot be averaged and takes the client's value.
"""

from __future__ import annotations


from .errors import ParameterMismatchError
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
    if server.layout != client.layout:
        raise ParameterMismatchError("client update does not match the server parameters: "
                                     + "; ".join(server.layout.diff(client.layout)))
    weight = 1.0 - alpha
    for dtype, ws in server.arrays.items():
        wc = client.arrays[dtype]
        if ws.is_floating_point():
            if weight == 1.0:  # exact replacement, as the formula says, without rounding
                ws.copy_(wc)
            elif weight != 0.0:
                ws.lerp_(wc, weight)
        else:
            ws.copy_(wc)
    return server
