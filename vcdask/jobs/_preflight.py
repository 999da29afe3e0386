"""The job's pre-flight: the store, the start, the model, the data, and fit's own checks, before any cluster work.

Every check that can fail because of the job file runs here (:func:`preflight`) and raises :class:`JobFileError`
naming the field; :mod:`._run` then trains, and anything that fails there is a failure of the job, not of its file.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MissingRegionError, ParameterMismatchError, StoreNotFoundError, VersionNotFoundError
from ._file import DataRef, Job, JobFileError, yaml_number_hint
from ._release import last_release

__all__ = ["Prepared", "fit_kwargs", "preflight"]

logger = logging.getLogger(__name__)

#: fit's options that say how ``fit`` shows the run, not what the run is: nothing to plan (a job file
#: cannot give ``wait``: :data:`._file.NOT_IN_A_JOB`).
LAUNCH_OPTIONS = ("progress",)


@dataclass
class Prepared:
    """A job that passed every check, ready to train."""

    job: Job
    store: Any  # ParamStore, open for writing (None while the pre-flight runs on a store that is not there yet)
    model: Any  # torch.nn.Module: fresh, or holding the start version
    start: dict[str, Any] | None  # {"tag", "version", "branch"} of the start; None: a fresh model
    data: Any
    validation: Any


def preflight(job: Job) -> Prepared:
    """Check what the job names: the report (its folder writable), the store (reachable), the start (exists),
    the model (builds, loads), the data.

    Then every check of :func:`vcdask.fit` runs on the job's options (:func:`vcdask.options.plan`: no
    cluster work), and the release metric is checked against the metrics the run will compute.

    Raises
    ------
    JobFileError
        Naming the field, e.g. ``job.yaml: start.tag: no tag 'nightly-9' in 's3://b/runs'; tags: [...]``.
    StoreError, OSError
        The store or a data file could not be reached, or refused access
        (:class:`~vcdask.errors.StoreUnreachableError`, :class:`~vcdask.errors.StoreAccessDeniedError` ...):
        a failure of the job (exit 1), not of its file.
    """
    import vcdask

    _check_report(job)
    _check_scheduler(job)
    # Read only until every check has passed: a job refused here leaves no new store behind.
    store = _open_store(job, "r")
    model = _build(job)
    start = _start(job, store)
    if start is not None:
        where = {k: start[k] for k in ("tag", "version", "branch") if start.get(k)}
        if "tag" in where:
            where = {"tag": where["tag"]}
        try:
            model = vcdask.load(store, model, **where)
        except ParameterMismatchError as e:
            raise JobFileError(job.path, "model", f"the model does not fit the start version: {e}") from None
        start["version"] = getattr(model, "vcdask_version", {})["id"]
    data = _read(job, "data", job.data)
    validation = job.validation if not isinstance(job.validation, DataRef) else _read(job, "validation", job.validation)
    prepared = Prepared(job, store, model, start, data, validation)
    _plan(prepared)
    _pickle_by_value(job)
    # A start that names something needs the store to exist; a fresh model or the first release may create it.
    prepared.store = _open_store(job, "r+" if isinstance(job.start, dict) else "a")
    return prepared


def fit_kwargs(prepared: Prepared) -> dict[str, Any]:
    """The job's keywords for :func:`vcdask.fit` (all but the model, the data and ``client=``)."""
    job = prepared.job
    options = dict(job.fit)
    options.setdefault("progress", False)
    ref = job.data
    for name in ("features", "label", "sample_dim"):
        value = getattr(ref, name)
        if value is not None:
            options[name] = list(value) if name == "features" and ref.format != "zarr" else value
    if ref.storage_options and ref.format == "zarr":  # (a CSV / Parquet file's: pandas read it, fit gets a DataFrame)
        options["storage_options"] = ref.storage_options
    return {**options, "validation": prepared.validation, "store": prepared.store}


def _blamed(prepared: Prepared, kwargs: dict[str, Any], error: Exception) -> str:
    """The job file's field a refusal of ``fit`` is about: ``fit`` for its options; for a refusal of the data,
    the data's field (``data.features``, ``data.label``, ``data``) when the training data alone is refused so,
    ``validation`` when the refusal names the validation data, ``start`` when it is about the values the model was
    loaded with (non-finite parameters of the release it starts from), ``model`` when it is about what the model
    makes of the training data (it cannot take its rows, its outputs do not fit the labels), else the data's
    field."""
    from ..data import DataError, prepare_data

    if not isinstance(error, DataError):
        return "fit"
    try:
        prepare_data(
            prepared.data,
            features=kwargs.get("features"),
            label=kwargs.get("label"),
            sample_dim=kwargs.get("sample_dim"),
            storage_options=kwargs.get("storage_options"),
        )
    except DataError as again:
        return _data_field(str(again))
    except Exception:  # noqa: BLE001 - only the blame is decided here; fit's message stands
        return "data"
    message = str(error)
    if prepared.validation is not None and "validation" in message:  # fit's checks name the validation data
        return "validation"
    if prepared.start is not None and "non-finite" in message and "model" in message:
        return "start"  # (the values the model was loaded with: the release or version it starts from)
    return "model" if "model" in message else _data_field(message)


def _data_field(message: str) -> str:
    """``data.features``, ``data.label`` or ``data.sample_dim`` when a refusal of the data names one, else ``data``."""
    words = {"features": ("feature",), "label": ("label",), "sample_dim": ("sample_dim", "sample dimension")}
    return next((f"data.{f}" for f, said in words.items() if any(w in message for w in said)), "data")


def _plan(prepared: Prepared) -> None:
    """Run fit's own checks (:func:`vcdask.options.plan`) on the job's options, and check the release
    metric against the metrics the run will compute: every mistake of the job file fails here, before training.
    """
    from ..groups import fold_options
    from ..options import plan

    job = prepared.job
    kwargs = fit_kwargs(prepared)
    options = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    try:
        with tempfile.TemporaryDirectory(prefix="vcdask-preflight-") as scratch, _quiet_store_logs():
            # plan opens the store as fit does, with mode "a": a store that is not there yet is created after
            # the checks (preflight), so plan gets a stand-in here that nobody sees (nor its creation logged)
            options["store"] = prepared.store if prepared.store is not None else str(Path(scratch) / "store")
            names = list(plan(prepared.model, prepared.data, **fold_options(options)).metric_names)
    except (ValueError, TypeError) as e:  # fit's own checks: the job's options are wrong
        blamed = _blamed(prepared, kwargs, e)
        problem = f"rejected by vcdask.fit: {e}{yaml_number_hint(job.fit, 'fit', str(e))}"
        raise JobFileError(job.path, blamed, problem) from None
    rule = job.release
    if rule is not None and rule.metric not in names:
        remedy = "; name it under fit.metrics (e.g. metrics: [mae]), or choose one of those"
        raise JobFileError(
            job.path, "release.metric", f"the run computes no {rule.metric!r}; it computes {names}{remedy}"
        )


@contextmanager
def _quiet_store_logs() -> Iterator[None]:
    """Store messages below warnings unsaid: the pre-flight's scratch store is nobody's to hear about."""
    store_logger = logging.getLogger("vcdask.store")
    level = store_logger.level
    store_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        store_logger.setLevel(level)


def _check_report(job: Job) -> None:
    """Check that the report can be written where the job says, creating its folder if it is missing: found
    only when the job ends, a bad ``report:`` made a job that trained and released exit 1 (and a retry of it
    train and release again)."""
    where = job.report
    if where is None:
        return
    nearest = next((p for p in (where.parent, *where.parent.parents) if p.exists()), None)
    if nearest is not None and not nearest.is_dir():
        raise JobFileError(job.path, "report", f"{nearest} is a file, not a folder; the report goes to {where}")
    if where.is_dir():
        raise JobFileError(job.path, "report", f"{where} is a folder; name a file in it, e.g. {where / 'report.json'}")
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        if where.exists():
            with where.open("a"):  # writable, and left as it is
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=where.parent, prefix=f".{where.name}.", suffix=".check"):
                pass
    except OSError as e:
        raise JobFileError(job.path, "report", f"cannot write the report to {where}: {e.strerror or e}") from None


def _check_scheduler(job: Job) -> None:
    """Check that ``scheduler:`` is a Dask scheduler address (``tcp://host:8786``); not whether it answers,
    which is found when the job connects (a failure, exit 1): an address that cannot be one is a bad job
    file, not a retry after the connection's timeout."""
    if job.scheduler is None:
        return
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port
    from distributed.comm.registry import get_backend

    try:
        scheme, location = parse_address(job.scheduler)
        get_backend(scheme)
        if scheme in ("tcp", "tls", "ws", "wss"):
            host, _ = parse_host_port(location)
            if not host or any(c.isspace() for c in host):
                raise ValueError(f"no host name in {location!r}")
    except (ValueError, TypeError) as e:
        problem = (
            f"{job.scheduler!r} is not a Dask scheduler address ({e}); write it as tcp://host:8786, "
            "or remove scheduler: to train on an embedded LocalCluster"
        )
        raise JobFileError(job.path, "scheduler", problem) from None


def _open_store(job: Job, mode: str) -> Any:
    """The job's store, opened with ``mode``; None for ``mode="r"`` when there is none yet and the job does
    not need one (a fresh model, or the first release: the job creates it once every check has passed)."""
    import vcdask

    if mode == "r" and job.store.startswith("memory://"):  # this process's only: opening it leaves nothing behind
        mode = "a"
    hint = "check store.location and store.storage_options"
    try:
        return vcdask.open_store(job.store, mode=mode, **job.storage_options)
    except MissingRegionError as e:
        cause = f" ({e.cause})" if e.cause else ""
        problem = (
            f"no region is set for the bucket of {job.store!r}{cause}: add it (e.g. region: eu-west-1), "
            "or set AWS_REGION"
        )
        raise JobFileError(job.path, "store.storage_options.region", problem) from None
    except StoreNotFoundError as e:
        if e.missing == "store" and mode == "r" and not isinstance(job.start, dict):
            return None
        if e.missing == "store":  # the store itself: start: names a version in it, so it must be there
            problem = f"no vcdask store at {e.location}; start: {job.start} needs one ({hint}, or drop start:)"
        else:
            problem = f"{e} ({hint})"
        raise JobFileError(job.path, "store", problem) from None
    except ValueError as e:  # unknown scheme or storage option
        raise JobFileError(job.path, "store", str(e)) from None
    # Any other fault of the store (unreachable, access denied, an outage) is a failure of the job (exit 1),
    # not of its file: the same job may pass once the store answers.


def _build(job: Job) -> Any:
    """The factory's model: a factory that refuses ``model_args`` (any error but an :class:`OSError`, e.g. a
    ``ValueError`` for ``hidden: -1``) is a bad job file naming ``model_args``; an :class:`OSError` (weights
    it could not download, a file it could not read) is a failure of the job (exit 1): it may pass next time."""
    import torch

    try:
        model = job.factory(**job.model_args)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001  the factory refused its arguments: say how, without a traceback
        args = ", ".join(f"{k}={v!r}" for k, v in job.model_args.items())
        problem = (
            f"{job.model}(**model_args) failed: {type(e).__name__}: {e} (model_args: {args or 'none'}); "
            "give values the factory accepts"
        )
        raise JobFileError(job.path, "model_args", problem) from None
    if not isinstance(model, torch.nn.Module):
        raise JobFileError(job.path, "model", f"{job.model} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _start(job: Job, store: Any) -> dict[str, Any] | None:
    start = job.start
    if start is None:
        return None
    if start == "last-release":
        assert job.release is not None
        if store is None:  # no store yet: no release either, a fresh model
            return None
        _, tag = last_release(store.tags(), job.release.tag_prefix)
        return None if tag is None else {"kind": "last-release", "tag": tag, "version": None, "branch": None}
    assert isinstance(start, dict)
    (kind, name), where = next(iter(start.items())), store.location
    if kind == "tag" and name not in store.tags():
        raise JobFileError(job.path, "start.tag", f"no tag {name!r} in {where!r}; tags: {sorted(store.tags())}")
    if kind == "branch" and not store.branches().get(name):
        runs = sorted(b for b, head in store.branches().items() if head and not b.startswith("vcdask."))
        raise JobFileError(job.path, "start.branch", f"no versions on branch {name!r} in {where!r}; branches: {runs}")
    if kind == "version":
        try:
            store.read(name)
        except VersionNotFoundError:
            raise JobFileError(job.path, "start.version", f"no version {name!r} in {where!r}") from None
    return {"kind": kind, "tag": None, "version": None, "branch": None, kind: name}


def _read(job: Job, name: str, ref: DataRef) -> Any:
    """A CSV / Parquet file as a DataFrame (columns checked), or a Zarr location as it is (fit reads it)."""
    if ref.format == "zarr":
        return ref.path
    import pandas as pd

    try:
        if ref.format == "csv":
            df = pd.read_csv(ref.path, storage_options=ref.storage_options or None)
        else:
            df = pd.read_parquet(ref.path, storage_options=ref.storage_options or None)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError, ImportError) as e:
        raise JobFileError(job.path, name, f"cannot read {ref.path} as {ref.format}: {e}") from None
    except OSError as e:  # not there is the job file's mistake; unreachable or refused is a failure (exit 1)
        raise OSError(f"cannot read {ref.path} (the job's {name}:) as {ref.format}: {e}") from e
    wanted = [ref.label, *(ref.features or ())]
    missing = [c for c in wanted if c is not None and c not in df.columns]
    if missing:
        field = f"{name}.label" if ref.label in missing else f"{name}.features"
        raise JobFileError(job.path, field, f"no column(s) {missing} in {ref.path}; columns: {list(df.columns)}")
    return df


def _pickle_by_value(job: Job) -> None:
    """Modules beside the job file travel inside the run's spec: workers need not have the job's directory."""
    import cloudpickle

    base = job.path.parent
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        path = Path(file).absolute() if file else None
        if path is None or not path.is_relative_to(base) or name.startswith("vcdask"):
            continue
        if {"site-packages", "dist-packages"} & set(path.parts) or _installed(path):  # a venv, the stdlib
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:  # not importable by its name (a script run as __main__)
            continue


def _installed(path: Path) -> bool:
    """Whether ``path`` is in Python's own tree (the standard library, the environment's packages)."""
    return any(path.is_relative_to(Path(p).absolute()) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
