"""Experiment trackers (``observe.trackers``), read back with the trackers' own clients: MLflow's
``MlflowClient`` on a local folder store, W&B's offline run files (its protobuf records). One run
trains 1 epoch, then resumes to 2, with both trackers; the failures (a tracker not installed, a
server down, a store gone mid-run, a required tracker) each train a few steps."""

from __future__ import annotations

import json
import re
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    FACTORIES,
    read_log,
    read_summary,
    signal_at,
    toy_config,
    write_config,
    write_toy_data,
)
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app
from tpurun.errors import Interrupted, TpurunError

CLOSED_PORT = "http://127.0.0.1:9"  # discard: nothing listens there


@pytest.fixture(scope="module")
def tracker_env(tmp_path_factory):
    """MLflow's and W&B's settings for these tests: a folder store, short HTTP retries, W&B's
    config and cache in tmp; W&B's service process stopped at the end."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        mp.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the test's own client
        for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(key, str(home / key.lower()))
        for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_DIR"):
            mp.delenv(key, raising=False)
        yield mp
    import wandb

    wandb.teardown()  # its wandb-core process


def small_config(root: Path, name: str, **sections) -> dict:
    data = root / "data"
    if not data.is_dir():
        write_toy_data(data, n_train=128, n_val=32, shards=2)
    return toy_config(data, root / "runs", name=name, **sections)


def mlflow_run(root: Path, name: str) -> tuple[Path, Any, Any]:
    """An MLflow folder store under ``root``, the validated config that logs to it, and the
    run directory, created: what a TrackerLog is made from, without training."""
    from tpurun.config import Config
    from tpurun.storage.rundir import RunDir

    store = root / "mlruns"
    config = Config.model_validate(small_config(
        root, name, observe={"trackers": ["mlflow"], "mlflow": {"tracking_uri": str(store)}}
    ))  # fmt: skip
    run = RunDir(str(root / "runs" / name))
    run.create()
    return store, config, run


@pytest.fixture(scope="module")
def tracked(tracker_env, tmp_path_factory):
    """A run with MLflow and W&B: 1 epoch, then resumed to 2 (4 steps an epoch)."""
    root = tmp_path_factory.mktemp("tracked")
    observe = {
        "trackers": ["mlflow", "wandb"],
        "mlflow": {"tracking_uri": f"file:{root / 'mlruns'}", "experiment": "toy"},
        "wandb": {"mode": "offline", "project": "toy"},
    }
    config = small_config(root, "tracked", train={"epochs": 1}, observe=observe)
    tpurun.train(config, verbose=False)
    config["train"]["epochs"] = 2
    tpurun.train(config, verbose=False)
    run = root / "runs" / "tracked"
    return run, root / "mlruns", json.loads((run / "trackers.json").read_text())


def mlflow_client(store: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"file:{store}")


def test_mlflow_has_one_run_with_every_epoch_at_its_global_step(tracked):
    run, store, state = tracked
    client = mlflow_client(store)
    experiment = client.get_experiment_by_name("toy")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [state["mlflow"]["run_id"]]  # the resume continued it
    got = runs[0]
    assert (got.info.status, got.info.run_name) == ("FINISHED", "tracked")
    assert got.data.tags["tpurun.run_dir"] == str(run)
    log = read_log(run)
    history = client.get_metric_history(got.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(4, float(log[0]["loss"])),
                                                    (8, float(log[1]["loss"]))]  # fmt: skip
    assert [m.step for m in client.get_metric_history(got.info.run_id, "val_accuracy")] == [4, 8]
    assert [m.value for m in client.get_metric_history(got.info.run_id, "epoch")] == [1.0, 2.0]
    params = got.data.params
    assert params["train.per_core_batch_size"] == "32"
    assert params["derived.steps_per_epoch"] == "4"
    assert params["train.epochs"] == "1"  # MLflow keeps a parameter's first value...
    assert got.data.tags["resumed_with.train.epochs"] == "2"  # ...and the resume's is a tag


POISON = Path(__file__).resolve().parents[1] / "hub" / "test_hub_checkpoints.py"  # PoisonAt


def test_tracker_runs_end_as_the_session_did(tracker_env, tmp_path):
    """A stop (SIGTERM) is no finish: MLflow's run is KILLED, W&B's is marked preempted with
    exit code 3, and the resume continues both to FINISHED (exit code 0). A session that fails
    (a callback raising) or stops on a NaN leaves its runs FAILED (exit code 1), not RUNNING."""
    observe = {"trackers": ["mlflow", "wandb"],
               "mlflow": {"tracking_uri": f"file:{tmp_path / 'mlruns'}", "experiment": "ends"},
               "wandb": {"mode": "offline", "project": "ends"}}  # fmt: skip
    stop = signal_at(tmp_path / "fired", 2, 2)
    config = small_config(
        tmp_path,
        "stopped",
        observe=observe,
        callbacks={"extra": [stop]},
        train={"steps_per_execution": 1},
    )
    with pytest.raises(Interrupted, match="stopped at epoch 2, step 2"):
        tpurun.train(config, verbose=False)
    client = mlflow_client(tmp_path / "mlruns")
    experiment = client.get_experiment_by_name("ends").experiment_id
    (stopped,) = client.search_runs([experiment])
    assert stopped.info.status == "KILLED"
    tpurun.train(config, verbose=False)  # the marker is there: no second signal
    assert [(r.info.run_id, r.info.status) for r in client.search_runs([experiment])] == [
        (stopped.info.run_id, "FINISHED")
    ]
    sessions = sorted((tmp_path / "runs" / "stopped" / "wandb").glob("offline-run-*"))
    assert [wandb_ending(folder) for folder in sessions] == [(True, 3), (False, 0)]

    poison = {"name": f"{POISON}:PoisonAt", "epoch": 2, "step": 1,
              "marker": str(tmp_path / "poisoned"), "variable": "kernel"}  # fmt: skip
    failing = {"exploded": {"name": f"{FACTORIES}:Exploding"}, "poisoned": poison}
    for name, callback in failing.items():
        config = small_config(
            tmp_path,
            name,
            observe=observe,
            callbacks={"extra": [callback]},
            train={"steps_per_execution": 1},
        )
        with pytest.raises((RuntimeError, TpurunError)):
            tpurun.train(config, verbose=False)
        assert (
            read_summary(tmp_path / "runs" / name)["status"]
            == {"exploded": "failed", "poisoned": "nan"}[name]
        )
        (found,) = client.search_runs([experiment], f"attributes.run_name = '{name}'")
        assert found.info.status == "FAILED", name
        (folder,) = (tmp_path / "runs" / name / "wandb").glob("offline-run-*")
        assert wandb_ending(folder) == (False, 1), name


def wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file: W&B's header (``:W&B``, magic, version), then
    LevelDB's log format (32 KiB blocks of chunks: crc32, length, type; 1 full, 2-4 parts)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, out, pending = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def closed_session(folder: Path, timeout: float = 60) -> list:
    """The records of an offline session once W&B has closed its file. Its service keeps the last
    32 KiB block in memory and writes it when it closes the session's stream, which it does on its
    own after ``run.finish`` returns: until then the exit record (the last) is not in the file.
    The wait is bounded (a hang guard, not a measure of speed)."""
    (file,) = folder.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(file)
        if any(record.HasField("exit") for record in records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{file}: no exit record after {timeout} s")
        time.sleep(0.05)


def wandb_session(folder: Path) -> tuple[str, list[tuple[int, dict]], dict]:
    """One offline session's run id, its history ``[(step, {key: value})]`` and its config."""
    run_id, history, config = "", [], {}
    for record in closed_session(folder):
        kind = record.WhichOneof("record_type")
        if kind == "run":  # with the config given to wandb.init
            run_id = record.run.run_id
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}  # fmt: skip
            history.append((record.history.step.num, items))
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return run_id, history, config


def wandb_ending(folder: Path) -> tuple[bool, int]:
    """Whether an offline session marked its run as preempting, and the exit code it ended with."""
    records = closed_session(folder)
    kinds = [record.WhichOneof("record_type") for record in records]
    (code,) = [record.exit.exit_code for record in records if record.HasField("exit")]
    return "preempting" in kinds, code


def test_wandb_offline_files_continue_the_same_run_at_the_global_steps(tracked):
    run, _, state = tracked
    sessions = sorted((run / "wandb").glob("offline-run-*"))
    assert len(sessions) == 2  # a folder a session, both with the run's id: wandb sync joins them
    (id1, history1, config1), (id2, history2, config2) = map(wandb_session, sessions)
    assert id1 == id2 == state["wandb"]["run_id"]
    log = read_log(run)
    assert [(step, items["loss"]) for step, items in history1 + history2] == [
        (4, float(log[0]["loss"])), (8, float(log[1]["loss"]))
    ]  # fmt: skip
    assert history2[0][1]["epoch"] == 2 and "val_accuracy" in history2[0][1]
    assert config1["tpurun.run_dir"] == config2["tpurun.run_dir"] == str(run)
    assert config1["train"]["per_core_batch_size"] == 32
    assert (config1["train"]["epochs"], config2["train"]["epochs"]) == (1, 2)


def test_a_resume_logs_no_step_twice(tracker_env, tmp_path):
    """Epochs a stopped session logged past its checkpoint are not logged again when redone."""
    from tpurun.display.reporter import Reporter
    from tpurun.observe.tracker_log import TrackerLog

    store, config, run = mlflow_run(tmp_path, "again")
    first = TrackerLog(config, run, Reporter(), steps_per_epoch=4)
    first.on_epoch_end(0, {"loss": 0.5})
    first.on_epoch_end(1, {"loss": 0.4})  # logged; then killed before its checkpoint
    again = TrackerLog(config, run, Reporter(), steps_per_epoch=4)  # resumes after epoch 1
    for epoch, loss in ((1, 0.4), (2, 0.3)):
        again.on_epoch_end(epoch, {"loss": loss})
    again.close("completed")
    (only,) = mlflow_client(store).search_runs(["0"])
    history = mlflow_client(store).get_metric_history(only.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(4, 0.5), (8, 0.4), (12, 0.3)]


def tracker_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "observe.trackers:" in line]


def test_a_tracker_down_or_not_installed_is_one_line_and_training_completes(
    tracker_env, tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    observe = {"trackers": ["mlflow", "wandb"], "mlflow": {"tracking_uri": CLOSED_PORT}}
    summary = tpurun.train(small_config(tmp_path, "down", observe=observe), verbose=True)
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
    out = capsys.readouterr()
    lines = tracker_lines(out.out + out.err)
    assert len(lines) == 2, lines
    assert "mlflow could not start (MlflowException: API request to http://127.0.0.1:9" in lines[0]
    assert lines[0].endswith("training goes on without it")
    assert "wandb could not start (cannot import wandb (ModuleNotFoundError:" in lines[1]
    assert "pip install wandb); training goes on without it" in lines[1]
    assert not (tmp_path / "runs" / "down" / "trackers.json").exists()


CALLBACK = '''
import shutil
import keras


class RemoveStore(keras.callbacks.Callback):
    """Removes the MLflow store at the first epoch's end: the tracker is gone mid-run."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            shutil.rmtree(self.folder)
'''


def test_a_tracker_failing_mid_run_is_one_line_and_not_called_again(tracker_env, tmp_path, capsys):
    store = tmp_path / "mlruns"
    (tmp_path / "gone.py").write_text(CALLBACK)
    config = small_config(
        tmp_path, "midway", train={"epochs": 3},
        observe={"trackers": ["mlflow"], "mlflow": {"tracking_uri": str(store)}},
        callbacks={"extra": [{"name": f"{tmp_path / 'gone.py'}:RemoveStore",
                              "folder": str(store)}]},
    )  # fmt: skip
    summary = tpurun.train(config, verbose=True)
    assert summary["status"] == "completed" and summary["epochs_completed"] == 3
    out = capsys.readouterr()
    assert re.search(
        rf"\[tpurun\] mlflow: run [0-9a-f]{{32}} in experiment 0 of {store}\n", out.out
    )
    (line,) = tracker_lines(out.out + out.err)  # one line, not one an epoch
    assert f"mlflow failed logging epoch 1 (Exception: '{store}' does not exist.)" in line
    assert line.endswith("training goes on, without mlflow for the rest of this session")
    assert not store.exists()  # nothing was called again to make it anew


def test_a_required_tracker_that_cannot_start_exits_2_naming_the_fix(tracker_env, tmp_path):
    observe = {"trackers": ["mlflow"], "mlflow": {"tracking_uri": CLOSED_PORT, "required": True}}
    path = write_config(tmp_path / "exp.yaml", small_config(tmp_path, "needed", observe=observe))
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2, result.output
    assert "error: observe.trackers: mlflow could not start: MlflowException: API request" in (
        result.output
    )
    assert "It is required (observe.mlflow.required: true): fix it and run the same command " in (
        result.output.replace("\n", " ")
    )
    assert "set observe.mlflow.required: false to train without it" in result.output
    assert "Traceback" not in result.output


def test_mlflows_default_sqlite_store_without_sqlalchemy_names_the_fix(
    tracker_env, tmp_path, monkeypatch
):
    import importlib.util

    from tpurun.config.observe_config import MlflowConfig
    from tpurun.observe.trackers import MlflowTracker, Unavailable

    if importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("the full mlflow's SQLAlchemy is installed: SQLite stores work")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Unavailable, match=r"^its store is sqlite:///.*mlflow\.db \(SQLite\), "
                       r"which needs the full mlflow package \(pip install mlflow\); or set "
                       r"observe\.mlflow\.tracking_uri to a folder"):  # fmt: skip
        MlflowTracker(MlflowConfig()).start(None, name="x", run_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # no mlflow.db left behind


def test_a_damaged_trackers_file_is_named_and_new_tracker_runs_start(tracker_env, tmp_path):
    from tpurun.display.reporter import Reporter
    from tpurun.observe.tracker_log import STATE, TrackerLog

    store, config, run = mlflow_run(tmp_path, "torn")
    first = TrackerLog(config, run, Reporter(), steps_per_epoch=4)
    first.on_train_begin()
    first.close("completed")
    state = tmp_path / "runs" / "torn" / STATE
    state.write_text(state.read_text()[:10])  # cut short, as by a crash mid-write
    said = []

    class Said(Reporter):
        def message(self, text, level="info"):
            said.append((level, text))

    TrackerLog(config, run, Said(), steps_per_epoch=4).close("completed")
    assert said[0] == ("warn", f"observe.trackers: {state} is not valid JSON (truncated, or "
                       "edited): its tracker runs cannot be continued; new ones start")  # fmt: skip
    assert len(mlflow_client(store).search_runs(["0"])) == 2
