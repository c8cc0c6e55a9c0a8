"""A resume never silently loses or changes a run: damaged resume points, and what a mid-epoch
resume is bound to.

A damaged resume point is never read as "no resume point" (issue 26's defect).

Each session keeps the previous complete resume point (``checkpoints/previous.json`` and its
weights) beside the latest. When the latest is damaged (its state file truncated or edited, its
weights missing, cut short or changed, a sharded folder's shard gone), the run resumes from the
previous one and says so in one line, its log cut back to that point; when none is usable, it
exits 2 naming the damaged file and the ways out, and changes nothing on disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import logged_epochs, read_log, read_summary, signal_at, toy_config, write_toy_data

import tpurun
from tpurun.errors import Interrupted, TpurunError
from tpurun.storage.rundir import RunDir
from tpurun.training.checkpoints import integrity, resume


def _config(toy_data, tmp_path, name: str) -> dict:
    return toy_config(toy_data, tmp_path / "runs", name=name,
                      train={"epochs": 3, "steps_per_execution": 2})  # fmt: skip


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder``: its modification time and bytes."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _weights_named_by(state_file: Path) -> Path:
    return state_file.parent / json.loads(state_file.read_text())["weights"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """An unbroken 3-epoch run, and one stopped by SIGTERM at epoch 3, step 4: its latest resume
    point is mid-epoch 3, its previous one the end of epoch 2."""
    root = tmp_path_factory.mktemp("damaged")
    data = write_toy_data(root / "data")
    unbroken = tpurun.train(_config(data, root, "unbroken"), verbose=False)
    stopped = _config(data, root, "stopped")
    stopped["callbacks"] = {"extra": [signal_at(root / "fired", epoch=3, step=4)]}
    with pytest.raises(Interrupted):
        tpurun.train(stopped, verbose=False)
    return root, data, unbroken


@pytest.fixture
def stopped_run(references, tmp_path):
    """A copy of the stopped run, to damage; and the config that continues it."""
    import shutil

    root, data, unbroken = references
    run_dir = tmp_path / "runs" / "stopped"
    shutil.copytree(root / "runs" / "stopped", run_dir)
    config = _config(data, tmp_path, "stopped")
    return run_dir, config, root / "runs" / "unbroken", unbroken


def test_each_checkpoint_keeps_the_previous_resume_point(stopped_run):
    run_dir, _, _, _ = stopped_run
    checkpoints = run_dir / "checkpoints"
    latest = json.loads((checkpoints / "latest.json").read_text())
    previous = json.loads((checkpoints / "previous.json").read_text())
    assert (latest["epoch"], latest["step"]) == (2, 4)
    assert (previous["epoch"], previous["step"]) == (2, 0)
    # Both weights files are kept, and no other resume weights.
    kept = sorted(p.name for p in checkpoints.glob("latest-e*"))
    assert kept == sorted([latest["weights"], previous["weights"]])
    weights = checkpoints / latest["weights"]
    assert latest["check"] == integrity.fingerprint(str(weights))
    assert latest["check"]["bytes"] == weights.stat().st_size


@pytest.mark.parametrize(
    "damage",
    ["truncated_state", "state_not_an_object", "weights_deleted", "weights_truncated",
     "weights_bit_flip", "state_deleted"],
)  # fmt: skip
def test_a_damaged_latest_resumes_from_the_previous_point_and_matches_an_unbroken_run(
    stopped_run, capsys, damage
):
    run_dir, config, unbroken_dir, unbroken = stopped_run
    state = run_dir / "checkpoints" / "latest.json"
    weights = _weights_named_by(state)
    damaged_file = weights if damage.startswith("weights") else state
    {
        "truncated_state": lambda: _truncate(state),
        "state_not_an_object": lambda: state.write_text("[1, 2]"),
        "weights_deleted": weights.unlink,
        "weights_truncated": lambda: _truncate(weights),
        "weights_bit_flip": lambda: _flip_a_byte(weights),
        "state_deleted": state.unlink,
    }[damage]()
    capsys.readouterr()

    resumed = tpurun.train(config)
    out = capsys.readouterr().out
    assert f"damaged: {damaged_file}" in out
    assert "Resuming from the previous resume point" in out
    assert "previous.json, epoch 3)" in out
    assert "the log and TensorBoard are cut back to it" in out
    assert resumed["resumes"][-1]["epoch"] == 2 and resumed["resumes"][-1]["step"] == 0
    assert resumed["resumes"][-1]["from"].endswith("previous.json")
    # Epoch 3 trained again from its start: every row and value the unbroken run's.
    assert read_log(run_dir) == read_log(unbroken_dir)
    assert resumed["final_metrics"] == unbroken["final_metrics"]
    # The next commits replaced the damaged point; the resume points are whole again.
    point = resume.latest(RunDir(str(run_dir)))
    assert point.damaged == [] and point.position == (3, 0)


def test_with_no_usable_resume_point_the_run_exits_2_and_nothing_changes(stopped_run):
    run_dir, config, _, _ = stopped_run
    checkpoints = run_dir / "checkpoints"
    _truncate(checkpoints / "latest.json")
    _weights_named_by(checkpoints / "previous.json").unlink()
    before = _snapshot(run_dir)

    with pytest.raises(resume.DamagedCheckpoint) as info:
        tpurun.train(config, verbose=False)
    message = info.value.message
    assert info.value.exit_code == 2
    assert f"cannot resume {run_dir}: {checkpoints / 'latest.json'}: not valid JSON" in message
    assert "missing (named by previous.json)" in message
    assert "--resume PATH" in message and "--restart" in message and "--output DIR" in message
    assert "nothing was changed" in message
    assert _snapshot(run_dir) == before
    assert read_summary(run_dir)["epochs_completed"] == 2


@pytest.mark.slow
def test_the_cli_says_it_in_one_paragraph_with_exit_2(stopped_run, tmp_path):
    import subprocess

    from helpers import TPURUN, cli_env, write_config

    run_dir, config, _, _ = stopped_run
    (run_dir / "checkpoints" / "previous.json").write_text("{")
    _truncate(run_dir / "checkpoints" / "latest.json")
    path = write_config(tmp_path, config)
    done = subprocess.run([TPURUN, "train", str(path)], capture_output=True, text=True,
                          env=cli_env(), timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: cannot resume {run_dir}:")
    assert f"{run_dir / 'checkpoints' / 'previous.json'}: not valid JSON" in done.stderr
    assert logged_epochs(run_dir) == ["0", "1"]


def test_resume_from_a_damaged_best_json_names_it(stopped_run):
    run_dir, config, _, _ = stopped_run
    best = run_dir / "checkpoints" / "best.json"
    _flip_a_byte(_weights_named_by(best))
    with pytest.raises(resume.DamagedCheckpoint, match=r"best\.keras: its contents changed"):
        tpurun.train({**config, "name": "elsewhere"}, resume=str(best), verbose=False)


@pytest.mark.parametrize("damage", ["truncated", "not_an_object", "binary"])
def test_a_damaged_summary_is_said_copied_and_rebuilt(stopped_run, capsys, damage):
    run_dir, config, unbroken_dir, unbroken = stopped_run
    summary = run_dir / "summary.json"
    original = summary.read_bytes()
    summary.write_bytes({"truncated": original[:40], "not_an_object": b"[]",
                         "binary": b"\xff\xfe\x00garbage"}[damage])  # fmt: skip
    written = summary.read_bytes()
    capsys.readouterr()
    resumed = tpurun.train(config)
    out = capsys.readouterr().out
    wrong = {"truncated": "not valid JSON (truncated, or edited)",
             "not_an_object": "not a JSON object", "binary": "not text (binary garbage)"}[damage]  # fmt: skip
    assert f"{summary} is damaged: {wrong}; it is copied to {summary}.damaged." in out
    assert (run_dir / "summary.json.damaged").read_bytes() == written
    # The new summary is whole, from the checkpoint: the resume is recorded, epochs counted.
    assert read_summary(run_dir)["epochs_completed"] == 3
    assert resumed["resumes"][-1]["epoch"] == 2 and resumed["resumes"][-1]["step"] == 4
    assert read_log(run_dir) == read_log(unbroken_dir)


def test_runs_lists_a_damaged_summary_as_such(stopped_run):
    from tpurun.observe.runs import list_runs

    run_dir, _, _, _ = stopped_run
    (run_dir / "summary.json").write_text("{")
    (row,) = [r for r in list_runs(str(run_dir.parent)) if r["name"] == "stopped"]
    assert row["status"] == "summary damaged"
    assert row["epochs_completed"] == 2  # from the log's rows


@pytest.mark.parametrize(
    ("damage", "good", "wrong"),
    [("cut_mid_row", 1, "row 3 is damaged (1,0.5)"),
     ("garbage_row", 1, "row 3 is damaged (@@@)"),
     ("binary", 0, "not text (binary garbage)"),
     ("no_header", 0, "its first row is not a header starting with 'epoch' (zzz)")],
)  # fmt: skip
def test_a_damaged_log_keeps_its_good_rows_and_a_copy(stopped_run, capsys, damage, good, wrong):
    run_dir, config, unbroken_dir, _ = stopped_run
    log = run_dir / "log.csv"
    lines = log.read_text().splitlines()
    log.write_bytes({
        "cut_mid_row": "\n".join([*lines[:2], "1,0.5"]).encode(),
        "garbage_row": "\n".join([*lines[:2], "@@@"]).encode(),
        "binary": b"\x00\xff\xfe" * 10,
        "no_header": b"zzz\n",
    }[damage])  # fmt: skip
    written = log.read_bytes()
    capsys.readouterr()
    tpurun.train(config)
    out = capsys.readouterr().out
    assert (
        f"{log} is damaged: {wrong}. Its {good} good row(s) are kept and the log goes on from "
        f"them; the whole file is copied to {log}.damaged." in out
    )
    assert (run_dir / "log.csv.damaged").read_bytes() == written
    kept = read_log(unbroken_dir)[:good]
    assert read_log(run_dir)[:good] == kept
    assert [row["epoch"] for row in read_log(run_dir)] == [str(e) for e in range(good)] + ["2"]


def test_evaluate_refuses_a_damaged_best_model_and_names_the_others(stopped_run):
    run_dir, _, _, _ = stopped_run
    best = run_dir / "checkpoints" / "best.keras"
    _flip_a_byte(best)
    with pytest.raises(TpurunError) as info:
        tpurun.evaluate(str(run_dir))
    assert info.value.message == (
        f"--checkpoint best: {best} is damaged: its contents changed since it was written "
        "(CRC32C mismatch). Give another: latest."
    )


# ----------------------------------------------------------- what a mid-epoch resume binds
@pytest.mark.parametrize(
    ("change", "shown"),
    [({"seed": 8}, "seed: 7 -> 8"),
     ({"data": {"shuffle_buffer": 64}}, "data.shuffle_buffer: 256 -> 64"),
     ({"data": {"cache": "memory"}}, "data.cache: False -> True")],
)  # fmt: skip
def test_a_mid_epoch_resume_refuses_a_changed_data_stream(stopped_run, change, shown):
    run_dir, config, _, _ = stopped_run
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    before = _snapshot(run_dir)
    with pytest.raises(TpurunError) as info:
        tpurun.train(config, verbose=False)
    message = info.value.message
    assert info.value.exit_code == 2
    assert f"at epoch 3, step 4: what orders the training records changed ({shown})" in message
    previous = run_dir / "checkpoints" / "previous.json"
    assert f"resume from the end of epoch 2 with --resume {previous}" in message
    assert "Undo the change" in message and "--restart" in message
    assert _snapshot(run_dir) == before

    # The way out it names works: the epoch's end, with the change.
    resumed = tpurun.train(config, resume=str(previous), verbose=False)
    assert resumed["status"] == "completed"
    assert resumed["resumes"][-1] == {**resumed["resumes"][-1], "epoch": 2, "step": 0}


def test_another_reader_mid_epoch_is_refused(stopped_run):
    pytest.importorskip("tensorflow")
    run_dir, config, _, _ = stopped_run
    was = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["identity"]
    other = {"native": "tf_data", "tf_data": "native"}[was["stream.reader"]]
    config["data"] = {**config["data"], "reader": other}
    with pytest.raises(
        TpurunError, match=rf"the reader \(data.reader\): {was['stream.reader']} -> {other}"
    ):
        tpurun.train(config, verbose=False)


def test_more_training_files_mid_epoch_are_refused(stopped_run, tmp_path):
    run_dir, config, _, _ = stopped_run
    extra = tmp_path / "more"
    write_toy_data(extra, n_train=64, n_val=8, shards=1)
    config["data"] = {**config["data"], "train": [config["data"]["train"],
                                                  str(extra / "train-*.tfrecord")]}  # fmt: skip
    with pytest.raises(TpurunError) as info:
        tpurun.train(config, verbose=False)
    message = info.value.message
    assert "the training files (data.train): 4 files, " in message and "-> 5 files, " in message
    assert "the training records: 512 -> 576" in message


def test_at_an_epoch_end_a_changed_seed_is_allowed_and_said(references, tmp_path, capsys):
    import shutil

    root, data, _ = references
    run_dir = tmp_path / "runs" / "unbroken"
    shutil.copytree(root / "runs" / "unbroken", run_dir)
    config = _config(data, tmp_path, "unbroken")
    config["seed"], config["train"] = 8, {**config["train"], "epochs": 4}
    capsys.readouterr()
    resumed = tpurun.train(config)
    assert resumed["epochs_completed"] == 4
    out = capsys.readouterr().out
    assert "changed since the last session:" in out and "seed: 7 -> 8" in out


def test_the_number_of_processes_is_bound_mid_epoch():
    from types import SimpleNamespace

    plan = SimpleNamespace(global_batch_size=64, precision="float32", num_processes=2)
    config = {"seed": 1, "data": {"shuffle_buffer": 10}, "derived": {"train_records": 100}}
    saved = resume.identity(config, plan, ["a", "b"])
    point = resume.ResumePoint({"epoch": 1, "step": 3, "identity": saved}, "w", "latest.json")
    now = resume.identity(config, SimpleNamespace(**{**vars(plan), "num_processes": 1}), ["a", "b"])
    with pytest.raises(TpurunError, match=r"the number of processes sharing the files: 2 -> 1\)"):
        resume.check_unchanged(point, now)
    at_the_end = resume.ResumePoint({**point.state, "step": 0}, "w", "latest.json")
    resume.check_unchanged(at_the_end, now)  # an epoch's end: allowed


# ------------------------------------------------------------------ every kind of checkpoint
def _state(folder: Path, name: str, weights: str, epoch: int) -> None:
    check = integrity.fingerprint(str(folder / weights))
    (folder / name).write_text(json.dumps({"epoch": epoch, "step": 0, "weights": weights,
                                           "check": check}))  # fmt: skip


def _orbax(folder: Path, name: str) -> None:
    """A folder shaped like a sharded checkpoint: items with shard files."""
    for item in ("state/ocdbt.process_0/d/1a2b", "state/_METADATA", "variables/metadata",
                 "_CHECKPOINT_METADATA"):  # fmt: skip
        path = folder / name / item
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(64))


@pytest.mark.parametrize("kind", [".weights.h5", ".adapter.h5", ".orbax"])
def test_every_kind_of_checkpoint_is_checked(tmp_path, kind):
    """Weights files, LoRA adapter files and sharded folders: a damaged latest falls back to the
    previous; both damaged exit 2 naming both."""
    run = RunDir(str(tmp_path / "run"))
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    names = [f"latest-e000{e}-s0000000{kind}" for e in (1, 2)]
    for name in names:
        if kind == ".orbax":
            _orbax(folder, name)
        else:
            (folder / name).write_bytes(os.urandom(4096))
    _state(folder, "previous.json", names[0], 1)
    _state(folder, "latest.json", names[1], 2)
    assert resume.latest(run).position == (2, 0)

    if kind == ".orbax":  # a shard gone from the newer folder
        (folder / names[1] / "state" / "ocdbt.process_0" / "d" / "1a2b").unlink()
        wrong = "incomplete: state/ocdbt.process_0/d/1a2b missing"
    else:
        _truncate(folder / names[1])
        wrong = "2,048 bytes, 4,096 when written"
    point = resume.latest(run)
    assert point.position == (1, 0)
    assert point.damaged == [f"{folder / names[1]}: {wrong} (named by latest.json)"]

    if kind == ".orbax":
        (folder / names[0] / "_CHECKPOINT_METADATA").write_bytes(b"")
    else:
        _flip_a_byte(folder / names[0])
    with pytest.raises(resume.DamagedCheckpoint) as info:
        resume.latest(run)
    assert str(folder / names[1]) in info.value.message
    assert str(folder / names[0]) in info.value.message


def test_a_run_that_never_saved_has_no_resume_point(tmp_path):
    assert resume.latest(RunDir(str(tmp_path / "never"))) is None
