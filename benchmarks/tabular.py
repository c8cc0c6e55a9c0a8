"""Tabular data: tpurun's CSV recipe, with and without ``normalize: true``, against scikit-learn.

scikit-learn's breast-cancer table (569 rows, 30 numeric columns on very different scales, a 0/1
diagnosis; it ships with scikit-learn, nothing is downloaded) is written to a CSV with an ``id``
column first, as real tables have one (``--pack x`` alone would pack it, and warns). For each seed:

1. ``tpurun data write bc.csv ... --label diagnosis --pack x=FIRST:LAST --validation-fraction 0.2
   --seed S``, as docs/csv.md does;
2. ``tpurun train`` of the same small MLP (the page's factory) twice: ``normalize: true`` on ``x``,
   and without it;
3. scikit-learn's ``StandardScaler`` + ``LogisticRegression`` fitted on exactly the rows tpurun
   wrote to the train split and scored on its validation split (read back from the shards by
   ``id``).

Printed: the three validation accuracies per seed, then their mean and standard deviation over the
seeds. tpurun's figure is the last epoch's ``val_accuracy`` (summary.json), every validation row
scored once; no epoch is picked by its validation score, as none is for the logistic regression.

    .venv/bin/pip install -e '.[bench]'                      # scikit-learn: not in make install
    .venv/bin/python benchmarks/tabular.py                  # 5 seeds, about 3 minutes on 2 cores
    .venv/bin/python benchmarks/tabular.py --seeds 0 1 --epochs 40 --json

Measured on the 2-core machine, seeds 0-4, defaults (Dense(32) MLP, 40 epochs, batch 32, Adam at
1e-3), validation accuracy per seed and mean +- sd (114 validation rows: one row is 0.88 points):

    scikit-learn            0.9912 0.9561 0.9825 1.0000 0.9737   0.9807 +- 0.0169
    tpurun, normalize       0.9737 0.9561 0.9825 1.0000 0.9737   0.9772 +- 0.0159
    tpurun, no normalize    0.6667 0.6140 0.5965 0.5877 0.6316   0.6193 +- 0.0314

Without normalize the MLP predicts the majority class (columns up to 4,254 saturate its softmax);
with it, tpurun is 0.35 points below scikit-learn on average, equal on four seeds of five.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / "_work" / "tabular"
TPURUN = str(Path(sys.executable).parent / "tpurun")

MODEL = """\
import keras


def build(inputs=30, units=32, classes=2):
    x = keras.Input(shape=(inputs,), name="x")
    hidden = keras.layers.Dense(units, activation="relu")(x)
    return keras.Model(x, keras.layers.Dense(classes, activation="softmax")(hidden))
"""


def write_csv(path: Path) -> tuple[str, str]:
    """The breast-cancer table as a CSV: ``id``, 30 feature columns, ``diagnosis`` (0/1). Returns
    the first and last feature column, for ``--pack x=FIRST:LAST``."""
    import numpy as np
    from sklearn.datasets import load_breast_cancer

    table = load_breast_cancer()
    names = [name.replace(" ", "_") for name in table.feature_names]
    ids = np.arange(100001, 100001 + len(table.target))
    header = ",".join(["id", *names, "diagnosis"])
    rows = np.column_stack([ids, table.data, table.target])
    np.savetxt(path, rows, fmt=["%d", *["%.10g"] * len(names), "%d"], delimiter=",",
               header=header, comments="")  # fmt: skip
    return names[0], names[-1]


def tpurun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TPURUN_PLAIN": "1"}
    done = subprocess.run([TPURUN, *args], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"tpurun {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def split_ids(prefix: Path) -> dict[str, list[int]]:
    """The ``id`` of every record of each split tpurun wrote."""
    import tensorflow as tf

    found = {}
    for split in ("train", "validation"):
        files = sorted(str(p) for p in prefix.parent.glob(f"{prefix.name}-{split}-*.tfrecord"))
        spec = {"id": tf.io.FixedLenFeature([], tf.int64)}
        ds = tf.data.TFRecordDataset(files).map(
            lambda r, spec=spec: tf.io.parse_single_example(r, spec)
        )
        found[split] = [int(r["id"]) for r in ds.as_numpy_iterator()]
    return found


def scikit_learn(csv: Path, ids: dict[str, list[int]]) -> float:
    """StandardScaler + LogisticRegression on the train ids, accuracy on the validation ids."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    table = np.loadtxt(csv, delimiter=",", skiprows=1)
    row = {int(i): k for k, i in enumerate(table[:, 0])}
    x, y = table[:, 1:-1], table[:, -1].astype(int)
    train = [row[i] for i in ids["train"]]
    validation = [row[i] for i in ids["validation"]]
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))
    model.fit(x[train], y[train])
    return float(model.score(x[validation], y[validation]))


def config(name: str, data: str, normalize: bool, args: argparse.Namespace) -> str:
    x = {"type": "float", "shape": [30], **({"normalize": True} if normalize else {})}
    return json.dumps({
        "name": name,
        "seed": args.train_seed,
        "model": {"factory": "model.py:build", "loss": "sparse_categorical_crossentropy",
                  "metrics": ["accuracy"]},
        "data": {"train": f"{data}-train-*.tfrecord", "validation": f"{data}-validation-*.tfrecord",
                 "features": {"x": x}, "inputs": "x", "targets": "diagnosis"},
        "train": {"per_core_batch_size": args.batch, "epochs": args.epochs,
                  "learning_rate": {"base": args.lr}},
        "callbacks": {"tensorboard": None},
    }, indent=1)  # fmt: skip


def train(work: Path, name: str, data: str, normalize: bool, args: argparse.Namespace) -> float:
    path = work / f"{name}.yaml"
    path.write_text(config(name, data, normalize, args))  # JSON is YAML
    tpurun("train", str(path), "--restart", cwd=work)
    summary = json.loads((work / "runs" / name / "summary.json").read_text())
    return float(summary["final_metrics"]["val_accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                        help="split seeds (tpurun data write --seed)")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--train-seed", type=int, default=42, help="the config's seed")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    (WORK / "model.py").write_text(MODEL)
    csv = WORK / "bc.csv"
    first, last = write_csv(csv)
    warned = "looks like a row id" in tpurun("data", "write", csv.name, "data/all", "--label",
                                              "diagnosis", "--pack", "x", cwd=WORK).stderr  # fmt: skip
    rows = []
    for seed in args.seeds:
        data = f"data/bc-{seed}"
        tpurun("data", "write", csv.name, data, "--label", "diagnosis", "--pack",
               f"x={first}:{last}", "--validation-fraction", "0.2", "--seed", str(seed), cwd=WORK)  # fmt: skip
        ids = split_ids(WORK / data)
        row = {
            "seed": seed,
            "validation_rows": len(ids["validation"]),
            "scikit_learn": scikit_learn(csv, ids),
            "normalize": train(WORK, f"bc-{seed}-normalize", data, True, args),
            "raw": train(WORK, f"bc-{seed}-raw", data, False, args),
        }
        rows.append(row)
        if not args.json:
            print(f"seed {seed}: scikit-learn {row['scikit_learn']:.4f}  tpurun normalize "
                  f"{row['normalize']:.4f}  tpurun without {row['raw']:.4f}  "
                  f"({row['validation_rows']} validation rows)", flush=True)  # fmt: skip
    summary = {
        key: {"mean": statistics.mean(r[key] for r in rows),
              "stdev": statistics.stdev(r[key] for r in rows) if len(rows) > 1 else 0.0}
        for key in ("scikit_learn", "normalize", "raw")
    }  # fmt: skip
    if args.json:
        print(json.dumps({"seeds": rows, "summary": summary, "pack_x_warns_of_id": warned,
                          "epochs": args.epochs, "batch": args.batch, "lr": args.lr}, indent=2))  # fmt: skip
        return
    print(f"--pack x alone warns of the id column: {'yes' if warned else 'NO'}")
    for key, label in (("scikit_learn", "scikit-learn StandardScaler + LogisticRegression"),
                       ("normalize", "tpurun, normalize: true"), ("raw", "tpurun, no normalize")):  # fmt: skip
        s = summary[key]
        print(f"{label:50s} {s['mean']:.4f} +- {s['stdev']:.4f}")
    gap = summary["scikit_learn"]["mean"] - summary["normalize"]["mean"]
    print(f"scikit-learn - tpurun normalize: {gap * 100:+.2f} points (target: within 1)")


if __name__ == "__main__":
    main()
