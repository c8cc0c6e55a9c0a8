"""Resume: exact mid-epoch continuation, callback state, changed configs, --resume, NaN restore.

In-process runs use Keras on JAX with one CPU device (toy_config's default), where a resumed run
is bit-for-bit the run that was never stopped: the input stream is a function of the seed and the
position, and the checkpoint carries the weights, optimizer state, metric sums and callback state.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import keras
import pytest
from helpers import (
    FACTORIES,
    assert_same_log,
    assert_same_model,
    logged_epochs,
    read_latest,
    read_log,
    read_summary,
    run_cli,
    signal_at,
    toy_config,
    write_config,
    write_toy_data,
)

import tpurun
from tpurun.errors import Interrupted, ModelError, TpurunError


def config_for(toy_data, tmp_path, name, **train) -> dict:
    train = {"epochs": 3, "steps_per_execution": 2, **train}
    return toy_config(toy_data, tmp_path / "runs", name=name, train=train)


@pytest.mark.slow
@pytest.mark.parametrize(("replicas", "factory"), [(1, "mlp"), (8, "mlp"), (1, "mlp_dropout")])
def test_a_mid_epoch_stop_resumes_at_that_step_and_matches_an_unbroken_run(
    toy_data, tmp_path, replicas, factory
):
    def config_for(toy_data, tmp_path, name):  # a global batch of 32 either way: 16 steps
        config = toy_config(toy_data, tmp_path / "runs", name=name,
                            train={"epochs": 3, "steps_per_execution": 2,
                                   "per_core_batch_size": 32 // replicas},
                            runtime={"cpu_devices": replicas})  # fmt: skip
        config["model"]["factory"] = f"{FACTORIES}:{factory}"  # with dropout: its seed state too
        return config

    unbroken = tpurun.train(config_for(toy_data, tmp_path, "a"), verbose=False)
    assert unbroken["replicas"] == replicas

    config = config_for(toy_data, tmp_path, "b")
    config["callbacks"] = {"extra": [signal_at(tmp_path / "fired", epoch=2, step=4)]}
    # The stop path runs after the user callbacks, so a signal sent after step 4 stops at step 4.
    with pytest.raises(Interrupted, match=r"SIGTERM: stopped at epoch 2, step 4"):
        tpurun.train(config, verbose=False)
    run_dir = tmp_path / "runs" / "b"
    state = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert (state["epoch"], state["step"], state["reason"]) == (1, 4, "SIGTERM")
    # The epoch's running metric sums: the loss's and the accuracy's (total, count) over the 4
    # steps' 128 examples; the accuracy's total is a count of right answers.
    loss_total, loss_count, right, accuracy_count = state["metrics"]
    assert (loss_count, accuracy_count) == (128.0, 128.0) and float(right).is_integer()
    assert logged_epochs(run_dir) == ["0"]

    resumed = tpurun.train(config, verbose=False)
    assert resumed["status"] == "completed" and resumed["epochs_completed"] == 3
    assert resumed["resumes"][-1]["epoch"] == 1 and resumed["resumes"][-1]["step"] == 4
    # Nothing repeated, nothing skipped: every number in every row is the unbroken run's,
    # including the resumed epoch's training metrics.
    assert_same_log(run_dir, tmp_path / "runs" / "a")
    assert resumed["final_metrics"] == unbroken["final_metrics"]
    assert_same_model(run_dir, tmp_path / "runs" / "a")  # the weights and optimizer state, too
    model = keras.saving.load_model(run_dir / "model.keras")
    assert int(model.optimizer.iterations.numpy()) == 3 * 16


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_dropout_run_stopped_mid_epoch_resumes_in_a_fresh_process_bit_for_bit(
    toy_data, tmp_path, how
):
    """Each session in a process of its own, as a preempted machine reruns it: the stop after
    step 6 of epoch 2 saves at that step (SIGTERM), or kills the process with nothing saved
    (SIGKILL: the resume point is the save at step 4). The dropout masks of the rest come from
    the seed state in the checkpoint, so the log and the final weights and optimizer state are the
    unbroken run's, bit for bit."""

    def config(name: str, stop: bool) -> Path:
        config = config_for(toy_data, tmp_path, name)
        config["model"]["factory"] = f"{FACTORIES}:mlp_dropout"
        extra = [signal_at(tmp_path / "fired", epoch=2, step=6, signal=how)] if stop else []
        config["callbacks"] = {"checkpoint": {"every_steps": 4}, "extra": extra}
        return write_config(tmp_path, config, name)

    assert run_cli("train", str(config("a", False))).returncode == 0
    path = config("b", True)
    stopped = run_cli("train", str(path))
    run_dir = tmp_path / "runs" / "b"
    assert stopped.returncode == (3 if how == "SIGTERM" else -signal.SIGKILL), stopped.stderr
    state = read_latest(run_dir)
    at = (1, 6, "SIGTERM") if how == "SIGTERM" else (1, 4, "every_steps")
    assert (state["epoch"], state["step"], state["reason"]) == at
    assert logged_epochs(run_dir) == ["0"]

    resumed = run_cli("train", str(path))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at epoch 2, step {at[1]} from" in resumed.stdout
    (resume,) = read_summary(run_dir)["resumes"]  # one entry per resume: where, from what, when
    assert sorted(resume) == ["epoch", "from", "step", "time"]
    assert (resume["epoch"], resume["step"]) == (1, at[1])
    assert resume["from"] == str(run_dir / "checkpoints" / "latest.json")
    reference = tmp_path / "runs" / "a"
    assert_same_log(run_dir, reference)
    assert_same_model(run_dir, reference)
    assert read_summary(run_dir)["final_metrics"] == read_summary(reference)["final_metrics"]


def test_each_session_reads_its_stream_once_from_its_position_begun_as_the_model_builds(
    toy_data, tmp_path, monkeypatch
):
    """A session's training stream, from its resume position, starts reading before the model is
    built (tpurun.training.fit: its shuffle buffer fills meanwhile), and the fit trains on that
    one reading: Keras' symbolic build takes its batch 0 without the stream being read afresh.
    Stopped mid-epoch and resumed, the two sessions train on the unbroken run's batches."""
    from factories import recorded_batches

    from tpurun.data.native import keras_input
    from tpurun.training import fit

    events: list = []
    start, build = keras_input.KerasBatches._start, fit.build_model

    def started(self, index):
        if self.num_batches is None:  # endless: a training stream (validation sets are finite)
            events.append(("stream", index))
        start(self, index)

    def built(*args, **kwargs):
        events.append("build")
        return build(*args, **kwargs)

    monkeypatch.setattr(keras_input.KerasBatches, "_start", started)
    monkeypatch.setattr(fit, "build_model", built)

    def config(name: str, *extra) -> dict:
        config = config_for(toy_data, tmp_path, name)
        out = str(tmp_path / f"{name}.batches")
        config["callbacks"] = {
            "extra": [*extra, {"name": f"{FACTORIES}:RecordBatches", "out": out}]
        }
        return config

    def session(config) -> list:
        events.clear()
        tpurun.train(config, verbose=False)
        return list(events)

    assert session(config("a")) == [("stream", 0), "build"]
    unbroken = recorded_batches(tmp_path / "a.batches")
    assert len(unbroken) == 3 * 16
    stopped = config("b", signal_at(tmp_path / "fired", epoch=2, step=4))
    with pytest.raises(Interrupted, match=r"stopped at epoch 2, step 4"):
        session(stopped)
    assert events == [("stream", 0), "build"]
    # The rest of epoch 2 (its stream from step 4 read ahead), then epoch 3 on: a fit and a stream
    # of their own (tpurun.training.fit._fit_from).
    assert session(stopped) == [("stream", 0), "build", ("stream", 0)]
    assert recorded_batches(tmp_path / "b.batches") == unbroken  # none again, none skipped


def test_a_stop_inside_the_resumed_rest_of_an_epoch_stops_there(toy_data, tmp_path):
    """Stopped at epoch 2, step 4; resumed, and stopped again at step 8 of that same epoch."""
    config = config_for(toy_data, tmp_path, "twice", steps_per_execution=1)
    config["callbacks"] = {"extra": [signal_at(tmp_path / "first", epoch=2, step=4)]}
    with pytest.raises(Interrupted, match=r"stopped at epoch 2, step 4"):
        tpurun.train(config, verbose=False)
    # In the resumed session Keras counts the rest of epoch 2 from its own batch 1 (step 5).
    config["callbacks"] = {"extra": [signal_at(tmp_path / "second", epoch=2, step=4)]}
    with pytest.raises(Interrupted) as info:
        tpurun.train(config, verbose=False)
    run_dir = tmp_path / "runs" / "twice"
    state = read_latest(run_dir)
    assert logged_epochs(run_dir) == ["0"]  # epoch 2 has not ended
    assert (state["epoch"], state["step"]) == (1, 8), state
    assert "stopped at epoch 2, step 8" in str(info.value)


def test_a_changed_model_or_batch_is_refused_and_harmless_changes_are_allowed(
    toy_data, tmp_path, capsys
):
    config = config_for(toy_data, tmp_path, "c", epochs=1)
    tpurun.train(config, verbose=False)
    state_file = tmp_path / "runs" / "c" / "checkpoints" / "latest.json"
    before = state_file.read_bytes()

    changed = json.loads(json.dumps(config))
    changed["model"]["kwargs"] = {"units": 32}
    with pytest.raises(TpurunError, match=r"model.kwargs.units: unset -> 32.*--restart"):
        tpurun.train(changed, verbose=False)
    changed = json.loads(json.dumps(config))
    changed["train"]["per_core_batch_size"] = 16
    with pytest.raises(TpurunError, match=r"global_batch_size: 32 -> 16"):
        tpurun.train(changed, verbose=False)
    assert state_file.read_bytes() == before  # a refused resume writes nothing

    config["train"]["epochs"] = 2
    config["callbacks"] = {"early_stopping": {"patience": 5}}
    assert tpurun.train(config)["epochs_completed"] == 2
    out = capsys.readouterr().out
    assert "changed since the last session:" in out and "train.epochs: 1 -> 2" in out


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory) -> tuple[dict, Path]:
    """A finished 1-epoch toy run (its config and run directory): copy it before changing it."""
    root = tmp_path_factory.mktemp("one-epoch")
    config = config_for(write_toy_data(root / "data"), root, "one", epochs=1)
    config["data"]["features"].update({  # the same records under other names, to move to
        "label": {"type": "int64", "cast": "float32", "key": "y"},
        "wide": {"type": "raw", "dtype": "float32", "shape": [8], "key": "x"},
    })  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:  # a cache of its own, as conftest gives each test
        patch.setenv("TPURUN_CACHE_DIR", str(root / "cache"))
        assert tpurun.train(config, verbose=False)["status"] == "completed"
    return config, root / "runs" / "one"


@pytest.mark.parametrize(
    ("change", "said"),
    [({"runtime": {"precision": "bfloat16"}}, r"precision: float32 -> bfloat16"),
     ({"data": {"targets": "label"}}, r"data\.targets: y -> label"),
     ({"data": {"inputs": "wide"}}, r"data\.inputs: x -> wide"),
     ({"data": {"features": {"y": {"type": "int64", "cast": "float16"}}}},
      r"data\.features\.y\.cast: float32 -> float16"),
     ({"train": {"gradient_accumulation_steps": 2}},
      r"train\.gradient_accumulation_steps: unset -> 2")],
    ids=["precision", "targets", "inputs", "features", "accumulation"],
)  # fmt: skip
def test_what_a_checkpoint_cannot_follow_is_refused_naming_it(one_epoch, tmp_path, change, said):
    """A changed precision, features, inputs or targets, or gradient accumulation (besides the
    model and the global batch above) exits 2 naming the key, its old and new values and
    --restart, and writes nothing."""
    config, trained = one_epoch
    shutil.copytree(trained, tmp_path / "runs" / "one")
    changed = json.loads(json.dumps(config))
    changed["output"]["dir"] = str(tmp_path / "runs")
    changed["train"]["epochs"] = 2
    for section, values in change.items():
        for key, value in values.items():
            if isinstance(value, dict):
                changed[section].setdefault(key, {}).update(value)
            else:
                changed[section][key] = value
    before = {p.name: p.read_bytes() for p in (tmp_path / "runs" / "one").rglob("*.json")}
    with pytest.raises(TpurunError, match=f"{said}.*--restart") as info:
        tpurun.train(changed, verbose=False)
    assert info.value.exit_code == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "runs" / "one").rglob("*.json")} == before


@pytest.mark.slow
def test_the_best_value_carries_over_a_resume(toy_data, tmp_path):
    """In "max" mode a falling loss never improves on epoch 1's: after a resume at epoch 2 the
    best checkpoint is still epoch 1's (a session that forgot the best value would take its own
    first epoch as the best)."""
    config = config_for(toy_data, tmp_path, "best", epochs=2)
    config["callbacks"] = {"checkpoint": {"monitor": "loss", "mode": "max"}}
    tpurun.train(config, verbose=False)
    config["train"]["epochs"] = 3
    summary = tpurun.train(config, verbose=False)
    rows = read_log(tmp_path / "runs" / "best")
    losses = [float(r["loss"]) for r in rows]
    assert losses == sorted(losses, reverse=True)  # falling: epoch 1 stays the highest
    assert summary["resumes"][-1]["epoch"] == 2
    assert summary["best"] == {"monitor": "loss", "value": losses[0], "epoch": 1}
    best = json.loads((tmp_path / "runs" / "best" / "checkpoints" / "best.json").read_text())
    assert best["epoch"] == 1


def test_early_stopping_counts_and_best_weights_carry_over_a_resume(toy_data, tmp_path):
    # In "max" mode a falling loss never improves: patience 2 stops after epoch 3, whether or
    # not the run was resumed in between (Keras alone would start counting again at epoch 3),
    # and the weights restored at the end are epoch 1's, which the resumed process never held.
    callbacks = {
        "early_stopping": {"monitor": "loss", "mode": "max", "patience": 2,
                           "restore_best_weights": True},
        "checkpoint": {"save_best_only": False, "filename": "ep{epoch}.weights.h5"},
    }  # fmt: skip
    config = config_for(toy_data, tmp_path, "es", epochs=2)
    config["callbacks"] = callbacks
    tpurun.train(config, verbose=False)
    config["train"]["epochs"] = 6
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "stopped_early" and summary["epochs_completed"] == 3

    run_dir = tmp_path / "runs" / "es"
    final = keras.saving.load_model(run_dir / "model.keras")
    epoch1 = keras.saving.load_model(run_dir / "model.keras")
    epoch1.load_weights(run_dir / "checkpoints" / "ep1.weights.h5")
    epoch3 = keras.saving.load_model(run_dir / "model.keras")
    epoch3.load_weights(run_dir / "checkpoints" / "ep3.weights.h5")
    for got, want in zip(final.weights, epoch1.weights, strict=True):
        assert (got.numpy() == want.numpy()).all()
    assert any(
        (a.numpy() != b.numpy()).any() for a, b in zip(final.weights, epoch3.weights, strict=True)
    )


@pytest.mark.slow
def test_reduce_lr_on_plateau_state_and_learning_rate_carry_over_a_resume(toy_data, tmp_path):
    plateau = {"reduce_lr_on_plateau": {"monitor": "loss", "mode": "max", "patience": 1,
                                        "factor": 0.5, "cooldown": 1}}  # fmt: skip
    unbroken = config_for(toy_data, tmp_path, "lr-a", epochs=5)
    unbroken["callbacks"] = plateau
    tpurun.train(unbroken, verbose=False)
    broken = config_for(toy_data, tmp_path, "lr-b", epochs=3)
    broken["callbacks"] = plateau
    tpurun.train(broken, verbose=False)
    broken["train"]["epochs"] = 5
    tpurun.train(broken, verbose=False)

    def final_lr(name):
        model = keras.saving.load_model(tmp_path / "runs" / name / "model.keras")
        return float(model.optimizer.learning_rate.numpy())

    assert final_lr("lr-b") == final_lr("lr-a") < 0.01  # reduced, and by the same steps


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")  # Keras, on the mismatched model at the end
def test_resume_from_another_run_directory_or_a_named_checkpoint(toy_data, tmp_path, capsys):
    first = config_for(toy_data, tmp_path, "session1", epochs=2)
    first["callbacks"] = {
        "checkpoint": {"monitor": "loss", "save_best_only": False, "filename": "ep{epoch}.keras"}
    }
    tpurun.train(first, verbose=False)
    session1 = tmp_path / "runs" / "session1"

    # Last session's output, read from elsewhere (as /kaggle/input is): the log carries over.
    second = config_for(toy_data, tmp_path, "session2", epochs=3)
    summary = tpurun.train(second, resume=str(session1))
    assert summary["epochs_completed"] == 3 and summary["resumes"][0]["epoch"] == 2
    assert logged_epochs(tmp_path / "runs" / "session2") == ["0", "1", "2"]
    assert "resuming at epoch 3 from" in capsys.readouterr().out

    # A pattern-named checkpoint has its state beside it: continue from epoch 1's.
    third = config_for(toy_data, tmp_path, "rollback", epochs=3)
    summary = tpurun.train(third, resume=str(session1 / "checkpoints" / "ep1.keras"))
    assert summary["resumes"][0]["epoch"] == 1 and summary["epochs_completed"] == 3

    # A checkpoint's state file: the resume point it names.
    by_state = config_for(toy_data, tmp_path, "by-state", epochs=3)
    summary = tpurun.train(by_state, resume=str(session1 / "checkpoints" / "latest.json"))
    assert summary["resumes"][0]["epoch"] == 2 and summary["epochs_completed"] == 3

    # A model file with no state beside it: a warm start from its weights, at epoch 1.
    foreign = tmp_path / "foreign.keras"
    shutil.copy(session1 / "model.keras", foreign)
    summary = tpurun.train(config_for(toy_data, tmp_path, "warm", epochs=1), resume=str(foreign))
    assert summary["epochs_completed"] == 1 and summary["final_metrics"]["accuracy"] > 0.85

    with pytest.raises(TpurunError, match=r"--resume .*nowhere: no checkpoint there"):
        tpurun.train(config_for(toy_data, tmp_path, "x"), resume=str(tmp_path / "nowhere"))
    other = toy_config(toy_data, tmp_path / "runs", name="y")
    other["model"]["factory"] = f"{FACTORIES}:two_inputs"
    other["data"]["inputs"] = {"a": "x", "b": "y"}
    with pytest.raises(
        ModelError, match=r"foreign.keras: cannot load foreign.keras into this model"
    ):
        tpurun.train(other, resume=str(foreign), verbose=False)


def test_on_nan_restore_goes_back_with_a_lower_learning_rate(toy_data, tmp_path):
    config = config_for(toy_data, tmp_path, "nan", epochs=2)
    config["train"]["learning_rate"] = {"base": 1e30}
    config["model"]["loss"] = "mse"
    config["callbacks"] = {"on_nan": "restore", "nan_lr_factor": 1e-32, "max_nan_restores": 2}
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
    assert [r["lr_scale"] for r in summary["nan_restores"]] == [1e-32]
    assert summary["nan_restores"][0]["restored_to"] == [0, 0]  # the start: nothing good before
    assert all(v == v for v in summary["final_metrics"].values())  # no NaN left

    config = config_for(toy_data, tmp_path, "nan-again", epochs=2)
    config["train"]["learning_rate"] = {"base": 1e30}
    config["model"]["loss"] = "mse"
    seen = tmp_path / "lr.txt"
    config["callbacks"] = {"on_nan": "restore", "nan_lr_factor": 0.5, "max_nan_restores": 2,
                           "extra": [{"name": f"{FACTORIES}:RecordLearningRate", "out": str(seen)}]}  # fmt: skip
    with pytest.raises(TpurunError, match=r"NaN or Inf after 2 restore\(s\)"):
        tpurun.train(config, verbose=False)
    # Each restore goes back to the same start point, and the cuts add up.
    assert seen.read_text().split() == ["1e+30", "5e+29", "2.5e+29"]
    summary = json.loads((tmp_path / "runs" / "nan-again" / "summary.json").read_text())
    assert summary["status"] == "nan" and len(summary["nan_restores"]) == 2


@pytest.mark.parametrize(
    "every, reason",
    [({"every_steps": 4}, "every_steps"), ({"every_minutes": 1e-5}, "every_minutes")],
)
def test_mid_epoch_saves_every_steps_or_minutes(toy_data, tmp_path, every, reason):
    config = config_for(toy_data, tmp_path, "every", epochs=1)
    seen = tmp_path / "seen.jsonl"
    watch = {"name": f"{FACTORIES}:WatchLatest", "folder": str(tmp_path / "runs" / "every" / "checkpoints"),
             "out": str(seen)}  # fmt: skip
    config["callbacks"] = {"checkpoint": every, "extra": [watch]}
    tpurun.train(config, verbose=False)
    saves = {tuple(json.loads(line)) for line in seen.read_text().splitlines()}
    # 16 steps, 2 per execution: the watcher sees each save one execution later.
    mid = sorted(step for epoch, step, why in saves if why == reason)
    if reason == "every_steps":
        assert mid == [4, 8, 12]
    else:
        assert mid[:3] == [2, 4, 6]  # 1e-5 minutes have always passed: every execution saves


def test_the_first_signal_asks_and_the_second_interrupts():
    import os
    import signal
    import time

    from tpurun.training.signals import Stop, stop_on_signals

    stop = Stop()
    with pytest.raises(KeyboardInterrupt), stop_on_signals(stop):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.reason == "SIGTERM" and stop.requested(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # not reached: the handler raises
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_a_signal_during_the_processes_exchange_is_kept_for_the_next_step():
    """With several processes every step's stop is agreed in an all-gather; a SIGTERM whose
    handler runs inside it was not sent. It must not stop this process alone (the others would
    wait for it), nor be lost under the exchange's answer: the next exchange sends it. (A lost
    SIGTERM let a two-process run train to its end, once in CI.)"""
    import os
    import signal

    from tpurun.training.signals import Stop, stop_on_signals

    sent = []

    def exchange(reason, save_by_clock):  # another process said nothing; the signal lands now
        sent.append(reason)
        if len(sent) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return reason, save_by_clock

    stop = Stop(agree=exchange)
    with stop_on_signals(stop):
        assert stop.agreed(0.0) == (False, False)  # the exchange answered "go on"
        assert stop.reason == "SIGTERM"  # kept
        assert stop.agreed(0.0) == (True, False)  # and sent at the next step
    assert sent == [None, "SIGTERM"]


def test_restart_and_resume_from_inside_the_run_directory_are_refused_together(toy_data, tmp_path):
    config = config_for(toy_data, tmp_path, "both", epochs=1)
    tpurun.train(config, verbose=False)
    run_dir = tmp_path / "runs" / "both"
    with pytest.raises(
        TpurunError, match=r"--restart moves .* aside, and --resume .* is inside it"
    ):
        tpurun.train(config, restart=True, resume=str(run_dir), verbose=False)
    assert (run_dir / "model.keras").exists()  # nothing moved


def test_without_best_checkpoints_a_run_still_resumes(toy_data, tmp_path):
    config = config_for(toy_data, tmp_path, "bare", epochs=1)
    config["callbacks"] = {"checkpoint": None}
    tpurun.train(config, verbose=False)
    config["train"]["epochs"] = 2
    summary = tpurun.train(config, verbose=False)
    assert summary["resumes"][0]["epoch"] == 1 and summary["epochs_completed"] == 2
    names = {p.name for p in (tmp_path / "runs" / "bare" / "checkpoints").iterdir()}
    # No best.keras; the previous resume point is kept beside the latest.
    assert names == {"latest.json", "latest-e0002-s0000000.weights.h5", "previous.json",
                     "latest-e0001-s0000000.weights.h5"}  # fmt: skip
