"""Console entry point: ``vcdask demo``, ``vcdask versions STORE``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    """Store round trip: commit a small CNN's state twice, tag one, read both back exactly."""
    import torch

    from . import open_store
    from .params import flatten
    from .testing.store import trained_state

    store = open_store(args.store)
    model = trained_state(0)
    v1 = store.commit(model, {"step": 1}, message="demo: first version")
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    v2 = store.commit(model, {"step": 2}, message="demo: second version")
    store.tag(f"demo-{v1[:8].lower()}", v1)
    ok = store.read(v2).params.equal(flatten(model)) and store.read(v1).params.equal(flatten(trained_state(0)))
    print(f"store: {store.location}")
    for info in store.versions()[:2]:
        print(f"  {info.id}  {info.written_at:%Y-%m-%d %H:%M:%S}  {info.message}  {info.metadata}")
    print(f"round trip exact: {ok}")
    return 0 if ok else 1


def _versions(args: argparse.Namespace) -> int:
    from . import open_store

    store = open_store(args.store, mode="r")
    tags: dict[str, list[str]] = {}
    for name, version in store.tags().items():
        tags.setdefault(version, []).append(name)
    for info in store.versions(args.branch)[: args.limit]:
        tag = f"  [{', '.join(tags[info.id])}]" if info.id in tags else ""
        print(f"{info.id}  {info.written_at:%Y-%m-%d %H:%M:%S}  {info.message}  {info.metadata}{tag}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vcdask", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo on the embedded default")
    demo.add_argument("--store", default="vcdask-runs/demo-store", help="store location (default: %(default)s)")
    demo.set_defaults(func=_demo)
    versions = sub.add_parser("versions", help="list a store's versions, newest first")
    versions.add_argument("store")
    versions.add_argument("--branch", default="main")
    versions.add_argument("--limit", type=int, default=20)
    versions.set_defaults(func=_versions)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
