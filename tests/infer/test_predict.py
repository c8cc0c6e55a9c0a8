"""tpurun predict: every record exactly once, in file order, the same rows on any replica count,
streamed to CSV, .npy or .npz; and the user errors of evaluate, predict and export (exit 2)."""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import yaml
from helpers import write_config
from trained import TEST_RECORDS, in_file_order
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app

runner = CliRunner()


@pytest.fixture
def run(trained_toy_run):
    """The session's trained toy run (read, never written to) and the test set without targets."""
    return trained_toy_run.run_dir, trained_toy_run.unlabeled_glob


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_record_once_in_file_order_on_8_replicas(run, tmp_path):
    run_dir, test_glob = run  # the test set has no targets
    out = tmp_path / "out" / "submission.csv"
    result = tpurun.predict(str(run_dir), test_glob, str(out), id_feature="id")
    assert result["replicas"] == 8 and result["global_batch_size"] == 64
    assert result["rows"] == TEST_RECORDS  # 15 full batches and 43 of a padded 16th
    rows = _rows(out)
    ids, x, _ = in_file_order(test_glob)
    assert [r["id"] for r in rows] == ids
    assert ids[:3] == ["r0", "r3", "r6"]  # file order, not the order the records were written
    model, _spec = tpurun.load(str(run_dir))
    expected = model.predict(x, batch_size=TEST_RECORDS, verbose=0)[:, 0]
    np.testing.assert_allclose([float(r["y"]) for r in rows], expected, rtol=0, atol=1e-6)
    assert list(rows[0]) == ["id", "y"]  # the id column, then the output named by its target


def test_rows_are_the_same_on_one_replica(run, tmp_path):
    run_dir, test_glob = run
    one = tmp_path / "one-replica"
    shutil.copytree(run_dir, one)
    config = yaml.safe_load((one / "config.yaml").read_text())
    config["runtime"]["cpu_devices"] = 1  # a global batch of 8: 125 full batches and 3 records
    write_config(one / "config.yaml", config)
    eight = tpurun.predict(str(run_dir), test_glob, str(tmp_path / "8.csv"), id_feature="id")
    single = tpurun.predict(str(one), test_glob, str(tmp_path / "1.csv"), id_feature="id")
    assert (eight["replicas"], single["replicas"]) == (8, 1)
    assert (tmp_path / "8.csv").read_text() == (tmp_path / "1.csv").read_text()


def test_arrays_and_class_names(run, tmp_path):
    run_dir, test_glob = run
    named = tmp_path / "named"
    shutil.copytree(run_dir, named)
    config = yaml.safe_load((named / "config.yaml").read_text())
    config["derived"]["class_names"] = ["negative", "positive"]  # as a schema file gives them
    write_config(named / "config.yaml", config)
    tpurun.predict(str(named), test_glob, str(tmp_path / "p.csv"), id_feature="id")
    tpurun.predict(str(run_dir), test_glob, str(tmp_path / "p.npz"), id_feature="id")
    tpurun.predict(str(run_dir), test_glob, str(tmp_path / "p.npy"))
    rows = _rows(tmp_path / "p.csv")
    assert list(rows[0]) == ["id", "class", "negative", "positive"]
    with np.load(tmp_path / "p.npz") as saved:
        ids, y = list(saved["id"]), saved["y"]
    assert y.shape == (TEST_RECORDS, 1) and ids == [r["id"] for r in rows]
    np.testing.assert_array_equal(np.load(tmp_path / "p.npy"), y)
    positive = np.array([r["positive"] for r in rows], dtype=np.float32)  # exact: float32 digits
    np.testing.assert_array_equal(positive, y[:, 0])
    assert [r["class"] for r in rows] == ["positive" if p >= 0.5 else "negative" for p in positive]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_cli_predicts_with_the_latest_resume_point_or_a_weights_file(trained_toy_run, tmp_path):
    """--checkpoint latest: the resume point (after one epoch, the best model's weights, so the
    same rows); --checkpoint PATH: that file's weights, the rows Keras predicts with them."""
    run_dir, test_glob = trained_toy_run.run_dir, trained_toy_run.unlabeled_glob
    other = trained_toy_run.altered_weights(tmp_path / "other.weights.h5")

    def predicted(checkpoint: str) -> tuple[dict, np.ndarray]:
        out = tmp_path / f"{checkpoint.replace('/', '_')}.npy"
        result = runner.invoke(app, ["predict", str(run_dir), "--data", test_glob, "--output",
                                     str(out), "--checkpoint", checkpoint, "--json"])  # fmt: skip
        assert result.exit_code == 0, result.output
        return json.loads(result.output), np.load(out)[:, 0]

    _, x, _ = in_file_order(test_glob)
    model, _spec = tpurun.load(str(run_dir))
    best = model.predict(x, batch_size=TEST_RECORDS, verbose=0)[:, 0]
    model.load_weights(str(other))
    altered = model.predict(x, batch_size=TEST_RECORDS, verbose=0)[:, 0]

    shown, rows = predicted("latest")
    assert shown["checkpoint_label"] == "latest (end of epoch 1)" and shown["rows"] == TEST_RECORDS
    np.testing.assert_allclose(rows, best, rtol=0, atol=1e-6)
    shown, rows = predicted(str(other))
    assert shown["checkpoint"] == str(other)
    np.testing.assert_allclose(rows, altered, rtol=0, atol=1e-6)
    assert np.abs(rows - best).max() > 1e-2  # other weights: other predictions


def test_load_gives_the_model_with_the_checkpoint_asked_for(trained_toy_run, tmp_path):
    """tpurun.load(run_dir, checkpoint=...): best (the default), latest, a name in the run's
    checkpoints folder, or a weights file anywhere; the model's weights are that checkpoint's."""
    from tpurun.errors import TpurunError

    run_dir = str(trained_toy_run.run_dir)
    other = trained_toy_run.altered_weights(tmp_path / "other.weights.h5")
    best, spec = tpurun.load(run_dir)
    assert spec["inputs"] == "x" and spec["targets"] == "y" and "x" in spec["features"]

    def kernels(model) -> list[np.ndarray]:
        return [np.asarray(layer.kernel) for layer in model.layers if hasattr(layer, "kernel")]

    for checkpoint in ("latest", "best.keras"):  # one epoch: the same weights as best
        model, _ = tpurun.load(run_dir, checkpoint=checkpoint)
        for got, want in zip(kernels(model), kernels(best), strict=True):
            np.testing.assert_array_equal(got, want)
    altered, _ = tpurun.load(run_dir, checkpoint=str(other))
    *same, last = kernels(altered)
    for got, want in zip(same, kernels(best)[:-1], strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(last, kernels(best)[-1] + 0.5, rtol=0, atol=1e-6)
    with pytest.raises(TpurunError, match="--checkpoint nowhere.keras: no such checkpoint"):
        tpurun.load(run_dir, checkpoint="nowhere.keras")


def test_user_errors_exit_2_with_a_clear_message(run, tmp_path):
    """Missing targets, a wrong feature spec, a missing checkpoint, an unknown format and an
    unwritable output: one paragraph each, exit 2, no traceback."""
    from tpurun.data.write import write_shards

    run_dir, no_targets = run
    wide = tmp_path / "wide"
    wide.mkdir()
    write_shards(str(wide / "wide"), [{"x": np.ones(16, np.float32).tobytes()}] * 5, 1)
    (tmp_path / "a-file").write_text("")
    cases = [
        (["evaluate", str(run_dir), "--data", no_targets],
         "the records hold no target 'y' (data.targets)", "use tpurun predict"),
        (["predict", str(run_dir), "--data", str(wide / "*"), "--output", str(tmp_path / "o.csv")],
         "feature 'x' is declared raw float32 of shape [8], which is 32 bytes", "64 bytes"),
        (["evaluate", str(run_dir), "--checkpoint", "epoch-9.keras"],
         "--checkpoint epoch-9.keras: no such checkpoint", "There: best, latest"),
        (["export", str(run_dir), "--format", "tflite", "--output", str(tmp_path / "m")],
         "--format tflite: expected one of keras, saved_model, onnx", ""),
        (["predict", str(run_dir), "--data", no_targets, "--output",
          str(tmp_path / "a-file" / "out.csv")], "cannot make its folder", "a-file is a file"),
        (["predict", str(run_dir), "--data", no_targets, "--output", str(tmp_path / "o.txt")],
         "o.txt: name a .csv file", "a causal LM's completions: .csv or .jsonl"),
    ]  # fmt: skip
    for args, message, detail in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.output.startswith("error: ") and message in result.output, result.output
        assert detail in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o.csv").exists()


def test_one_process_only(run, tmp_path, monkeypatch):
    """On a host that the environment makes one of several processes (SLURM, a pod slice), the
    commands refuse at once instead of waiting for the others to join."""
    run_dir, test_glob = run
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    result = runner.invoke(app, ["predict", str(run_dir), "--data", test_glob,
                                 "--output", str(tmp_path / "p.csv")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "this process is one of 2 (SLURM (SLURM_NTASKS))" in result.output
