"""tpurun evaluate: every record scored exactly once (the last partial batch included, on 8
replicas), equal to Keras' own evaluate over the full set, written to eval-<name>.json; from the
best checkpoint, the latest resume point or a weights file given by path."""

from __future__ import annotations

import json

import numpy as np
import pytest
from trained import TEST_RECORDS, in_file_order
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app


def _keras_evaluate(run_dir, x, y, weights=None) -> dict:
    model, _spec = tpurun.load(str(run_dir))
    if weights is not None:
        model.load_weights(str(weights))
    model.compile(loss="binary_crossentropy", metrics=["accuracy"])
    return model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)


def test_equals_keras_evaluate_on_the_full_set(trained_toy_run, tmp_path):
    run_dir, test_glob = trained_toy_run.copy(tmp_path), trained_toy_run.test_glob
    result = tpurun.evaluate(str(run_dir), test_glob)
    # 1,003 records over a global batch of 64: 15 full batches and 43 records of a 16th.
    assert (result["replicas"], result["global_batch_size"]) == (8, 64)
    assert result["records"] == TEST_RECORDS and result["padding_records"] == 16 * 64 - 1003
    _, x, y = in_file_order(test_glob)
    expected = _keras_evaluate(run_dir, x, y)
    assert result["metrics"]["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert result["metrics"]["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    first_960 = _keras_evaluate(run_dir, x[:960], y[:960])
    assert result["metrics"]["accuracy"] != pytest.approx(first_960["accuracy"], abs=1e-6)
    right = result["metrics"]["accuracy"] * TEST_RECORDS
    assert abs(right - round(right)) < 1e-3  # a count of right answers over all 1,003 records
    written = json.loads((run_dir / "eval-test.json").read_text())
    assert written["metrics"] == result["metrics"] and written["data"] == test_glob


def test_cli_scores_the_validation_set_by_default(trained_toy_run, tmp_path):
    run_dir = trained_toy_run.copy(tmp_path)
    result = CliRunner().invoke(app, ["evaluate", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["name"] == "validation" and shown["records"] == 128
    assert shown["checkpoint_label"] == "best"
    assert json.loads((run_dir / "eval-validation.json").read_text())["metrics"] == shown["metrics"]
    assert np.isfinite(shown["metrics"]["loss"])


def test_cli_scores_the_latest_resume_point_or_a_weights_file(trained_toy_run, tmp_path):
    """--checkpoint latest loads the resume point (a .weights.h5; after one epoch, the best
    model's weights); --checkpoint PATH loads that file: different weights, different scores,
    each equal to Keras' own evaluate with those weights."""
    run_dir, test_glob = trained_toy_run.copy(tmp_path), trained_toy_run.test_glob
    other = trained_toy_run.altered_weights(tmp_path / "other.weights.h5")
    _, x, y = in_file_order(test_glob)

    def scored(checkpoint: str) -> dict:
        result = CliRunner().invoke(app, ["evaluate", str(run_dir), "--data", test_glob,
                                          "--checkpoint", checkpoint, "--json"])  # fmt: skip
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    latest = scored("latest")
    assert latest["checkpoint_label"] == "latest (end of epoch 1)"
    assert latest["checkpoint"].endswith("checkpoints/latest-e0001-s0000000.weights.h5")
    expected = _keras_evaluate(run_dir, x, y)
    assert latest["metrics"]["loss"] == pytest.approx(expected["loss"], rel=1e-5)

    by_path = scored(str(other))
    assert by_path["checkpoint"] == str(other) and by_path["records"] == TEST_RECORDS
    altered = _keras_evaluate(run_dir, x, y, weights=other)
    assert by_path["metrics"]["loss"] == pytest.approx(altered["loss"], rel=1e-5)
    assert by_path["metrics"]["loss"] != pytest.approx(expected["loss"], rel=1e-3)
    # The last run's scores are the ones written.
    assert json.loads((run_dir / "eval-test.json").read_text())["checkpoint"] == str(other)
