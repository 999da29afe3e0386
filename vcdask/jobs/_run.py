"""Running a job: pre-flight (:mod:`._preflight`) -> ``vcdask.fit`` -> score -> release -> report.

Every check that can fail because of the job file runs in :func:`preflight`, before any cluster work: an
error after it (training, scoring, tagging) is a failure of the job (exit 1), not a bad job file (exit 2).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import ParameterMismatchError, TagExistsError
from ..store._files import write_whole
from ._file import Job, JobFileError, job_text, load_job
from ._preflight import Prepared, fit_kwargs, preflight
from ._release import last_release, score
from ._signals import Interrupts

__all__ = [
    "EXIT_BAD_JOB",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_BETTER",
    "EXIT_RELEASED",
    "JobOutcome",
    "run_job",
]

logger = logging.getLogger(__name__)

#: ``vcdask train`` exit codes: released (or trained, without a release rule); the job failed; the job file is
#: wrong (or names something that is not there); trained, but not better than the last release.
EXIT_RELEASED, EXIT_FAILED, EXIT_BAD_JOB, EXIT_NOT_BETTER = 0, 1, 2, 3
#: Interrupted (Ctrl-C, or SIGTERM from cron, systemd or Kubernetes): the run was stopped, its merged work
#: committed, nothing released; the shell's code for a process ended by SIGINT.
EXIT_INTERRUPTED = 130


@dataclass
class JobOutcome:
    """What a job did: its exit code, its report (as written) and, when it failed, the error."""

    exit_code: int
    report: dict[str, Any]
    error: BaseException | None = field(default=None, repr=False)

    @property
    def message(self) -> str:
        """One line for the terminal: the error of a job that failed, else what the job did."""
        return self.report.get("error") or self.report.get("reason") or ""


def run_job(path: str | os.PathLike) -> JobOutcome:
    """Run the job file at ``path``: check it, train, score, release, and write its report.

    Returns
    -------
    JobOutcome
        ``exit_code``: :data:`EXIT_RELEASED` (0), :data:`EXIT_NOT_BETTER` (3), :data:`EXIT_BAD_JOB` (2),
        :data:`EXIT_FAILED` (1) or :data:`EXIT_INTERRUPTED` (130: Ctrl-C or SIGTERM, which the job, in the
        main thread, takes as Ctrl-C).  Nothing is raised: the error, if any, is in ``outcome.error``.
    """
    interrupts = Interrupts()  # Ctrl-C and SIGTERM raise KeyboardInterrupt until the job has ended
    try:
        return _run_job(path, interrupts)
    finally:
        interrupts.restore()


def _run_job(path: str | os.PathLike, interrupts: Interrupts) -> JobOutcome:
    t0 = time.perf_counter()
    report: dict[str, Any] = {"job": str(Path(path).absolute()), "started_at": _now(), "timings": {}}
    job = None
    error: BaseException | None = None
    try:
        job = load_job(path)
        prepared = preflight(job)
        report["timings"]["check_s"] = round(time.perf_counter() - t0, 3)
        report.update(store=prepared.store.location, start=prepared.start)
        code = _train_and_release(prepared, report)
    except JobFileError as e:
        code, error = EXIT_BAD_JOB, e
    except Exception as e:  # noqa: BLE001  the job failed: the report and the exit code say so, the CLI prints one line
        code, error = EXIT_FAILED, e
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: fit stopped the run (its merged work is committed)
        code, error = EXIT_INTERRUPTED, e
    finally:
        interrupts.hold()  # the job has ended: another signal must not lose its report
    if isinstance(error, KeyboardInterrupt):
        report.update(released=False, error=_interrupted(report))
    elif error is not None:
        report.update(released=False, error=str(error) if code == EXIT_BAD_JOB else f"{type(error).__name__}: {error}")
    report.update(exit_code=code, finished_at=_now())
    report["timings"]["total_s"] = round(time.perf_counter() - t0, 3)
    where = job.report if job is not None else _report_path(Path(path).absolute())
    if where is not None:
        try:
            _write_whole(where, _json(report, indent=2) + "\n")
        except OSError as e:  # (the pre-flight checked the place: it changed since)
            logger.error("could not write the report to %s: %s", where, e)
            if error is None:
                code, error = EXIT_FAILED, e
                done = f" (the job itself: {report['reason']})" if report.get("reason") else ""
                report.update(exit_code=code, error=f"could not write the report to {where}: {e}{done}")
    return JobOutcome(code, report, error)


def _write_whole(where: Path, text: str) -> None:
    """Write the report ``text`` to ``where`` whole or not at all (a monitor reading it as it is written, or a
    job killed as it writes, never sees half of one): :func:`vcdask.store._files.write_whole`."""
    where.parent.mkdir(parents=True, exist_ok=True)
    write_whole(where, [text.encode()])


def _interrupted(report: dict[str, Any]) -> str:
    """What an interrupted job did: stopped its run (named, resumable), or started none."""
    said = "interrupted (Ctrl-C or SIGTERM)"
    run_id = report.get("run_id")
    if run_id is None:
        return f"{said} before a run started: nothing trained, nothing released"
    if "version" in report:  # its run had ended: the job was scoring or releasing its result
        return f"{said} after run {run_id} ended, while scoring or releasing its result: nothing released"
    resume = f"vcdask.resume({run_id!r}, store=...) continues it"
    if report.get("run_status") not in (None, "finished", "error", "cancelled"):
        return (
            f"{said}: run {run_id} was told to stop but had not ended when the job left (vcdask.interrupt-grace); "
            f"nothing released, its last commit stays; {resume}"
        )
    return f"{said}: run {run_id} was stopped, what it merged is committed, nothing released; {resume}"


def _report_path(path: Path) -> Path | None:
    """Where a job file that failed its checks wants its report, if it says so legibly."""
    import yaml

    try:
        raw = yaml.safe_load(job_text(path))
    except (OSError, JobFileError, yaml.YAMLError):
        return None
    report = raw.get("report") if isinstance(raw, dict) else None
    return path.parent / os.path.expanduser(report) if isinstance(report, str) and report else None


def _train_and_release(prepared: Prepared, report: dict[str, Any]) -> int:
    import vcdask

    from ..spec import load_spec

    job, store = prepared.job, prepared.store
    t = time.perf_counter()
    result = _fit(prepared, report)
    report["timings"]["fit_s"] = round(time.perf_counter() - t, 3)
    report.update(
        version=result.version,
        epochs=len(result.epochs),
        run_metrics={k: float(v) for k, v in (result.metrics or {}).items()},
        recorded_start=getattr(result, "start", None),
        settings=result.settings,
    )
    logger.info("run %s: version %s after %d epochs", result.run_id, result.version, len(result.epochs))
    rule = job.release
    if rule is None:
        report.update(released=False, reason="trained; the job has no release rule")
        _record(store, result.run_id, report)
        return EXIT_RELEASED
    t = time.perf_counter()
    spec = load_spec(store, result.run_id)
    candidate_model = vcdask.load(store, job.factory(**job.model_args), version=result.version)
    candidate_scores = score(spec, {"candidate": candidate_model})["candidate"]
    report["timings"]["score_s"] = round(time.perf_counter() - t, 3)
    if rule.metric not in candidate_scores:  # preflight checked the metric: this is not the job file's fault
        raise RuntimeError(f"run {result.run_id} computed no {rule.metric!r}; it has: {sorted(candidate_scores)}")
    return _release(prepared, report, result.run_id, result.version, spec, candidate_scores)


def _release(
    prepared: Prepared, report: dict[str, Any], run_id: str, version: str, spec: Any, scores: dict[str, float]
) -> int:
    """Compare the candidate with the newest release and tag it if it is better; when another job tags the
    same name first, compare again with that release (at most :data:`RELEASE_TRIES` times)."""
    rule = prepared.job.release
    assert rule is not None
    for _ in range(RELEASE_TRIES):
        number, last = last_release(prepared.store.tags(), rule.tag_prefix)
        code = _compare(prepared, report, run_id, version, spec, scores, number, last)
        if code is not None:
            return code
    raise RuntimeError(f"could not tag a release: {RELEASE_TRIES} times another job released the same name first")


#: How often a job re-reads the last release when another job tags the same name first.
RELEASE_TRIES = 5


def _compare(
    prepared: Prepared,
    report: dict[str, Any],
    run_id: str,
    version: str,
    spec: Any,
    scores: dict[str, float],
    number: int,
    last: str | None,
) -> int | None:
    """Compare the candidate (``version`` of run ``run_id``) with release ``last``, number ``number`` (None, 0:
    there is none); record the outcome beside the run, then tag ``<prefix><number + 1>`` if it is better.

    Returns the exit code, or None when another job took that tag first (the record says so; re-read the
    releases and compare again).
    """
    job, store = prepared.job, prepared.store
    rule = job.release
    assert rule is not None
    candidate = scores[rule.metric]
    all_scores: dict[str, dict[str, float]] = {"candidate": scores}
    if last is not None:  # scored on the same rows, with the same functions, in this process
        all_scores.update(score(spec, {"release": _load_release(job, store, last)}))
    report["release"] = {
        "metric": rule.metric,
        "mode": rule.mode,
        "min_delta": rule.min_delta,
        "candidate": candidate,
        "baseline": all_scores["release"][rule.metric] if last else None,
        "baseline_tag": last,
        "baseline_version": store.tags()[last] if last else None,
        "scores": all_scores,
        "tag": None,
    }
    baseline = all_scores["release"][rule.metric] if last is not None else math.nan
    if last is not None and math.isfinite(candidate) and not math.isfinite(baseline):
        # (a release that scores no number, e.g. NaN from a model an old release merged badly, is beaten by any that
        # does: compared, it would block every later release, each job ending "not better")
        why = f"{rule.metric} {candidate:.6g} is a number, {last}'s is {baseline}"
    elif last is not None:
        gain = rule.improvement(candidate, baseline)
        if not rule.beats(candidate, baseline):
            report.update(
                released=False,
                reason=f"not released: {rule.metric} {candidate:.6g} vs {last} {baseline:.6g} "
                f"(gain {gain:.6g}, needs more than {rule.min_delta:g}); {last} stays the newest release, "
                f"the candidate stays on branch {run_id}",
            )
            _record(store, run_id, report)
            return EXIT_NOT_BETTER
        why = f"{rule.metric} {candidate:.6g} beats {last} {baseline:.6g} by {gain:.6g} (> {rule.min_delta:g})"
    else:
        why = f"first release of {rule.tag_prefix}<N> ({rule.metric} {candidate:.6g})"
    tag = f"{rule.tag_prefix}{number + 1}"
    report["release"]["tag"] = tag
    report.update(released=True, reason=f"released {tag} = version {version}: {why}")
    _record(store, run_id, report)  # first: a tag always has its record (a failed record tags nothing)
    try:
        store.tag(tag, version)
    except TagExistsError:  # another job released since we looked: compare with its release
        logger.info("another job released %s first; comparing with it", tag)
        report.update(released=False, reason=f"{tag} was released by another job first")
        report["release"]["tag"] = None
        _record(store, run_id, report)
        return None
    except BaseException as e:
        report.update(released=False, reason=None, error=f"tagging {tag} failed: {type(e).__name__}: {e}")
        report["release"]["tag"] = None
        try:
            _record(store, run_id, report)
        except Exception:
            logger.exception("could not correct the record of run %s", run_id)
        raise
    return EXIT_RELEASED


def _fit(prepared: Prepared, report: dict[str, Any]) -> Any:
    """Train: any error here is a failure (exit 1); the job file's mistakes were found by :func:`preflight`.

    The run's id goes into ``report`` as soon as the run has started: a run stopped by Ctrl-C or SIGTERM, or
    one that failed, is named in the report (and may be resumed)."""
    import vcdask

    job = prepared.job
    t0 = time.perf_counter()
    client = None
    if job.scheduler:
        from distributed import Client

        try:
            client = Client(job.scheduler, timeout="20s", set_as_default=False)
        except OSError as e:
            raise ConnectionError(f"cannot reach the scheduler at {job.scheduler} (the job's scheduler:): {e}") from e
    kwargs = fit_kwargs(prepared)
    progress = kwargs.pop("progress")
    try:
        handle = vcdask.fit(prepared.model, prepared.data, client=client, wait=False, **kwargs)
        assert isinstance(handle, vcdask.RunHandle)  # (wait=False)
        report["run_id"] = handle.run_id
        try:
            handle.wait(progress=progress)  # Ctrl-C (or SIGTERM) here stops the run, as in fit
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):  # whether it ended within the interrupt grace (the report says)
                report["run_status"] = handle.status()["status"]
            raise
        return handle.result(wall_time=time.perf_counter() - t0)
    finally:
        if client is not None:
            client.close()


def _load_release(job: Job, store: Any, tag: str) -> Any:
    import vcdask

    try:
        return vcdask.load(store, job.factory(**job.model_args), tag=tag)
    except ParameterMismatchError:  # the architecture changed since: score the release with its own run's model
        return vcdask.load(store, tag=tag)


def _record(store: Any, run_id: str, report: dict[str, Any]) -> None:
    """Keep the job's record beside the run (``runs/<run_id>/job.json``): ``vcdask runs`` shows it."""
    store.files.put(f"{run_id}/job.json", _json(report).encode())


def _json(report: dict[str, Any], indent: int | None = None) -> str:
    """``report`` as JSON that every reader takes: a NaN or infinite number is null (bare ``NaN`` is not JSON:
    ``JSON.parse`` refuses the file, jq reads null anyway)."""

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(report), indent=indent, default=str, allow_nan=False)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
