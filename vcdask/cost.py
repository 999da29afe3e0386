"""What a run cost: worker time at the price of its instance type and market (spot or on-demand).

Prices come from the Dask config ``vcdask.cloud.prices`` (no network look-ups): per instance type, the
price per hour ``on-demand`` and ``spot``::

    vcdask:
      cloud:
        prices:
          c6i.2xlarge: {on-demand: 0.34, spot: 0.12}

Each worker says what it runs on through its own config, ``vcdask.cloud.instance``
(``{type: c6i.2xlarge, market: spot}``; :func:`vcdask.cloud.spot_cluster` sets it), and reports it with
its results.  A run counts, per worker, the seconds it was connected (``alive``), busy with shard tasks
(``busy``), and busy with work lost to a preemption or to its death (``wasted``).  The cost is the
alive time at the worker's price; the same seconds at on-demand prices give the saving.  The scheduler
is not counted (it runs on-demand, one machine, whatever the run does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ._ints import is_real

__all__ = ["MARKETS", "check_prices", "instance_here", "summarize"]

#: Where a worker's instance was bought.
MARKETS = ("spot", "on-demand")


def check_prices(prices: Any) -> dict[str, dict[str, float]]:
    """The price table, checked: instance type -> {"on-demand": $/h, "spot": $/h}.

    Raises
    ------
    ValueError
        Not a mapping of that shape, or a price that is not a number >= 0.
    """
    if prices is None:
        return {}
    if not isinstance(prices, Mapping):
        raise ValueError(f"prices must map instance types to {{'on-demand': $/h, 'spot': $/h}}, got {prices!r}")
    table: dict[str, dict[str, float]] = {}
    for kind, entry in prices.items():
        if not isinstance(entry, Mapping) or not set(entry) <= set(MARKETS) or "on-demand" not in entry:
            raise ValueError(
                f"prices[{kind!r}] must give 'on-demand' (and 'spot') prices per hour, got {entry!r}; "
                f"valid markets: {list(MARKETS)}"
            )
        for market, price in entry.items():
            if not is_real(price) or not 0 <= price < math.inf:
                raise ValueError(f"prices[{kind!r}][{market!r}] must be a number >= 0 ($ per hour), got {price!r}")
        table[str(kind)] = {m: float(p) for m, p in entry.items()}
    return table


def instance_here() -> dict[str, str | None]:
    """This process's instance, from its Dask config ``vcdask.cloud.instance`` (type None: unknown)."""
    from . import config

    kind = config.get("cloud.instance.type")
    market = config.get("cloud.instance.market") or "on-demand"
    return {"instance": None if kind is None else str(kind), "market": str(market)}


def summarize(rows: list[dict[str, Any]], prices: Mapping[str, Mapping[str, float]], merges: int) -> dict[str, Any]:
    """The run's cost from its worker rows (``alive_seconds``, ``instance``, ``market``).

    Returns ``total`` and ``on_demand`` ($; the same worker time at on-demand prices), ``saving`` (the
    share of ``on_demand`` saved), ``per_merge`` (NaN when no worker is priced), ``wasted_seconds`` and
    ``unpriced`` (workers whose instance type has no price, or was never reported, left out of the totals).
    Each row gets its ``cost``.

    ``merges`` are those the rows' worker time made: a resumed run's since it was resumed (its workers'
    clocks start afresh then), not every merge on its branch.
    """
    total = on_demand = wasted = 0.0
    unpriced: list[str] = []
    for row in rows:
        entry = prices.get(row.get("instance") or "")
        hours = row.get("alive_seconds", 0.0) / 3600.0
        wasted += row.get("wasted_seconds", 0.0)
        if entry is None:
            row["cost"] = math.nan
            unpriced.append(row["worker"])
            continue
        market = row.get("market") or "on-demand"
        price = entry.get(market, entry["on-demand"])
        row["cost"] = hours * price
        total += row["cost"]
        on_demand += hours * entry["on-demand"]
    return {
        "total": total,
        "on_demand": on_demand,
        "saving": 1.0 - total / on_demand if on_demand > 0 else math.nan,
        # (nothing priced: not known, rather than $0 a merge)
        "per_merge": total / merges if merges and len(unpriced) < len(rows) else math.nan,
        "wasted_seconds": wasted,
        "unpriced": unpriced,
    }
