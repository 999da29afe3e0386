"""vcdask.load: any stored version back into a model, by id, tag or branch; FitResult's notebook views."""

from __future__ import annotations

import pytest
import torch

import vcdask
from vcdask.demo import digits_cnn
from vcdask.errors import ParameterMismatchError, VersionNotFoundError


@pytest.fixture(scope="module")
def run(cluster, digits_data, tmp_path_factory):
    (X, y), _ = digits_data
    store = tmp_path_factory.mktemp("load") / "store"
    result = vcdask.fit(
        digits_cnn(3),
        (X[:400], y[:400]),
        validation=0.2,
        max_epochs=2,
        n_shards=4,
        local_epochs=1,
        alpha=0.5,
        client=cluster[1],
        store=store,
        progress=False,
    )
    return result, store


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sb = b.state_dict()
    return all(torch.equal(t, sb[k]) for k, t in a.state_dict().items())


def test_load_by_version_tag_and_branch(run):
    result, store = run
    final = vcdask.load(result.store, version=result.version)
    assert _same(final, result.model) and not final.training
    assert final.vcdask_version["id"] == result.version and final.vcdask_version["run_id"] == result.run_id
    first = result.store.versions(result.run_id)[-2]  # the first merge (the last entry is the initial weights)
    result.store.tag("first-merge", first.id)
    early = vcdask.load(str(store), tag="first-merge")  # a location: opened read-only
    assert early.vcdask_version["id"] == first.id and not _same(early, final)
    newest = vcdask.load(str(store), branch=result.run_id)
    assert _same(newest, final)


def test_load_into_a_given_model(run):
    result, _ = run
    model = digits_cnn(99)
    assert vcdask.load(result.store, model, version=result.version) is model
    assert _same(model, result.model)
    with pytest.raises(ParameterMismatchError, match="missing|unexpected|shape"):
        vcdask.load(result.store, torch.nn.Linear(3, 2), version=result.version)


def test_load_errors_name_what_exists(run, tmp_path):
    result, store = run
    with pytest.raises(VersionNotFoundError, match="first-merge|tags"):
        vcdask.load(result.store, tag="no-such-tag")
    with pytest.raises(TypeError, match="storage options"):
        vcdask.load(result.store, version=result.version, endpoint_url="http://x")
    plain = vcdask.open_store(tmp_path / "plain")
    v = plain.commit(vcdask.flatten(torch.nn.Linear(2, 2)), {"note": "not from a run"})
    with pytest.raises(ValueError, match="pass model="):
        vcdask.load(plain, version=v)


def test_fit_result_html_and_plot(run):
    result, _ = run
    html = result._repr_html_()
    assert result.run_id in html and result.version in html and "accuracy" in html and "merges" in html
    layout = result.plot(show=False)
    from bokeh.models import ColumnDataSource, GlyphRenderer

    sources = {id(r.data_source): r.data_source for r in layout.select({"type": GlyphRenderer})}
    assert sources and all(isinstance(s, ColumnDataSource) and len(s.data["epoch"]) == 2 for s in sources.values())


def test_plot_in_a_script_opens_a_page(run, monkeypatch, capsys):
    """Outside a kernel ``plot()`` shows the plot as bokeh.io.show does (it returned it without a word)."""
    import webbrowser
    from pathlib import Path

    result, _ = run
    opened = []
    monkeypatch.setattr(webbrowser, "open", opened.append)  # (no browser here: record what would open)
    assert result.plot() is None
    path = Path(opened[0].removeprefix("file://"))
    assert str(path) in capsys.readouterr().err
    page = path.read_text()
    assert f"vcdask run {result.run_id}" in page and "Bokeh" in page
    path.unlink()


def test_a_spec_written_before_the_modules_moved_still_loads(tmp_path):
    """Specs pickle vcdask's classes and functions by reference: one written when they lived in vcdask.task,
    vcdask.rules and vcdask.api loads into today's classes, and vcdask.load finds its model."""
    import functools

    import cloudpickle

    from vcdask.data import Shards
    from vcdask.merge import Nesterov
    from vcdask.options import accuracy
    from vcdask.spec import RunSpec, load_spec

    store = vcdask.open_store(tmp_path / "s")
    model = digits_cnn(3)
    store.create_branch("run-old")
    version = store.commit(model, {"run_id": "run-old", "step": 0}, branch="run-old")
    spec = RunSpec(
        run_id="run-old",
        store=store,
        branch="run-old",
        model=model,
        loss=torch.nn.functional.mse_loss,
        optimizer=functools.partial(torch.optim.Adam, lr=1e-3),
        local_epochs=1,
        batch_size=8,
        seed=0,
        train=None,
        shards=Shards(10, 2),
        validation=None,
        metrics={"accuracy": accuracy},
        classification=True,
        x_dtype=torch.float32,
        max_epochs=1,
        merge=Nesterov(delay=4),
        target=None,
        commit_every=1,
        validate_every=1,
    )
    data = cloudpickle.dumps(spec, protocol=2)  # protocol 2 names globals as text: "module\nname\n"
    old = data.replace(b"vcdask.spec\nRunSpec", b"vcdask.task\nRunSpec")
    old = old.replace(b"vcdask.merge.nesterov\nNesterov", b"vcdask.rules\nNesterov")
    old = old.replace(b"vcdask.options\naccuracy", b"vcdask.api\naccuracy")
    assert old.count(b"vcdask.task\n") == old.count(b"vcdask.rules\n") == old.count(b"vcdask.api\n") == 1
    store.files.put("run-old/spec.pkl", old)

    loaded = load_spec(store, "run-old")
    assert type(loaded) is RunSpec and loaded.merge == Nesterov(delay=4) and loaded.metrics["accuracy"] is accuracy
    restored = vcdask.load(store, version=version)  # no model given: the spec's model
    assert restored.vcdask_version["id"] == version
    assert all(
        torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_load_without_a_version_names_the_run_branches(tmp_path):
    """Runs never write ``main``: loading its newest version says so and names the runs' branches, newest first."""
    store = vcdask.open_store(tmp_path / "store")
    with pytest.raises(VersionNotFoundError, match="nothing was committed to this store"):
        vcdask.load(store, torch.nn.Linear(2, 2))
    for run in ("run-older", "run-newer"):
        store.create_branch(run)
        store.commit(torch.nn.Linear(2, 2), branch=run)
    with pytest.raises(VersionNotFoundError) as info:
        vcdask.load(store, torch.nn.Linear(2, 2))
    message = str(info.value)
    assert "branch 'main'" in message and "run-newer, run-older" in message
    assert "branch='run-newer'" in message
    assert vcdask.load(store, torch.nn.Linear(2, 2), branch="run-newer").vcdask_version["id"] == store.head("run-newer")
