"""Scheduled training jobs: ``vcdask train JOB.yaml``.

A job file names the model factory, the data, the store and where to start, ``fit`` options, a release
rule and where to write a JSON report; :func:`run_job` checks all of it before any cluster work
(:func:`preflight`, which also runs every check of :func:`vcdask.fit` on the job's options), trains,
scores the result against the last release on the run's validation data, and tags it only if it is
better.  The job file's JSON Schema ships with the package (:func:`job_schema`).

Exit codes (:class:`JobOutcome` ``.exit_code``): 0 released (or trained, without a release rule),
3 not better than the last release, 2 bad job file, 1 failed.
"""

from __future__ import annotations

from ._file import DataRef, Job, JobFileError, ReleaseRule, job_schema, load_job
from ._preflight import preflight
from ._release import last_release, score
from ._run import EXIT_BAD_JOB, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NOT_BETTER, EXIT_RELEASED, JobOutcome, run_job

__all__ = [
    "EXIT_BAD_JOB",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_BETTER",
    "EXIT_RELEASED",
    "DataRef",
    "Job",
    "JobFileError",
    "JobOutcome",
    "ReleaseRule",
    "job_schema",
    "last_release",
    "load_job",
    "preflight",
    "run_job",
    "score",
]
