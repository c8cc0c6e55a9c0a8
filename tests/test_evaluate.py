"""tpurun evaluate: every record scored exactly once (the last partial batch included, on 8
replicas), equal to Keras' own evaluate over the full set, written to eval-<name>.json."""

from __future__ import annotations

import json

import numpy as np
import pytest
from trained import TEST_RECORDS, in_file_order, train_toy, write_test_set
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evaluate")
    return train_toy(folder), write_test_set(folder / "test")


def _keras_evaluate(run_dir, x, y) -> dict:
    model, _spec = tpurun.load(str(run_dir))
    model.compile(loss="binary_crossentropy", metrics=["accuracy"])
    return model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)


def test_equals_keras_evaluate_on_the_full_set(run):
    run_dir, test_glob = run
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


def test_cli_scores_the_validation_set_by_default(run):
    run_dir, _ = run
    result = CliRunner().invoke(app, ["evaluate", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["name"] == "validation" and shown["records"] == 128
    assert shown["checkpoint_label"] == "best"
    assert json.loads((run_dir / "eval-validation.json").read_text())["metrics"] == shown["metrics"]
    assert np.isfinite(shown["metrics"]["loss"])
