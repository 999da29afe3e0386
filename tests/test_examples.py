"""examples/*.py run as subprocesses, as a scheduled job would run them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import vcdask

EXAMPLES = Path(__file__).parents[1] / "examples"
pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def _run(script: str, *args: str, cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_retrain_from_tag_twice(tmp_path):
    store = str(tmp_path / "store")
    first = _run("retrain_from_tag.py", "--store", store, "--epochs", "4", cwd=tmp_path)
    assert "no release yet" in first
    second = _run("retrain_from_tag.py", "--store", store, "--epochs", "2", "--seed", "1", cwd=tmp_path)
    v1 = re.search(r"tagged release-1 = version (\w+)", first).group(1)
    assert f"starting from release-1 (version {v1})" in second
    tags = vcdask.open_store(store, mode="r").tags()
    assert tags["release-1"] == v1
    assert set(tags) == {"release-1", "release-2"}
    before, after = map(float, re.search(r"test accuracy ([0-9.]+) -> ([0-9.]+)", second).groups())
    assert before > 0.5  # it really started from the released model (a fresh one scores ~0.1)
    assert after > 0.8


def _job(script: str, *args: str, cwd: Path, expect: int = 0) -> str:
    """Run a job script; check its exit code; return its output (stdout and the log on stderr)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == expect, f"exit code {proc.returncode}, expected {expect}:\n{output}"
    return output


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A store holding one release, nightly-1, made by the nightly job from a fresh model."""
    cwd = tmp_path_factory.mktemp("nightly")
    store = cwd / "store"
    out = _job("nightly_retrain.py", "--store", str(store), "--epochs", "4", cwd=cwd)
    assert "no release tagged nightly-<N> yet" in out
    v1 = re.search(r"released nightly-1 = version (\w+)", out).group(1)
    return store, v1


def test_nightly_retrain_releases_only_when_better(released, tmp_path):
    store, v1 = released
    # a gate that any candidate passes: the job starts from nightly-1 and releases nightly-2
    out = _job(
        "nightly_retrain.py", "--store", str(store), "--epochs", "2", "--seed", "1", "--min-gain", "-1", cwd=tmp_path
    )
    baseline = float(re.search(rf"release nightly-1 \(version {v1}\): holdout accuracy ([0-9.]+)", out).group(1))
    assert baseline > 0.5  # the released model, not a fresh one (~0.1)
    v2 = re.search(r"released nightly-2 = version (\w+)", out).group(1)
    assert vcdask.open_store(store, mode="r").tags() == {"nightly-1": v1, "nightly-2": v2}

    # a gate no candidate can pass: exit 3, nightly-2 stays the newest release, the candidate stays on its branch
    out = _job(
        "nightly_retrain.py",
        "--store",
        str(store),
        "--epochs",
        "1",
        "--seed",
        "2",
        "--min-gain",
        "1",
        cwd=tmp_path,
        expect=3,
    )
    assert f"release nightly-2 (version {v2})" in out
    candidate, run_id = re.search(r"candidate version (\w+) \(run ([\w-]+),", out).groups()
    assert "not released" in out and "nightly-2 stays the newest release" in out
    after = vcdask.open_store(store, mode="r")
    assert after.tags() == {"nightly-1": v1, "nightly-2": v2}
    assert after.head(run_id) == candidate


def test_export_version_both_formats(released, tmp_path):
    import torch

    from vcdask.demo import digits, digits_cnn

    store, v1 = released
    stored = vcdask.load(str(store), tag="nightly-1")
    _, (X_test, _) = digits()
    X_test = torch.from_numpy(X_test)

    _job("export_version.py", "--store", str(store), "--tag", "nightly-1", "--out", "model.pt2", cwd=tmp_path)
    meta = json.loads((tmp_path / "model.pt2.json").read_text())
    assert (meta["version"], meta["tag"], meta["format"]) == (v1, "nightly-1", "export")
    assert meta["sha256"] == hashlib.sha256((tmp_path / "model.pt2").read_bytes()).hexdigest()
    exported = torch.export.load(tmp_path / "model.pt2").module()
    with torch.no_grad():
        expected, got = stored(X_test), exported(X_test)  # batch size 359: the batch dimension is dynamic
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.argmax(1), expected.argmax(1))

    _job(
        "export_version.py",
        "--store",
        str(store),
        "--version",
        v1,
        "--out",
        "weights.pt",
        "--format",
        "state_dict",
        cwd=tmp_path,
    )
    model = digits_cnn(seed=123)
    model.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    assert all(torch.equal(t, stored.state_dict()[name]) for name, t in model.state_dict().items())

    out = _job(
        "export_version.py", "--store", str(store), "--tag", "nightly-99", "--out", "x.pt2", cwd=tmp_path, expect=4
    )
    assert "nightly-99" in out and "nightly-1" in out  # names the missing tag and lists those there are
    assert not (tmp_path / "x.pt2").exists()


#: The char-LM test's seeds (initial weights and data order).  At its size a small GPT sits on the byte-frequency
#: plateau (about 3.0 nats) for a while and then leaves it, when depends on the seed: plain torch's 2-epoch losses
#: for seeds 0-4 were 2.73, 2.99, 2.73, 3.02 and 2.67 (seeds 1 and 3 still on it; seed 1 after 3 epochs too).  A
#: run near that edge compares when each left it, not how well each trains: vcdask at seed 0 left it late in 1 of
#: 27 runs here and in one CI run (1.07x torch).  So three seeds whose torch run has left it, and their median.
CHAR_LM_SEEDS = (0, 2, 4)


def _char_lm(cwd: Path, seeds: tuple[int, ...]) -> tuple[list[tuple[float, float, float]], float, int]:
    """examples/char_lm.py at ``seeds`` (one process, one cluster), each seed's table checked: ``(vcdask's loss,
    torch's, the byte frequencies')`` by seed, the median ratio it printed, and its exit code."""
    proc = subprocess.run(
        # --quick at the notebook's size (64 KiB, 16 shards), 2 epochs instead of its 3
        [sys.executable, str(EXAMPLES / "char_lm.py"), "--quick", "--train-kb", "64", "--val-kb", "16", "--epochs", "2"]
        + ["--shards", "16", "--device", "cpu", "--check", "--store", "store", "--seeds", ",".join(map(str, seeds))],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=cwd,
    )
    print(proc.stdout)  # both losses, in the test's log
    sections = re.split(r"^== seed (\d+)$", proc.stdout, flags=re.M)
    assert [int(s) for s in sections[1::2]] == list(seeds), proc.stdout + proc.stderr
    store = vcdask.open_store(str(cwd / "store"), mode="r")
    runs = []
    for section in sections[2::2]:
        rows = {  # the table: method, tokens, val loss, perplexity, wall (s)
            m.group(1): (int(m.group(2)), float(m.group(3)), float(m.group(4)))
            for m in re.finditer(r"^(\S.*?)\s{2,}(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+\S+$", section, re.M)
        }
        assert set(rows) == {"unigram (byte counts)", "vcdask", "torch, 1 process (cpu)"}, section + proc.stderr
        (tokens, loss, perplexity), (base_tokens, base_loss, _) = rows["vcdask"], rows["torch, 1 process (cpu)"]
        assert tokens == base_tokens > 120_000  # equal tokens: every shard of every epoch was merged
        assert perplexity == pytest.approx(math.exp(loss), rel=1e-3)
        unigram = rows["unigram (byte counts)"][1]
        assert base_loss < unigram - 0.15  # torch used the context, not just byte frequencies (the seeds are chosen so)
        assert re.search(r"run (run-[\w-]+)", section).group(1) in store.branches()
        runs.append((loss, base_loss, unigram))
    printed = re.search(r"at equal tokens, seeds [\d, ]+: ([0-9., ]+); median: ([0-9.]+) ", proc.stdout)
    assert [float(r) for r in printed.group(1).split(", ")] == pytest.approx([a / b for a, b, _ in runs], abs=1e-3)
    return runs, float(printed.group(2)), proc.returncode


@pytest.mark.timeout(1500)
def test_char_lm_within_5_percent_of_single_process_torch(tmp_path):
    """examples/char_lm.py --quick --check: a character-level GPT on the standard library's source, trained with
    vcdask on the embedded cluster, reaches a validation loss within 5% of plain single-process torch trained on
    the same number of tokens from the same initial weights (the median over three seeds); both learn far beyond
    byte frequencies."""
    runs, median, returncode = _char_lm(tmp_path, CHAR_LM_SEEDS)
    ratios = [loss / base_loss for loss, base_loss, _ in runs]
    assert median == pytest.approx(statistics.median(ratios), abs=1e-3)
    # --check: exit 3 exactly when the median is not within 5% of torch's
    assert returncode == (0 if median <= 1.05 else 3)
    assert statistics.median(ratios) <= 1.05, ratios
    # vcdask used the context too (at 64 KiB and 3 epochs: 0.27 nats below byte frequencies, measured)
    assert statistics.median(loss - unigram for loss, _, unigram in runs) < -0.15, runs


def test_char_lm_seed_takes_one_or_several_distinct_integers(capsys, monkeypatch):
    """``--seeds 0,2,4`` (or ``--seed``) trains each seed in turn (their median is what ``--check`` compares); a
    bad list is refused by the argument parser, naming the value."""
    spec = importlib.util.spec_from_file_location("char_lm_example", EXAMPLES / "char_lm.py")
    char_lm = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, char_lm)  # (its dataclasses look their module up there)
    spec.loader.exec_module(char_lm)
    assert char_lm.parse_args([]).seed == (0,)
    assert char_lm.parse_args(["--seeds", "0,2,4"]).seed == char_lm.parse_args(["--seed", "0,2,4"]).seed == (0, 2, 4)
    for bad, said in [("0,x", "expected an integer or integers separated by commas, got '0,x'"), ("1,1", "twice")]:
        with pytest.raises(SystemExit) as exit_:
            char_lm.parse_args(["--seed", bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
