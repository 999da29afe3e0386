"""The documented defaults are the real ones: in the docstrings of the public API, and in the docs' prose.

The options table of the user guide is generated from the docstrings (``docs/conf.py``,
``vcdask._docstrings``), so checking the docstrings checks it too.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import vcdask
import vcdask.cloud
import vcdask.merge
from vcdask._docstrings import _parameters_section, documented_parameters, markdown_table

ROOT = Path(__file__).parent.parent

PUBLIC = {
    "fit": vcdask.fit,
    "resume": vcdask.resume,
    "load": vcdask.load,
    "open_store": vcdask.open_store,
    "attach": vcdask.attach,
    "preempt": vcdask.preempt,
    "Resilience": vcdask.Resilience,
    "Retention": vcdask.Retention,
    "merge.VCASGD": vcdask.merge.VCASGD,
    "merge.Staleness": vcdask.merge.Staleness,
    "merge.Nesterov": vcdask.merge.Nesterov,
    "merge.Sync": vcdask.merge.Sync,
    "cloud.PreemptionWatcher": vcdask.cloud.PreemptionWatcher,
    "cloud.spot_cluster_spec": vcdask.cloud.spot_cluster_spec,
}


def _signature(func):
    target = func.__init__ if inspect.isclass(func) else func
    params = inspect.signature(target).parameters.values()
    return {p.name: p for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_parameter_is_documented(name):
    func = PUBLIC[name]
    missing = set(_signature(func)) - set(documented_parameters(func))
    assert not missing, f"{name}: parameters without a docstring entry: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_documented_defaults_are_the_signature_defaults(name):
    func = PUBLIC[name]
    wrong = {}
    for doc in documented_parameters(func).values():
        if doc.type_default is None or doc.signature_default is inspect.Parameter.empty:
            continue
        if _literal(doc.type_default) != doc.signature_default:
            wrong[doc.name] = (doc.type_default, doc.signature_default)
    assert not wrong, f"{name}: docstring default != signature default (documented, real): {wrong}"


def test_the_parser_reads_what_it_checks():
    """The checks above would pass on a parser that found nothing: make sure it finds the entries."""
    fit = documented_parameters(vcdask.fit)
    assert fit["lr"].type_default == "1e-3" and fit["lr"].signature_default == 1e-3
    assert fit["features"].signature_default is None and fit["label"].signature_default is None
    assert fit["optimizer"].default_sentence.startswith("Default: Adam")
    assert len(_parameters_section(inspect.getdoc(vcdask.fit))) >= 35

    def f(a, b=2, c="x"):
        """Doc.

        Parameters
        ----------
        a : int
        b : int, default 3
        c : str, default "x"
        """

    assert _literal(documented_parameters(f)["b"].type_default) != 2  # a wrong default is seen as wrong


def test_generated_options_table_names_the_real_defaults():
    table = markdown_table(vcdask.fit, skip=("model", "data"))
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip() for line in table.splitlines()[2:]}
    assert set(rows) == set(_signature(vcdask.fit)) - {"model", "data"}
    assert rows["lr"] == "`1e-3`" and rows["optimizer_state"] == '`"auto"`' and rows["max_epochs"] == "`10`"
    assert "DEFAULT_RULE" in rows["merge"]  # docs/conf.py puts repr(DEFAULT_RULE) in its place
    page = (ROOT / "docs/user-guide/how-a-run-works.md").read_text()
    assert "generated/fit-options.md" in page


# prose such as "`commit_every=1` stays the default", "the default `max_staleness="auto"`",
# "`shuffle=True` (the default)", "`optimizer_state="worker"`, now the default"
_CLAIM = re.compile(
    r"`(?P<name>\w+)=(?P<value>[^`]+)`\**\s*(?:\((?:the )?default\)|,? (?:stays|is|now) the default|, the default)"
    r"|the default,? `(?P<name2>\w+)=(?P<value2>[^`]+)`"
)
_PAGES = sorted([*(ROOT / "docs").glob("*.md"), *(ROOT / "docs/user-guide").glob("*.md"), ROOT / "README.md"])


def _claims():
    options = {}
    for func in PUBLIC.values():
        for pname, param in _signature(func).items():
            options.setdefault(pname, set()).add(repr(param.default))
    for page in _PAGES:
        for match in _CLAIM.finditer(page.read_text()):
            name = match["name"] or match["name2"]
            value = match["value"] or match["value2"]
            if name in options:
                yield page.relative_to(ROOT), name, value, options[name]


def test_prose_defaults_are_the_real_ones():
    claims = list(_claims())
    assert len(claims) >= 4  # the pattern finds the claims the pages make
    wrong = [
        f"{page}: `{name}={value}` said to be the default; real: {sorted(real)}"
        for page, name, value, real in claims
        if repr(_literal(value)) not in real
    ]
    assert not wrong, "\n".join(wrong)


def test_prose_check_sees_a_wrong_claim(tmp_path):
    text = 'each task started a fresh optimizer (`optimizer_state="worker"`, now the default), and'
    match = _CLAIM.search(text)
    assert match and match["name"] == "optimizer_state" and _literal(match["value"]) == "worker"
    assert repr(_literal(match["value"])) != repr(inspect.signature(vcdask.fit).parameters["optimizer_state"].default)


def test_getting_started_says_how_many_shards_its_first_run_makes():
    """The first run passes no n_shards: the page quotes what Shards.default makes of the digits' training rows."""
    from vcdask.data import Shards

    page = (ROOT / "docs/getting-started.md").read_text()
    example = re.search(r"result = vcdask\.fit\(model, \(X, y\),(.*)\)", page)
    assert example and "n_shards" not in example[1] and "validation=0.1" in example[1]
    n_train = 1797 - round(1797 * 0.1)  # the digits, 10% held out
    assert re.search(rf"\({n_train}\s+samples\)", page)
    quoted = re.search(r"\((\d+) shards on (\d+) cores, (\d+) on (\d+);", page)
    assert quoted, "the page does not say how many shards the run makes"
    for shards, cores in ((quoted[1], quoted[2]), (quoted[3], quoted[4])):
        assert Shards.default(n_train, int(cores), 32).n_shards == int(shards)  # one worker thread per core
