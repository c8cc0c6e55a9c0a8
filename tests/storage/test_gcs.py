"""Run directories and resume on gs://, against the GCS test server (tests/gcs_server.py), in
real ``tpurun`` subprocesses: a whole run, SIGTERM and a resume with no local state, a kill during a
checkpoint upload, the server going away mid-run, the server down at the start, and the remote run
lock. gcsfs does every file operation; the records are read by the native reader (gcsfs too) and,
where TensorFlow is installed, by the tf_data reader (TF's own GCS client): READERS."""

from __future__ import annotations

import csv
import io
import json
import signal
import time
from pathlib import Path

import pytest
import yaml
from gcs_server import _readers
from helpers import toy_config, write_config, write_toy_data

pytestmark = [pytest.mark.gcs, pytest.mark.slow]
READERS = _readers()

SLOW = {
    "name": str(Path(__file__).resolve().parents[1] / "gcs_server.py") + ":SlowBatches",
    "seconds": 0.04,
}


def setup_run(
    gcs, tmp_path: Path, *, epochs: int = 3, slow: bool = False, reader: str = "native",
    **sections,
) -> Path:  # fmt: skip
    """Toy data in the test's bucket, a config reading it (with ``reader``) and writing runs
    there."""
    data = write_toy_data(tmp_path / "data")
    gcs.upload(data, f"{gcs.bucket}/data")
    config = toy_config(data, tmp_path, train={"epochs": epochs, "steps_per_execution": 1})
    config["data"]["train"] = f"{gcs.bucket}/data/train-*.tfrecord"
    config["data"]["validation"] = f"{gcs.bucket}/data/val-*.tfrecord"
    config["data"]["reader"] = reader
    config["output"]["dir"] = f"{gcs.bucket}/runs"
    config.update(sections)
    if slow:
        config.setdefault("callbacks", {})["extra"] = [SLOW]
    return write_config(tmp_path / "toy.yaml", config)


def fresh_machine(tmp_path: Path, name: str) -> dict:
    """A working folder, record-count cache and temp folder that no earlier run has touched."""
    root = tmp_path / name
    for sub in ("work", "cache", "tmp"):
        (root / sub).mkdir(parents=True)
    return {"cwd": root / "work", "TPURUN_CACHE_DIR": str(root / "cache"),
            "TMPDIR": str(root / "tmp")}  # fmt: skip


def epochs_in_log(gcs, run: str) -> list[str]:
    text = (gcs.get(f"{run}/log.csv") or b"").decode()
    return [row["epoch"] for row in csv.DictReader(io.StringIO(text))]


def latest(gcs, run: str) -> dict:
    return gcs.get_json(f"{run}/checkpoints/latest.json") or {}


def assert_loadable(gcs, run: str) -> dict:
    """The run's resume point names weights that exist in the bucket."""
    state = latest(gcs, run)
    assert state, "no latest.json"
    assert gcs.get(f"{run}/checkpoints/{state['weights']}"), state["weights"]
    return state


@pytest.mark.parametrize("reader", READERS)
def test_train_with_data_and_run_directory_on_gcs(gcs, tmp_path, reader):
    config = setup_run(
        gcs, tmp_path, reader=reader,
        callbacks={"checkpoint": {"filename": "e{epoch}.weights.h5", "keep": 1,
                                  "save_best_only": False}},
    )  # fmt: skip
    machine = fresh_machine(tmp_path, "vm")
    done = gcs.tpurun("train", str(config), **machine)
    assert done.returncode == 0, done.stderr
    assert f"reader: {reader} (" in done.stdout
    run = f"{gcs.bucket}/runs/toy"
    names = {p.removeprefix(run + "/") for p in gcs.list(run + "/")}
    assert {"config.yaml", "log.csv", "summary.json", "model.keras"} <= names
    # The commit point names its weights, the previous one its own; older latest weights and
    # pruned files are gone.
    state = assert_loadable(gcs, run)
    previous = gcs.get_json(f"{run}/checkpoints/previous.json")
    assert (state["epoch"], previous["epoch"]) == (3, 2)
    checkpoints = sorted(n for n in names if n.startswith("checkpoints/") and not n.endswith("/"))
    assert checkpoints == sorted([
        "checkpoints/best.json", "checkpoints/best.keras", "checkpoints/e3.json",
        "checkpoints/e3.weights.h5", f"checkpoints/{state['weights']}", "checkpoints/latest.json",
        f"checkpoints/{previous['weights']}", "checkpoints/previous.json",
    ])  # fmt: skip
    assert "run.lock" not in names  # released at the end
    summary = gcs.get_json(f"{run}/summary.json")
    assert summary["status"] == "completed" and summary["run_dir"] == run
    assert epochs_in_log(gcs, run) == ["0", "1", "2"]
    assert yaml.safe_load(gcs.get(f"{run}/config.yaml"))["output"]["dir"] == f"{gcs.bucket}/runs"
    # Nothing was left on the local disk: no run folder, no staging files.
    assert list(machine["cwd"].iterdir()) == []
    assert list(Path(machine["TMPDIR"]).iterdir()) == []

    # Scored from the bucket: the resume point's weights (copied for Keras, then removed) on the
    # validation set, as the last epoch's validation scored them; the result written beside.
    done = gcs.tpurun("evaluate", run, "--checkpoint", "latest", "--json", **machine)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    last = list(csv.DictReader(io.StringIO(gcs.get(f"{run}/log.csv").decode())))[-1]
    assert shown["metrics"]["loss"] == pytest.approx(float(last["val_loss"]), rel=1e-5)
    assert gcs.get_json(f"{run}/eval-validation.json")["metrics"] == shown["metrics"]
    assert list(Path(machine["TMPDIR"]).iterdir()) == []


@pytest.mark.parametrize("reader", READERS)
def test_sigterm_mid_epoch_then_resume_from_gcs_with_no_local_state(gcs, tmp_path, reader):
    config = setup_run(gcs, tmp_path, epochs=3, slow=True, reader=reader)
    run = f"{gcs.bucket}/runs/toy"
    first = gcs.tpurun("train", str(config), wait=False, **fresh_machine(tmp_path, "vm1"))
    gcs.wait_for(lambda: latest(gcs, run).get("epoch", 0) >= 1, 120, "epoch 1's checkpoint")
    time.sleep(0.3)  # into epoch 2
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 3, err
    state = assert_loadable(gcs, run)
    assert (state["epoch"], state["reason"]) == (1, "SIGTERM") and state["step"] > 0
    assert gcs.get_json(f"{run}/summary.json")["status"] == "interrupted"
    assert gcs.get(f"{run}/run.lock") is None

    # Another machine: nothing local; it resumes from the bucket into a run directory of its own.
    other = f"{gcs.bucket}/other"
    done = gcs.tpurun("train", str(config), "--resume", run, "--output", other,
                      **fresh_machine(tmp_path, "vm2"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"resuming at epoch 2, step {state['step']} from {run}" in done.stdout
    summary = gcs.get_json(f"{other}/toy/summary.json")
    assert summary["status"] == "completed" and summary["epochs_completed"] == 3
    assert summary["resumes"][0]["from"] == f"{run}/checkpoints/latest.json"
    assert epochs_in_log(gcs, f"{other}/toy") == ["0", "1", "2"]  # carried over, each once


def test_a_kill_during_a_checkpoint_upload_keeps_the_previous_resume_point(gcs, tmp_path):
    config = setup_run(gcs, tmp_path, epochs=2)
    run = f"{gcs.bucket}/runs/toy"
    gcs.hold("checkpoints/latest-e0002")  # epoch 2's weights upload waits, mid-request
    proc = gcs.tpurun("train", str(config), wait=False, cwd=tmp_path)
    try:
        gcs.wait_for(lambda: gcs.held() >= 1, 120, "the checkpoint upload")
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        gcs.release()

    state = assert_loadable(gcs, run)
    assert state["epoch"] == 1 and state["weights"].startswith("latest-e0001")
    # The same command on the same machine takes over the dead run's lock and goes on from there.
    done = gcs.tpurun("train", str(config), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resuming at epoch 2" in done.stdout
    assert epochs_in_log(gcs, run) == ["0", "1"]
    assert gcs.get_json(f"{run}/summary.json")["status"] == "completed"


@pytest.mark.parametrize("reader", READERS)
def test_the_server_going_away_mid_run_stops_it_and_the_same_command_resumes(gcs, tmp_path, reader):
    config = setup_run(gcs, tmp_path, epochs=4, slow=True, reader=reader)
    run = f"{gcs.bucket}/runs/toy"
    proc = gcs.tpurun("train", str(config), wait=False, cwd=tmp_path)
    gcs.wait_for(lambda: latest(gcs, run).get("epoch", 0) >= 1, 120, "epoch 1's checkpoint")
    gcs.kill()
    _, err = proc.communicate(timeout=300)  # a hang guard: it ends in seconds with these retries
    assert proc.returncode == 2, err
    assert "Google Cloud Storage did not answer" in err and f"{run}/checkpoints" in err, err
    assert "Traceback" not in err

    gcs.start()
    assert assert_loadable(gcs, run)["epoch"] >= 1
    done = gcs.tpurun("train", str(config), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert epochs_in_log(gcs, run) == ["0", "1", "2", "3"]  # each epoch once


def test_train_fails_within_seconds_when_storage_is_down_at_the_start(gcs, tmp_path):
    config = setup_run(gcs, tmp_path)
    gcs.kill()
    done = gcs.tpurun("train", str(config), cwd=tmp_path, tpurun_defaults=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {gcs.bucket}/data/train-*.tfrecord: Google Cloud ")
    # tpurun's retry settings were in force (4 retries; TF's own 10 would take over 3 minutes):
    # how long that takes is measured in benchmarks/gcs.py.
    assert "gave up after 4 retries" in done.stderr and "Traceback" not in done.stderr


def lock_record(**fields) -> bytes:
    record = {"pid": 4242, "host": "another-host", "since": "2026-01-01T00:00:00+0000",
              "token": "theirs", "heartbeat": time.time(), **fields}  # fmt: skip
    return json.dumps(record).encode()


def test_a_live_remote_lock_refuses_a_second_run(gcs, tmp_path):
    """(A dead holder's lock is taken over: see the kill test above, and test_gcs_lock.py.)"""
    config = setup_run(gcs, tmp_path, epochs=1)
    run = f"{gcs.bucket}/runs/toy"
    gcs.put(f"{run}/run.lock", lock_record())
    refused = gcs.tpurun("train", str(config), cwd=tmp_path)
    assert refused.returncode == 2
    assert f"{run} is in use by another tpurun run (pid 4242 on another-host" in refused.stderr
    assert "last heartbeat was" in refused.stderr and "taken over" in refused.stderr
    assert gcs.get(f"{run}/log.csv") is None  # nothing written
    assert gcs.get_json(f"{run}/run.lock")["token"] == "theirs"
