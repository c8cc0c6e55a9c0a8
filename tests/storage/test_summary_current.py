"""summary.json is as current in a resumed session as in a fresh one: each committed epoch
rewrites its epoch count, best value and metrics (`tpurun runs` reads it alone)."""

from __future__ import annotations

import csv
import json
import textwrap

from conftest import toy_config

import tpurun

SPY = textwrap.dedent("""
    import json
    import keras

    class SummarySpy(keras.callbacks.Callback):
        '''At each epoch's start, what summary.json says (the previous epoch is committed).'''

        def __init__(self, summary, out):
            super().__init__()
            self.summary, self.out = summary, out

        def on_epoch_begin(self, epoch, logs=None):
            data = json.load(open(self.summary))
            with open(self.out, "a") as f:
                f.write(json.dumps({"epoch": epoch, "done": data["epochs_completed"],
                                    "best": data["best"], "metrics": data["final_metrics"]}) + "\\n")
""")


def test_a_resumed_session_rewrites_the_summary_every_epoch(toy_data, tmp_path):
    (tmp_path / "spy.py").write_text(SPY)
    run_dir = tmp_path / "runs" / "toy"
    seen = tmp_path / "seen.jsonl"
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 2})
    tpurun.train(config, verbose=False)
    config["train"]["epochs"] = 5  # resume at epoch 3
    config["callbacks"] = {"extra": [{"name": f"{tmp_path / 'spy.py'}:SummarySpy",
                                      "summary": str(run_dir / "summary.json"), "out": str(seen)}]}  # fmt: skip
    final = tpurun.train(config, verbose=False)
    with open(run_dir / "log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    seen_rows = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [s["epoch"] for s in seen_rows] == [2, 3, 4]
    for s in seen_rows:
        done = s["epoch"]
        assert s["done"] == done
        losses = [float(r["val_loss"]) for r in rows[:done]]
        assert s["best"]["monitor"] == "val_loss"
        assert (
            s["best"]["value"] == min(losses)
            and s["best"]["epoch"] == losses.index(min(losses)) + 1
        )
        assert s["metrics"]["val_loss"] == float(rows[done - 1]["val_loss"])
    assert final["epochs_completed"] == 5
