"""Console entry point: ``vcdask demo``, ``vcdask versions STORE``, ``vcdask gc STORE``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    """Train a small CNN on digits on the embedded default; exit 1 if it misses 0.95 test accuracy."""
    from .demo import run_demo

    out = run_demo(store=args.store, max_epochs=args.max_epochs, progress=not args.no_progress)
    return 0 if out["test_accuracy"] >= 0.95 else 1


def human(nbytes: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _versions(args: argparse.Namespace) -> int:
    from . import open_store

    store = open_store(args.store, mode="r")
    tags: dict[str, list[str]] = {}
    for name, version in store.tags().items():
        tags.setdefault(version, []).append(name)
    versions = store.versions(args.branch)
    print(f"{'version':20}  {'written (UTC)':19}  {'step':>6}  {'epoch':>5}  {'size':>10}  message")
    for info in versions[: args.limit]:
        meta = info.metadata
        tag = f"  [{', '.join(tags[info.id])}]" if info.id in tags else ""
        size = human(store.version_nbytes(info.id))
        step, epoch = meta.get("step", ""), meta.get("epoch", "")
        print(f"{info.id}  {info.written_at:%Y-%m-%d %H:%M:%S}  {step:>6}  {epoch:>5}  {size:>10}  {info.message}{tag}")
    more = f" ({len(versions) - args.limit} more: --limit)" if len(versions) > args.limit else ""
    print(f"{len(versions)} versions on {args.branch!r}{more}; the whole store holds {human(store.store_nbytes())}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    from . import Retention, open_store

    store = open_store(args.store, mode="r" if args.dry_run else "r+")
    policy = Retention(keep_last=args.keep_last, keep_epochs=not args.no_epochs, every=args.every)
    before = store.store_nbytes()
    report = store.gc(policy, branches=args.branch or None, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for branch in sorted(report.kept):
        removed, deferred = report.removed.get(branch, []), report.deferred.get(branch, [])
        later = f", {len(deferred)} later (still needed by another branch or a reader)" if deferred else ""
        print(f"{branch}: keeps {len(report.kept[branch])} versions, {verb} {len(removed)}{later}")
    for why in report.held_back:
        print(f"note: {why}")
    if args.dry_run:
        print(f"dry run: nothing changed; the store holds {human(before)}")
    else:
        print(f"deleted {human(report.bytes_deleted)} in {report.objects_deleted} objects; the store holds ", end="")
        print(f"{human(store.store_nbytes())} (was {human(before)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vcdask", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo on the embedded default")
    demo.add_argument("--store", default="vcdask-runs", help="store location (default: %(default)s)")
    demo.add_argument("--max-epochs", type=int, default=20)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=_demo)
    versions = sub.add_parser("versions", help="list a store's versions with their sizes, newest first")
    versions.add_argument("store")
    versions.add_argument("--branch", default="main")
    versions.add_argument("--limit", type=int, default=20)
    versions.set_defaults(func=_versions)
    gc = sub.add_parser(
        "gc",
        help="remove the versions a retention policy does not keep (tagged versions, each epoch's last "
        "version and the newest --keep-last stay)",
    )
    gc.add_argument("store")
    gc.add_argument("--keep-last", type=int, default=5, help="newest versions kept per branch (default: %(default)s)")
    gc.add_argument("--every", type=int, default=None, help="also keep the first version of every N merges")
    gc.add_argument("--no-epochs", action="store_true", help="do not keep each epoch's last version")
    gc.add_argument("--branch", action="append", help="only this branch (repeatable; default: every branch)")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    gc.set_defaults(func=_gc)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError, OSError) as e:  # bad option values, unknown branch, store faults: say it, exit 2
        print(f"vcdask {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
