"""The benchmarks' and examples' command lines: bad arguments are refused before any work, and the pure helpers
behind three fixed crashes (a strategy's rule spec, the epochs paper_alpha's table shows, a release tag's prefix).

The refusals run each script as ``python benchmarks/X.py`` runs it (``runpy`` with ``sys.argv`` set, in this
process, so the heavy imports are paid once), with ``vcdask.fit``, the embedded cluster and the S3 server
replaced by a stub that fails the test: a refusal must come before any of them.  Two run in real subprocesses.
"""

from __future__ import annotations

import functools
import importlib.util
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS, EXAMPLES = ROOT / "benchmarks", ROOT / "examples"


@pytest.fixture
def isolated(monkeypatch):
    """sys.path and sys.modules as they were after the test (the scripts import their siblings by name), and the
    entry points of real work replaced by a stub that fails."""
    import vcdask
    import vcdask.cluster
    import vcdask.testing.s3

    def stub(real):
        @functools.wraps(real)  # (the same signature: defaults.py reads fit's to check --set)
        def started(*args, **kwargs):
            raise AssertionError(f"the script called {real.__name__} before refusing its arguments")

        return started

    monkeypatch.setattr(vcdask, "fit", stub(vcdask.fit))
    monkeypatch.setattr(vcdask.cluster, "embedded_cluster", stub(vcdask.cluster.embedded_cluster))
    monkeypatch.setattr(vcdask.testing.s3, "moto_server", stub(vcdask.testing.s3.moto_server))
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if str(getattr(sys.modules[name], "__file__", "") or "").startswith((str(BENCHMARKS), str(EXAMPLES))):
            del sys.modules[name]


def _refused(script: Path, args: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 2
    return capsys.readouterr().err


# (script, arguments, what the message must name: the bad value and at least one valid choice)
REFUSALS = [
    ("strategies.py", ["--rules", "vc-asgd:0.5,bogus"], ["'bogus'", "nesterov"]),
    ("strategies.py", ["--rules", "nesterov:0.7/0.9/0"], ["nesterov:0.7/0.9/0", "delay"]),
    ("strategies.py", ["--baselines", "torch,bogus"], ["'bogus'", "'ddp'"]),
    ("spot_cost.py", ["--rates", "0,x"], ["--rates", "'x'", "a number >= 0"]),
    ("compression.py", ["--codecs", "none,bogus"], ["'bogus'", "'int8'"]),
    ("compression.py", ["--speed", "--codecs", "none,bogus", "--params", "1000"], ["'bogus'", "'fp16'"]),
    ("paper_alpha.py", ["--epochs", "0"], ["--epochs", ">= 1"]),
    ("defaults.py", ["--tasks", "digits,bogus"], ["'bogus'", "'tabular'"]),
    ("defaults.py", ["--set", "bogus=1"], ["'bogus'", "'merge'"]),
    ("inner_state.py", ["--tasks", "bogus"], ["'bogus'", "'lm'"]),
    ("devices.py", ["--tasks", "bogus"], ["'bogus'", "'wide'"]),
    ("devices.py", ["--setups", "bogus"], ["'bogus'", "'mixed'"]),
    ("devices.py", ["--precisions", "bf16-mixed,fp8"], ["'fp8'", "'16-mixed'"]),
    ("time_to_accuracy.py", ["--repeat", "0"], ["--repeat", ">= 1"]),
    ("finite_checks.py", ["--sizes", "x"], ["--sizes", "'x'", "integer"]),
    ("merge_bound.py", ["--fold", "bogus"], ["--fold", "'bogus'", "on, off"]),
    ("merge_bound.py", ["--epochs", "1"], ["--epochs", ">= 2"]),
    ("warm_memory.py", ["--gib", "-1"], ["--gib", "-1"]),
    ("store_io.py", ["--params", "0"], ["--params", ">= 1"]),
    ("many_runs.py", ["--runs", "10,0"], ["--runs", "'0'", ">= 1"]),
    ("merge_path.py", ["--stores", "bogus"], ["'bogus'", "'s3'"]),
    ("checksums.py", ["--stores", "bogus"], ["'bogus'", "'local'"]),
    ("heterogeneous.py", ["--peers", "torch,dpp"], ["'dpp'", "'ddp'"]),
    ("aggregator.py", ["--rules", "bogus"], ["'bogus'", "'vc-asgd'"]),
    ("storage.py", ["--rules", "bogus"], ["'bogus'", "'nesterov'"]),
    ("fleet_sim.py", ["--rules", "bogus"], ["'bogus'", "staleness:ALPHA/A"]),
]


@pytest.mark.parametrize(("script", "args", "named"), REFUSALS, ids=[f"{s} {' '.join(a)}" for s, a, _ in REFUSALS])
def test_a_benchmark_refuses_a_bad_argument_before_any_work(isolated, monkeypatch, capsys, script, args, named):
    err = _refused(BENCHMARKS / script, args, monkeypatch, capsys)
    assert f"{script}: error:" in err
    for text in named:
        assert text in err, err


@pytest.mark.parametrize(
    ("args", "named"),
    [(["--merge", "bogus"], ["'bogus'", "'vc-asgd'"]), (["--device", "tpu"], ["'tpu'", "'cuda'"])],
    ids=["merge", "device"],
)
def test_char_lm_refuses_a_bad_merge_rule_or_device(isolated, monkeypatch, capsys, args, named):
    err = _refused(EXAMPLES / "char_lm.py", args, monkeypatch, capsys)
    for text in named:
        assert text in err, err


def test_the_refusals_exit_2_from_a_real_command_line(tmp_path):
    commands = {
        "strategies.py": ["--rules", "bogus"],
        "heterogeneous.py": ["--peers", "bogus"],
    }
    procs = {
        script: subprocess.Popen(
            [sys.executable, str(BENCHMARKS / script), *args],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script, args in commands.items()
    }
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, out + err
        assert f"{script}: error:" in err and "'bogus'" in err, err
        assert out == ""


def _load(path: Path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    spec = importlib.util.spec_from_file_location(f"_under_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_nesterov_spec_fills_each_part_it_leaves_out_with_that_parts_default(isolated, monkeypatch):
    strategies = _load(BENCHMARKS / "strategies.py", monkeypatch)
    Nesterov = strategies.Nesterov
    assert strategies.rule_from("nesterov:0.7/0.9") == Nesterov(lr=0.7, momentum=0.9, delay=1)
    assert strategies.rule_from("nesterov:0.7/0.9/4") == Nesterov(lr=0.7, momentum=0.9, delay=4)
    assert strategies.rule_from("nesterov:0.5") == Nesterov(lr=0.5, momentum=0.9, delay=1)
    assert strategies.rule_from("nesterov") == Nesterov(lr=0.7, momentum=0.9, delay=1)
    assert strategies.rule_from("default") is None
    assert strategies.rule_from("sync") == "sync"
    assert strategies.rule_from("vc-asgd:epoch").alpha == "epoch"
    assert strategies.rule_from("staleness:0.25").alpha == 0.25
    for bad in ("nesterov:1/0.9/2/3", "nesterov:0.7/x", "bogus", "sync:2", "vc-asgd:1.5"):
        with pytest.raises(ValueError, match=bad.split(":")[0]):
            strategies.rule_from(bad)


def test_every_default_strategy_spec_parses(isolated, monkeypatch):
    strategies = _load(BENCHMARKS / "strategies.py", monkeypatch)
    source = (BENCHMARKS / "strategies.py").read_text()
    default = "default,vc-asgd:0.5,vc-asgd:epoch,staleness:0.5,nesterov:0.7/0.9/4,sync"
    assert f'default="{default}"' in source and f"[--rules {default}]" in source  # the docstring's usage line
    rules = [strategies.rule_from(spec) for spec in default.split(",")]
    assert rules[0] is None and rules[4].delay == 4 and rules[5] == "sync"


def test_paper_alpha_shows_only_the_epochs_a_run_reaches(isolated, monkeypatch):
    marks_for = _load(BENCHMARKS / "paper_alpha.py", monkeypatch).marks_for
    assert marks_for(1) == [1]
    assert marks_for(2) == [1, 2]
    assert marks_for(4) == [1, 2, 3, 4]
    assert marks_for(5) == [1, 2, 3, 5]
    assert marks_for(20) == [1, 2, 3, 5, 10, 20]


def test_paper_alpha_writes_the_docs_figure_wherever_it_runs_from(isolated, monkeypatch):
    paper_alpha = _load(BENCHMARKS / "paper_alpha.py", monkeypatch)
    assert paper_alpha.DEFAULT_PNG == ROOT / "docs" / "_static" / "paper_alpha.png"


class _Tags:
    def __init__(self, tags: dict[str, str]):
        self._tags = tags

    def tags(self) -> dict[str, str]:
        return dict(self._tags)


def test_a_release_tag_prefix_is_matched_as_text_not_as_a_pattern(isolated, monkeypatch):
    latest_release = _load(EXAMPLES / "retrain_from_tag.py", monkeypatch).latest_release
    store = _Tags({"v1.0-3": "a", "v1x0-9": "b", "v1.0-10": "c", "release-5": "d", "v1.0-": "e"})
    assert latest_release(store, "v1.0-") == (10, "c")  # not v1x0-9: "." is a dot
    assert latest_release(_Tags({"rel+4": "a", "relll7": "b"}), "rel+") == (4, "a")
    assert latest_release(_Tags({"nightly(2": "a"}), "nightly(") == (2, "a")  # a pattern would not compile
    assert latest_release(store, "missing-") == (0, None)
