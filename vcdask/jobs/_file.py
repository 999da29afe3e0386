"""Reading a job file: YAML -> the shipped JSON Schema -> semantic checks -> a :class:`Job`.

Nothing here touches a cluster or a store; :mod:`._preflight` does the checks that need the store and the model.
"""

from __future__ import annotations

import importlib
import importlib.resources
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from ..errors import VcdaskError

__all__ = ["DataRef", "Job", "JobFileError", "ReleaseRule", "job_schema", "load_job", "yaml_number_hint"]

#: fit options the job file sets in fields of its own, and where.
JOB_FIELDS = {
    "model": "model",
    "data": "data",
    "validation": "validation",
    "store": "store",
    "storage_options": "data.storage_options",
    "client": "scheduler",
    "features": "data.features",
    "label": "data.label",
    "sample_dim": "data.sample_dim",
}
#: fit options a job cannot honour, and why: it waits for its run to score and release the result, and a
#: YAML value is never a Python callable.
NOT_IN_A_JOB = {
    "wait": "a job always waits for its run (it scores and releases the result, then exits); remove it",
    **{
        name: "takes a Python callable, which a job file cannot give; use a script that calls vcdask.fit"
        for name in ("train_step", "eval_step", "collate_fn", "optimizer", "lr_schedule")
    },
}
#: fit options given as a mapping in YAML, and the option group they build.
OPTION_GROUPS = {
    "merging": "Merging",
    "training": "Training",
    "stopping": "Stopping",
    "resilience": "Resilience",
    "retention": "Retention",
}
#: Fields that take several forms: a schema error there repeats the field's description.
ONE_OF = frozenset({"data", "validation", "store", "start"})
FORMATS = {".zarr": "zarr", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".icechunk": "zarr"}


class JobFileError(VcdaskError, ValueError):
    """The job file is wrong: its message names the file and the field (``job.yaml: fit.max_epoch: ...``).

    Attributes
    ----------
    field : str
        The dotted path of the bad field (``""`` for the whole file).
    """

    def __init__(self, path: str | os.PathLike, field: str, problem: str):
        self.path, self.field, self.problem = str(path), field, problem
        where = f"{Path(path).name}: {field}: " if field else f"{Path(path).name}: "
        super().__init__(where + problem)


@dataclass(frozen=True)
class DataRef:
    """One dataset of the job: a Zarr URL/path or a CSV/Parquet file, with its variables."""

    path: str
    format: str  # "zarr", "csv" or "parquet"
    features: tuple[str, ...] | None = None
    label: str | None = None
    sample_dim: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReleaseRule:
    """Tag a run's result ``<tag_prefix>N+1`` only if its ``metric`` beats the last release's by ``min_delta``."""

    metric: str
    mode: str  # "max" or "min"
    tag_prefix: str = "release-"
    min_delta: float = 0.0

    def improvement(self, candidate: float, baseline: float) -> float:
        """How much better ``candidate`` is than ``baseline`` (negative: worse)."""
        return candidate - baseline if self.mode == "max" else baseline - candidate

    def beats(self, candidate: float, baseline: float) -> bool:
        """Whether ``candidate`` beats ``baseline`` by more than ``min_delta``."""
        return self.improvement(candidate, baseline) > self.min_delta


@dataclass(frozen=True)
class Job:
    """A checked job file.  Paths are absolute (relative ones are taken from the job file's directory)."""

    path: Path
    model: str
    factory: Callable[..., Any]
    model_args: dict[str, Any]
    data: DataRef
    validation: DataRef | float | None
    store: str
    storage_options: dict[str, Any]
    start: dict[str, str] | str | None
    fit: dict[str, Any]
    scheduler: str | None
    release: ReleaseRule | None
    report: Path | None


@cache
def job_schema() -> dict[str, Any]:
    """The job file's JSON Schema, as shipped with the package (``vcdask/jobs/job.schema.json``)."""
    return json.loads(importlib.resources.files(__package__).joinpath("job.schema.json").read_text())


def load_job(path: str | os.PathLike) -> Job:
    """Read and check a job file; nothing is started and no store is opened.

    Parameters
    ----------
    path : str or path-like
        The YAML job file.  Its directory goes on ``sys.path`` so that the model factory may live beside it.

    Returns
    -------
    Job

    Raises
    ------
    JobFileError
        The file is missing, not UTF-8 text, not YAML, breaks the schema, names a factory that does not
        import, or a ``fit`` option that :func:`vcdask.fit` does not have or that a job cannot honour (``wait``,
        which a job always does, and the options that take a Python callable); the message names the field and
        the remedy.
    """
    import yaml

    path = Path(path).absolute()
    try:
        raw = yaml.safe_load(job_text(path))
    except OSError as e:
        raise JobFileError(path, "", f"cannot read the job file ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise JobFileError(path, "", f"not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    _check_schema(path, raw)
    base = path.parent
    fit = _fit_options(path, raw.get("fit") or {})
    release = _release(path, raw.get("release"), fit)
    start = raw.get("start")
    if start == "last-release" and release is None:
        raise JobFileError(path, "start", "'last-release' needs a release: section (its tag_prefix names the releases)")
    data = _data(path, "data", raw["data"], base)
    validation = raw.get("validation")
    if isinstance(validation, (dict, str)):
        validation = _data(path, "validation", validation, base, like=data)
    if release is not None and validation is None:
        remedy = "add validation: (a path, or a fraction such as 0.2)"
        raise JobFileError(path, "release", f"a release compares validation metrics: {remedy}")
    store = raw["store"] if isinstance(raw["store"], dict) else {"location": raw["store"]}
    report = raw.get("report")
    return Job(
        path=path,
        model=raw["model"],
        factory=_factory(path, raw["model"]),
        model_args=dict(raw.get("model_args") or {}),
        data=data,
        validation=validation,
        store=_location(store["location"], base),
        storage_options=dict(store.get("storage_options") or {}),
        start=start,
        fit=fit,
        scheduler=raw.get("scheduler"),
        release=release,
        report=None if report is None else base / os.path.expanduser(report),
    )


def job_text(path: Path) -> str:
    """The job file's text: UTF-8 (YAML's own encoding), whatever the locale says."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        problem = f"not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}; save the file as UTF-8"
        raise JobFileError(path, "", problem) from None


def _check_schema(path: Path, raw: Any) -> None:
    import jsonschema

    validator = jsonschema.Draft202012Validator(job_schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if not errors:
        return
    e = jsonschema.exceptions.best_match(errors)
    where = ".".join(map(str, e.absolute_path))
    if e.validator == "additionalProperties":
        allowed = sorted(e.schema.get("properties", {}))
        extra = sorted(set(e.instance) - set(allowed))
        name = ".".join([where, extra[0]]) if where else extra[0]
        raise JobFileError(path, name, f"unknown field; valid: {', '.join(allowed)}")
    if e.validator == "required":
        missing = [k for k in e.validator_value if k not in e.instance]
        name = ".".join([where, missing[0]]) if where else missing[0]
        raise JobFileError(path, name, "missing (required)")
    top = str(e.absolute_path[0]) if e.absolute_path else ""
    described = job_schema()["properties"].get(top, {}).get("description", "") if top in ONE_OF else ""
    if "storage_options" in e.absolute_path or _holds_options(e.instance):  # (may hold credentials: never shown)
        problem = _expected(e.schema) + "; its value is not shown, as it may hold credentials"
    else:
        problem = f"{e.instance!r} is not valid here" if e.validator == "oneOf" else e.message
        problem += _number_text_hint(e.instance, where) if e.validator == "type" else ""
    raise JobFileError(path, where, f"{problem}. {described}".strip() if described else problem)


def _holds_options(value: Any) -> bool:
    """Whether ``value`` holds a ``storage_options`` entry (at any depth), whose values may be credentials."""
    if isinstance(value, dict):
        return "storage_options" in value or any(_holds_options(v) for v in value.values())
    return isinstance(value, list) and any(_holds_options(v) for v in value)


def _expected(schema: Any) -> str:
    """What the schema ``schema`` expects, in words (``"must be a mapping"``), for a refusal that shows no value."""
    words = {
        "object": "a mapping",
        "array": "a list",
        "string": "a string",
        "number": "a number",
        "integer": "an integer",
        "boolean": "true or false",
    }
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    if kinds:
        return "must be " + " or ".join(words.get(k, k) for k in kinds)
    return "is not valid here"


def _location(location: str, base: Path) -> str:
    """A store or data location: URLs as they are, local paths made absolute from the job's directory."""
    if "://" in location:
        return location
    return str(base / os.path.expanduser(location))


def _data(path: Path, name: str, value: str | dict, base: Path, like: DataRef | None = None) -> DataRef:
    spec: dict[str, Any] = {"path": value} if isinstance(value, str) else dict(value)
    location = _location(spec["path"], base)
    fmt = spec.get("format") or FORMATS.get(Path(location.rstrip("/")).suffix.lower(), "zarr")
    features = spec.get("features")
    features = (features,) if isinstance(features, str) else (tuple(features) if features else None)
    ref = DataRef(location, fmt, features, spec.get("label"), spec.get("sample_dim"), spec.get("storage_options") or {})
    if "://" not in location and not os.path.exists(location):
        raise JobFileError(path, f"{name}.path" if isinstance(value, dict) else name, f"no such file: {location}")
    if fmt in ("csv", "parquet") and like is None and ref.label is None:
        raise JobFileError(path, f"{name}.label", f"a {fmt} file needs label: (the name of the target column)")
    if fmt in ("csv", "parquet") and ref.sample_dim is not None:
        raise JobFileError(path, f"{name}.sample_dim", f"a {fmt} file's samples are its rows: leave sample_dim out")
    if like is not None:  # validation: fit takes one set of variable names and storage options
        for attr in ("features", "label", "sample_dim", "storage_options"):
            mine = getattr(ref, attr)
            if mine and mine != getattr(like, attr):
                shown = "" if attr == "storage_options" else f" ({getattr(like, attr)!r})"  # (never its values)
                raise JobFileError(path, f"{name}.{attr}", f"must match data.{attr}{shown}")
        ref = DataRef(location, fmt, like.features, like.label, like.sample_dim, like.storage_options)
    return ref


def _factory(path: Path, spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    base = str(path.parent)
    if base not in sys.path:
        sys.path.insert(0, base)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise JobFileError(
            path, "model", f"cannot import {module_name!r} ({e}); looked beside the job file ({base}) and on sys.path"
        ) from None
    except Exception as e:  # noqa: BLE001  the user's module failed while importing: say how, without a traceback
        raise JobFileError(path, "model", f"importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise JobFileError(path, "model", f"{module_name!r} has no {attr!r}; its callables: {names}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise JobFileError(path, "model", f"{spec!r} is a {type(obj).__name__}, not a callable returning a model")
    return obj


def _release(path: Path, spec: dict | None, fit: dict[str, Any]) -> ReleaseRule | None:
    if spec is None:
        return None
    from ..engine.policy import lower_is_better
    from ..options import METRICS

    # Only the names here: which metrics the run computes by default (accuracy for a classifier, mae
    # otherwise) depends on the labels, so preflight checks the metric again against the run's own.
    metric = spec["metric"]
    named = fit.get("metrics")
    named = [named] if isinstance(named, str) else named
    known = {"loss", *(named if isinstance(named, (list, dict)) else METRICS)}
    if metric not in known:
        where = "fit.metrics" if named is not None else "the metrics vcdask computes"
        raise JobFileError(path, "release.metric", f"unknown metric {metric!r}; valid ({where}): {sorted(known)}")
    return ReleaseRule(
        metric=metric,
        mode=spec.get("mode") or ("min" if lower_is_better(metric) else "max"),
        tag_prefix=spec.get("tag_prefix", "release-"),
        min_delta=float(spec.get("min_delta", 0.0)),
    )


def yaml_number_hint(options: Any, where: str, message: str) -> str:
    """What to add to ``message``, a refusal of ``options``, when it refuses a number that YAML read as text:
    PyYAML (YAML 1.1) reads ``1e-3`` and ``1.0e3`` as strings (its floats need a dot and a signed exponent).

    Returns
    -------
    str
        ``"; YAML reads 1e-3 (fit.lr) as text: write 1.0e-3 or 0.001"``, or ``""`` when the refusal names no
        such text among ``options`` (nested mappings and lists included; ``where`` is their field).
    """
    items = options.items() if isinstance(options, dict) else enumerate(options) if isinstance(options, list) else ()
    for name, value in items:
        if isinstance(value, (dict, list)):
            hint = yaml_number_hint(value, f"{where}.{name}", message)
        else:
            hint = _number_text_hint(value, f"{where}.{name}") if isinstance(value, str) and value in message else ""
        if hint:
            return hint
    return ""


def _number_text_hint(value: Any, field: str) -> str:
    """``"; YAML reads 1e-3 (field) as text: ..."`` when ``value`` is a number in exponent form that YAML left
    as text, else ``""``."""
    import decimal

    if not isinstance(value, str) or "e" not in value.lower():
        return ""
    try:
        number = decimal.Decimal(value.strip())
    except decimal.InvalidOperation:
        return ""
    if not number.is_finite():
        return ""
    mantissa, _, exponent = value.strip().lower().partition("e")
    mantissa = mantissa if "." in mantissa else f"{mantissa}.0"
    exponent = exponent if exponent[:1] in ("+", "-") else f"+{exponent}"
    return f"; YAML reads {value} ({field}) as text: write {mantissa}e{exponent} or {number:f}"


def _fit_options(path: Path, options: dict[str, Any]) -> dict[str, Any]:
    from .. import api

    params = inspect.signature(api.fit).parameters
    valid = sorted(
        n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in JOB_FIELDS and n not in NOT_IN_A_JOB
    )
    out = {}
    for name, value in options.items():
        if name in JOB_FIELDS:
            raise JobFileError(path, f"fit.{name}", f"set by the job file's {JOB_FIELDS[name]} field, not under fit")
        if name in NOT_IN_A_JOB:
            raise JobFileError(path, f"fit.{name}", f"not an option of a job: {NOT_IN_A_JOB[name]}")
        if name not in valid:
            raise JobFileError(path, f"fit.{name}", f"unknown option; valid: {', '.join(valid)}")
        if name in OPTION_GROUPS and isinstance(value, dict):
            import vcdask

            group = getattr(vcdask, OPTION_GROUPS[name])
            try:
                value = group(**value)
            except (TypeError, ValueError) as e:
                hint = yaml_number_hint(value, f"fit.{name}", str(e))
                raise JobFileError(path, f"fit.{name}", f"{e}{hint}") from None
        out[name] = value
    return out
