"""Console entry point: ``vcdask demo``, ``vcdask versions STORE``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    """Train a small CNN on digits on the embedded default; exit 1 if it misses 0.95 test accuracy."""
    from .demo import run_demo

    out = run_demo(store=args.store, max_epochs=args.max_epochs, progress=not args.no_progress)
    return 0 if out["test_accuracy"] >= 0.95 else 1


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
    demo.add_argument("--store", default="vcdask-runs", help="store location (default: %(default)s)")
    demo.add_argument("--max-epochs", type=int, default=20)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
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
