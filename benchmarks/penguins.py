"""The Palmer penguins table with its text columns: tpurun against scikit-learn on the same rows.

The 333 complete rows of ``penguins.csv`` (the palmerpenguins package's copy, CC0), species
learnt from the four measurements, island and sex. One split (a fifth to validation, drawn by
``tpurun data write --validation-fraction 0.2 --seed SEED``), used by both sides:

- scikit-learn: ``StandardScaler`` on the numbers, ``OneHotEncoder`` on island and sex, then
  ``LogisticRegression``, fitted on the train rows;
- tpurun: ``normalize: true`` on the packed numbers, ``type: category`` (one-hot) on island and
  sex, a softmax Dense layer (a logistic regression), trained with Adam.

Prints both validation accuracies. Needs the bench extra (scikit-learn, palmerpenguins):
``.venv/bin/pip install -e '.[bench]'``, then::

    .venv/bin/python benchmarks/penguins.py [--epochs 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FACTORY = """\
import keras


def build(vocabulary_sizes, classes=3):
    x = keras.Input(shape=(4,), name="x")
    island = keras.Input(shape=(vocabulary_sizes["island"],), name="island")
    sex = keras.Input(shape=(vocabulary_sizes["sex"],), name="sex")
    joined = keras.layers.Concatenate()([x, island, sex])
    return keras.Model({"x": x, "island": island, "sex": sex},
                       keras.layers.Dense(classes, activation="softmax")(joined))
"""
CONFIG = """\
name: penguins
model:
  factory: model.py:build
  loss: sparse_categorical_crossentropy
  metrics: [accuracy]
  optimizer: {{name: adam}}
data:
  train: data/penguins-train-*.tfrecord
  validation: data/penguins-validation-*.tfrecord
  features:
    x: {{normalize: true}}
    island: {{type: category}}
    sex: {{type: category}}
  inputs: {{x: x, island: island, sex: sex}}
  targets: species
train:
  per_core_batch_size: 16
  epochs: {epochs}
  learning_rate: {{base: 0.01}}
callbacks:
  checkpoint: {{monitor: val_loss}}
"""
NUMBERS = ["bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g"]


def complete_rows(folder: Path) -> Path:
    """penguins.csv without its rows of missing values (written "NA"), as a CSV tpurun reads."""
    from importlib.resources import files

    source = files("palmerpenguins").joinpath("data/penguins.csv").read_text()
    rows = list(csv.reader(source.splitlines()))
    kept = [rows[0]] + [row for row in rows[1:] if "NA" not in row]
    path = folder / "penguins.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(kept)
    return path


def scikit_learn(path: Path, is_validation) -> float:
    import numpy as np
    from sklearn.compose import ColumnTransformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    table = {key: np.array([row[key] for row in rows]) for key in rows[0]}
    x = np.column_stack([table[k].astype(float) for k in NUMBERS] + [table["island"],
                                                                     table["sex"]])  # fmt: skip
    y = table["species"]
    columns = ColumnTransformer([("numbers", StandardScaler(), [0, 1, 2, 3]),
                                 ("text", OneHotEncoder(handle_unknown="ignore"), [4, 5])])  # fmt: skip
    model = make_pipeline(columns, LogisticRegression(max_iter=1000))
    model.fit(x[~is_validation], y[~is_validation])
    return float(model.score(x[is_validation], y[is_validation]))


def tpurun_accuracy(folder: Path, epochs: int) -> float:
    (folder / "model.py").write_text(FACTORY)
    (folder / "config.yaml").write_text(CONFIG.format(epochs=epochs))
    tpurun = str(Path(sys.executable).parent / "tpurun")
    subprocess.run([tpurun, "train", "config.yaml", "--restart"], cwd=folder, check=True,
                   capture_output=True)  # fmt: skip
    summary = json.loads((folder / "runs/penguins/summary.json").read_text())
    return float(summary["final_metrics"]["val_accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from tpurun.data.write import split_mask, write_dataset

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = complete_rows(folder)
        report = write_dataset(str(path), str(folder / "data/penguins"), label="species",
                               pack=[f"x={NUMBERS[0]}:{NUMBERS[-1]}"], validation_fraction=0.2,
                               seed=args.seed)  # fmt: skip
        is_validation = split_mask(report.records, 0.2, args.seed)
        print(f"{report.records} rows, {int(is_validation.sum())} to validation (seed {args.seed})")
        print(f"scikit-learn one-hot + LogisticRegression  {scikit_learn(path, is_validation):.4f}")
        print(f"tpurun category + normalize, {args.epochs} epochs     "
              f"{tpurun_accuracy(folder, args.epochs):.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
