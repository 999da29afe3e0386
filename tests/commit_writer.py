"""A separate writer process for the concurrency and crash tests.

usage: python commit_writer.py LOCATION WRITER N SIZE [OPTIONS_JSON]

Commits N versions whose float vector is filled with WRITER * 1000 + i and whose
metadata says {"writer": WRITER, "i": i}; prints one JSON line per commit:
{"i": i, "version": id} or {"i": i, "conflict": message}.  N = 0 means forever.
"""

import json
import sys

import torch

from vcdask import open_store
from vcdask.errors import StoreConflict


def state(value: float, size: int) -> dict:
    return {"w": torch.full((size,), float(value)), "tag": torch.tensor([int(value)])}


def main() -> None:
    location, writer, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    store = open_store(location, **options)
    i = 0
    while n == 0 or i < n:
        value = writer * 1000 + i
        try:
            version = store.commit(state(value, size), {"writer": writer, "i": i})
            print(json.dumps({"i": i, "version": version}), flush=True)
        except StoreConflict as e:
            print(json.dumps({"i": i, "conflict": str(e)}), flush=True)
        i += 1


if __name__ == "__main__":
    main()
