"""The ``vcdask`` command: ``train JOB.yaml``, ``runs``, ``tags``, ``versions`` and ``gc STORE``, ``demo``.

Every store command takes the store's storage options (``--endpoint-url``, ``--region``, ``--anon``,
``--storage-option KEY=VALUE``), prints one line per failure with the remedy (``--debug``: the
traceback too), and exits non-zero on failure: 2 for bad arguments or nothing there (no such store,
branch, run or tag), 1 when the store or the run failed.  ``vcdask train`` exits with the job's codes:
0 released, 3 not better, 2 bad job file, 1 failed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from ._errors import CommandError, report
from ._listing import gc, human, runs, tags, versions

__all__ = ["human", "main"]


#: The test accuracy ``vcdask demo`` must reach (else it exits 1).
DEMO_BAR = 0.95


def _demo(args: argparse.Namespace) -> int:
    """Train a small CNN on digits on the embedded default; exit 1 if it misses :data:`DEMO_BAR` test accuracy."""
    from ..demo import run_demo

    out = run_demo(store=args.store, max_epochs=args.max_epochs, progress=not args.no_progress)
    code, why = demo_verdict(out["test_accuracy"], args.max_epochs)
    if why is not None:
        print(why, file=sys.stderr)
    return code


def demo_verdict(accuracy: float, max_epochs: int) -> tuple[int, str | None]:
    """``vcdask demo``'s exit code for a final test ``accuracy`` after ``max_epochs``, and the line it prints
    on stderr when that is under :data:`DEMO_BAR` (None when it is not)."""
    if accuracy >= DEMO_BAR:
        return 0, None
    return 1, (
        f"vcdask demo: test accuracy {accuracy:.4f} is under the demo's bar of {DEMO_BAR} (exit 1); "
        f"train longer (--max-epochs, now {max_epochs})"
    )


def _train(args: argparse.Namespace) -> int:
    from ..cluster import close_embedded
    from ..jobs import EXIT_BAD_JOB, EXIT_FAILED, EXIT_INTERRUPTED, run_job
    from ..jobs._signals import Interrupts

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Ctrl-C and SIGTERM stop the job (run_job); after it, until its cluster is closed, they are ignored:
    # the process exits with its report's code, not killed half-way through closing (rc 143)
    held = Interrupts(held=True)
    try:
        outcome = run_job(args.job)
        if outcome.error is not None and args.debug:
            import traceback

            traceback.print_exception(outcome.error)
        if outcome.exit_code in (EXIT_BAD_JOB, EXIT_FAILED, EXIT_INTERRUPTED):
            plain = args.debug or outcome.exit_code in (EXIT_BAD_JOB, EXIT_INTERRUPTED)
            hint = "" if plain else " (--debug shows the traceback)"
            print(f"vcdask train: {outcome.message}{hint}", file=sys.stderr)
        else:
            print(outcome.message)
        close_embedded()
    finally:
        held.restore()
    return outcome.exit_code


def _days(text: str) -> float:
    """An argparse ``type``: a finite number of days >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of days >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of days >= 0, got {text}")
    return value


def _at_least(minimum: int):
    """An argparse ``type``: an integer >= ``minimum``, else argparse's usage error (exit 2) naming the value."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return count


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The storage options given on the command line, as :func:`vcdask.open_store` keywords.

    ``--storage-option KEY=VALUE`` values are read as YAML scalars (``true``, ``3``, ``1.5``, text).
    """
    import yaml

    options: dict[str, Any] = {}
    for item in args.storage_option or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CommandError(f"--storage-option {item!r}: expected KEY=VALUE, e.g. allow_http=true")
        try:
            options[key.strip()] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            options[key.strip()] = value
    for key, value in (("endpoint_url", args.endpoint_url), ("region", args.region)):
        if value is not None:
            options[key] = value
    if args.anon:
        options["anonymous"] = True
    return options


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    return common


def _storage() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("storage options")
    group.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph, a local server)")
    group.add_argument("--region", help="the bucket's region")
    group.add_argument("--anon", action="store_true", help="anonymous access (a public bucket)")
    group.add_argument(
        "--storage-option",
        "-o",
        action="append",
        metavar="KEY=VALUE",
        help="any other option of vcdask.open_store, e.g. -o allow_http=true (repeatable)",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The ``vcdask`` argument parser."""
    parser = argparse.ArgumentParser(prog="vcdask", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common, storage = _common(), _storage()
    store_cmd = [common, storage]

    train = sub.add_parser(
        "train",
        parents=[common],
        help="run a job file: train, release if better, write a report (exit 0 released, 3 not better, "
        "2 bad job file, 1 failed)",
    )
    train.add_argument("job", help="the YAML job file (see docs: Scheduled jobs)")
    train.set_defaults(func=_train)

    listing = sub.add_parser("runs", parents=store_cmd, help="list a store's runs: status, epochs, metric, size")
    listing.add_argument("store")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=runs)

    tagged = sub.add_parser("tags", parents=store_cmd, help="list a store's tags: version, run, written, size")
    tagged.add_argument("store")
    tagged.add_argument("--json", action="store_true", help="print JSON")
    tagged.set_defaults(func=tags)

    listed = sub.add_parser(
        "versions", parents=store_cmd, help="list a run's versions with their sizes, newest first (default: newest run)"
    )
    listed.add_argument("store")
    which = listed.add_mutually_exclusive_group()
    which.add_argument("--run", help="the run (default: the newest)")
    which.add_argument("--branch", help="any branch, e.g. main")
    listed.add_argument("--limit", type=_at_least(1), default=20, help="newest versions shown (default: 20)")
    listed.set_defaults(func=versions)

    collect = sub.add_parser(
        "gc",
        parents=store_cmd,
        help="remove the versions a retention policy does not keep (tagged versions, each epoch's last "
        "version and the newest --keep-last stay), and the data ended runs staged in the store once their time is up",
    )
    collect.add_argument("store")
    collect.add_argument(
        "--keep-last", type=_at_least(1), default=5, help="newest versions kept per branch (default: 5)"
    )
    collect.add_argument(
        "--every", type=_at_least(1), default=None, help="also keep the first version of every N merges"
    )
    collect.add_argument("--no-epochs", action="store_true", help="do not keep each epoch's last version")
    collect.add_argument(
        "--keep-staged-days",
        type=_days,
        default=None,
        help="remove the data every run staged in the store this many days after it ended (default: each run "
        "by its own Retention(keep_staged_for=), a week for runs of an earlier vcdask)",
    )
    collect.add_argument("--branch", action="append", help="only this branch (repeatable; default: every branch)")
    collect.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    collect.set_defaults(func=gc)

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help=f"run the demo on the embedded default (exit 1 when its test accuracy is under {DEMO_BAR})",
        description=f"Train a small CNN on the digits data set on the embedded default cluster; exit 0 when its "
        f"test accuracy reaches {DEMO_BAR}, 1 (saying so on stderr) when it is under.",
    )
    demo.add_argument("--store", default="vcdask-runs", help="store location (default: %(default)s)")
    demo.add_argument("--max-epochs", type=_at_least(1), default=20, help="epochs to train (default: %(default)s)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``vcdask`` command with ``argv`` (default: ``sys.argv[1:]``); return its exit code.

    Examples
    --------
    >>> from vcdask.cli import main
    >>> main(["runs", "s3://bucket/runs", "--endpoint-url", "http://127.0.0.1:9000"])  # doctest: +SKIP
    """
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "storage_option"):
            args.storage_options = storage_options(args)
        return args.func(args)
    except BrokenPipeError:  # `vcdask versions STORE | head`: the reader left; stop quietly, as ls does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, what a shell reports for a command stopped by a closed pipe
    except Exception as e:  # noqa: BLE001  every failure becomes one line on stderr and an exit code
        return report(args.command, e, debug=args.debug)
