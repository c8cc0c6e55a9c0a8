"""Checkpoints of a LoRA fine-tune: adapter files that hold what trains (the LoRA kernels, the
optimizer state, the seed states), not the frozen base again; a resume from them is exact
(SIGKILL mid-epoch, bfloat16); a changed preset is refused; the final artifact is model.lora.h5.
A preset run without LoRA checkpoints as before."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest
from helpers import (
    FACTORIES,
    assert_same_log,
    read_latest,
    read_log,
    read_previous,
    read_summary,
    run_cli,
    signal_at,
    write_config,
    write_jsonl,
)
from hub_presets import sentences
from typer.testing import CliRunner

import tpurun
from tpurun import frameworks
from tpurun.cli.app import app
from tpurun.errors import Interrupted, ModelError
from tpurun.hub.task_model import enable_lora
from tpurun.training.checkpoints import adapter

HERE = Path(__file__).resolve()


class PoisonAt(keras.callbacks.Callback):
    """After batch ``step`` of epoch ``epoch`` (1-based), once (``marker`` records it), sets the
    first variable whose path holds ``variable`` to NaN (a LoRA B kernel by default): every later
    loss is NaN until that variable is loaded again."""

    def __init__(self, epoch: int, step: int, marker: str, variable: str = "lora_kernel_b"):
        super().__init__()
        self.epoch, self.step, self.marker = epoch, step, Path(marker)
        self.variable = variable
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch + 1) == (self.epoch, self.step) and not self.marker.exists():
            self.marker.touch()
            poisoned = next(v for v in self.model.variables if self.variable in v.path)
            poisoned.assign(keras.ops.full(poisoned.shape, float("nan"), dtype=poisoned.dtype))


def lm_config(root: Path, preset: Path, data: Path, name: str, **sections) -> dict:
    """The tiny Gemma's LoRA fine-tune: 9 steps an epoch (72 records, global batch 8)."""
    config = {
        "name": name,
        "model": {"preset": str(preset), "lora": {"rank": 4}, "sequence_length": 24},
        "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")},
        "train": {"per_core_batch_size": 4, "epochs": 2, "steps_per_execution": 1,
                  "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(root / "runs")},
    }  # fmt: skip
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return config


def kept_weights(path: Path) -> dict:
    return pickle.loads(path.read_bytes())


def latest_adapter(run_dir: Path) -> Path:
    name = read_latest(run_dir)["weights"]
    assert name.endswith(".adapter.h5"), name
    return run_dir / "checkpoints" / name


def assert_same_adapter(mine: Path, theirs: Path) -> None:
    """Two adapter checkpoints hold the same bits, group by group, key by key."""
    a, b = adapter.read(str(mine)), adapter.read(str(theirs))
    for group in adapter.GROUPS:
        assert sorted(a[group]) == sorted(b[group]), group
        for key in a[group]:
            assert a[group][key].dtype == b[group][key].dtype, (group, key)
            np.testing.assert_array_equal(a[group][key], b[group][key], err_msg=f"{group}/{key}")


def optimizer_paths(path: Path) -> list[str]:
    with h5py.File(path) as f:
        group = f["optimizer"]
        return [group[k].attrs["path"] for k in sorted(group, key=int)]


@pytest.fixture(scope="module")
def data(chat_records) -> Path:
    return chat_records()


@pytest.fixture(scope="module")
def lora_run(chat_lora_run):
    """The session's 4-epoch LoRA fine-tune (conftest's chat_lora_run): its run directory (read
    it in place), its weights at the end, its config."""
    return chat_lora_run.run_dir, kept_weights(chat_lora_run.weights), chat_lora_run.config


# ------------------------------------------------------------------ what an adapter file holds
def test_an_adapter_checkpoint_is_a_fraction_of_a_full_one(lora_run, tiny_presets, tmp_path):
    run_dir, _, _ = lora_run
    checkpoint = latest_adapter(run_dir)
    # What tpurun wrote before adapter checkpoints: the model's whole .weights.h5, optimizer too.
    task = frameworks.keras_hub().models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    enable_lora(task, 4)
    task.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    task.optimizer.build(task.trainable_variables)
    task.save_weights(tmp_path / "full.weights.h5")
    full, small = (tmp_path / "full.weights.h5").stat().st_size, checkpoint.stat().st_size
    print(f"\ntiny Gemma LoRA checkpoint: adapter {small:,} bytes, full .weights.h5 {full:,} "
          f"bytes ({small / full:.1%})")  # fmt: skip
    assert small < full / 4

    held = adapter.read(str(checkpoint))
    assert sorted(held["model"]) == sorted(v.path for v in task.trainable_variables)
    assert all("lora_kernel" in path for path in held["model"])  # no base weight
    assert len(held["optimizer"]) == len(task.optimizer.variables)
    assert not (run_dir / "model.keras").exists()
    # Best and pattern-named (e{epoch}.keras, keep 1) files are adapter files too, with states.
    previous = read_previous(run_dir)["weights"]  # the resume point before the latest, kept
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted([
        "best.adapter.h5", "best.json", "e4.adapter.h5", "e4.json", checkpoint.name, "latest.json",
        previous, "previous.json"])  # fmt: skip
    assert previous.endswith(".adapter.h5") and previous != checkpoint.name
    for name in ("best", "e4"):
        state = json.loads((run_dir / "checkpoints" / f"{name}.json").read_text())
        assert state["weights"] == f"{name}.adapter.h5"


def test_the_preset_and_the_adapter_are_the_trained_model(lora_run, tiny_presets):
    """Training changed no base weight; the preset with the final model.lora.h5 (or the last
    adapter checkpoint) loaded is the trained model, every weight bit for bit."""
    run_dir, trained, _ = lora_run
    keras_hub = frameworks.keras_hub()
    preset = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    base = {v.path: np.asarray(v.value) for v in preset.weights}
    checkpoint = adapter.read(str(latest_adapter(run_dir)))["model"]
    assert sorted(p for p, (_, trainable, _) in trained.items() if trainable) == sorted(checkpoint)
    for path, (_, trainable, value) in trained.items():
        if trainable:
            np.testing.assert_array_equal(value, checkpoint[path], err_msg=path)
            assert np.any(value != 0), path  # trained (B starts at zero)
        else:
            np.testing.assert_array_equal(value, base[path], err_msg=path)  # frozen

    config = yaml_config(run_dir)
    assert config["model"]["lora"]["rank"] == 4
    rebuilt = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    enable_lora(rebuilt, 4)
    adapter.load_lora(rebuilt, str(run_dir / "model.lora.h5"), "model.lora.h5")
    for v in rebuilt.weights:
        np.testing.assert_array_equal(np.asarray(v.value), trained[v.path][2], err_msg=v.path)
    # KerasHub's own loader reads the same file (its lora group).
    plain = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    plain.backbone.load_lora_weights(str(run_dir / "model.lora.h5"))
    assert [v.path for v in plain.trainable_weights] == [v.path for v in rebuilt.trainable_weights]
    for mine, theirs in zip(plain.trainable_weights, rebuilt.trainable_weights, strict=True):
        np.testing.assert_array_equal(np.asarray(mine.value), np.asarray(theirs.value))


def yaml_config(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


# ------------------------------------------------------------------ exact resume
@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_gives_the_unbroken_adapter_and_optimizer(
    tiny_presets, data, tmp_path
):
    """Saves every 2 steps under gradient accumulation (N=2); SIGKILL after step 5 of epoch 2, so
    the resume point is step 4 of epoch 2: 13 batches, 6 updates and one gradient accumulated."""

    def config(name: str, kill: bool) -> dict:
        extra = [signal_at(tmp_path / "fired", 2, 5, "SIGKILL")] if kill else []
        return lm_config(tmp_path, tiny_presets.gemma, data, name,
                         train={"epochs": 3, "gradient_accumulation_steps": 2},
                         callbacks={"checkpoint": {"every_steps": 2}, "extra": extra})  # fmt: skip

    tpurun.train(config("unbroken", False), verbose=False)  # in this process: one fewer start
    path = write_config(tmp_path, config("killed", True), "killed")
    killed = run_cli("train", str(path))
    assert killed.returncode == -9, killed.stderr
    run_dir = tmp_path / "runs" / "killed"
    assert (read_latest(run_dir)["epoch"], read_latest(run_dir)["step"]) == (1, 4)
    saved = latest_adapter(run_dir)
    values = adapter.read(str(saved))["optimizer"].values()
    accumulators = [value for value, name in zip(values, optimizer_paths(saved), strict=True)
                    if name.endswith("_gradient_accumulator")]  # fmt: skip
    assert accumulators and all(np.any(a != 0) for a in accumulators)
    previous = read_previous(run_dir)["weights"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted([
        "best.adapter.h5", "best.json", saved.name, "latest.json", previous, "previous.json"])  # fmt: skip

    tpurun.train(str(path), verbose=False)
    assert read_summary(run_dir)["resumes"][-1]["step"] == 4
    reference = tmp_path / "runs" / "unbroken"
    assert read_log(run_dir) == read_log(reference)
    assert_same_adapter(latest_adapter(run_dir), latest_adapter(reference))
    assert (run_dir / "model.lora.h5").is_file() and not (run_dir / "model.keras").exists()


@pytest.mark.slow
def test_bfloat16_lora_keeps_float32_adapters_and_resumes_exactly(tiny_presets, data, tmp_path):
    """Under runtime.precision bfloat16 the base is bfloat16, the adapters and their Adam slots
    float32 (KerasHub 0.32); SIGTERM mid-epoch then resume ends on the unbroken run's bits."""

    def config(name: str, kill: bool) -> dict:
        extra = [{"name": f"{FACTORIES}:KeepWeights", "out": str(tmp_path / f"{name}.pkl")}]
        if kill:
            extra.append(signal_at(tmp_path / "fired", 2, 4))
        return lm_config(tmp_path, tiny_presets.gemma, data, name, train={"epochs": 3},
                         runtime={"precision": "bfloat16"}, callbacks={"extra": extra})  # fmt: skip

    tpurun.train(config("a", False), verbose=False)
    with pytest.raises(Interrupted, match="stopped at epoch 2, step 4"):
        tpurun.train(config("b", True), verbose=False)
    interrupted = latest_adapter(tmp_path / "runs" / "b")
    assert read_latest(tmp_path / "runs" / "b")["step"] == 4
    held = adapter.read(str(interrupted))
    assert {v.dtype.name for v in held["model"].values()} == {"float32"}
    slots = [v for v, name in zip(held["optimizer"].values(), optimizer_paths(interrupted),
                                  strict=True) if "lora_kernel" in name]  # fmt: skip
    assert slots and {v.dtype.name for v in slots} == {"float32"}
    resumed = tpurun.train(config("b", True), verbose=False)
    assert resumed["resumes"][-1]["step"] == 4 and resumed["precision"] == "bfloat16"
    assert read_log(tmp_path / "runs" / "b") == read_log(tmp_path / "runs" / "a")
    assert_same_adapter(
        latest_adapter(tmp_path / "runs" / "b"), latest_adapter(tmp_path / "runs" / "a")
    )
    weights = kept_weights(tmp_path / "b.pkl")
    assert weights["token_embedding/embeddings"][0] == "bfloat16"
    assert {d for d, trainable, _ in weights.values() if trainable} == {"float32"}
    for path, (dtype, _, value) in kept_weights(tmp_path / "a.pkl").items():
        assert weights[path][0] == dtype
        np.testing.assert_array_equal(weights[path][2], value, err_msg=path)


@pytest.mark.slow
def test_a_bert_classifier_with_lora_resumes_its_head_biases_and_dropout_exactly(
    tiny_presets, tmp_path
):
    """KerasHub leaves a BERT classifier's head and the adapted layers' biases trainable, and its
    dropout layers draw from seed generators: all in the adapter file, so a resume is exact,
    also in a fresh process (the rest of the run trains in a `tpurun train` of its own)."""
    rows = [{"text": s, "label": int("cat" in s or "dog" in s)} for s in sentences(96)]
    source = write_jsonl(tmp_path / "reviews.jsonl", rows)
    written = CliRunner().invoke(app, ["data", "write", str(source), str(tmp_path / "data" / "rev"),
                                       "--label", "label", "--validation-fraction", "0.25"])  # fmt: skip
    assert written.exit_code == 0, written.output

    def config(name: str, kill: bool) -> dict:
        extra = [signal_at(tmp_path / "fired", 1, 3)] if kill else []
        return {
            "name": name,
            "model": {"preset": str(tiny_presets.bert), "lora": {"rank": 2}},
            "data": {"train": str(tmp_path / "data" / "rev-train-*"),
                     "validation": str(tmp_path / "data" / "rev-validation-*")},
            "train": {"per_core_batch_size": 4, "epochs": 2, "steps_per_execution": 1,
                      "learning_rate": {"base": 3e-3}},
            "runtime": {"cpu_devices": 2},
            "callbacks": {"extra": extra},
            "output": {"dir": str(tmp_path / "runs")},
        }  # fmt: skip

    tpurun.train(config("a", False), verbose=False)
    with pytest.raises(Interrupted, match="stopped at epoch 1, step 3"):
        tpurun.train(config("b", True), verbose=False)
    held = adapter.read(str(latest_adapter(tmp_path / "runs" / "b")))
    assert {"logits/kernel", "logits/bias"} <= set(held["model"])
    assert any(path.endswith("query/bias") for path in held["model"])
    assert len(held["state"]) >= 2 and all(v.dtype == np.uint32 for v in held["state"].values())
    resumed = run_cli("train", str(write_config(tmp_path, config("b", True), "b")))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at epoch 1, step 3 from" in resumed.stdout
    assert_same_log(tmp_path / "runs" / "b", tmp_path / "runs" / "a")
    assert_same_adapter(
        latest_adapter(tmp_path / "runs" / "b"), latest_adapter(tmp_path / "runs" / "a")
    )
    with h5py.File(tmp_path / "runs" / "b" / "model.lora.h5") as f:  # the head goes along
        assert "logits/kernel" in f["tpurun/trainable"] and int(f["lora/vars/rank"][()]) == 2


@pytest.mark.gcs
@pytest.mark.slow
def test_a_lora_run_in_a_bucket_uploads_adapters_and_resumes_from_them(gcs, tiny_presets, data,
                                                                       tmp_path):  # fmt: skip
    run = f"{gcs.bucket}/runs/lm"
    config = lm_config(tmp_path, tiny_presets.gemma, data, "lm", train={"epochs": 1},
                       output={"dir": f"{gcs.bucket}/runs"})  # fmt: skip
    path = write_config(tmp_path, config, "lm")
    machines = []
    for n, epochs in ((1, "1"), (2, "2")):
        machine = {"cwd": tmp_path / f"vm{n}", "TMPDIR": str(tmp_path / f"tmp{n}")}
        for folder in (machine["cwd"], Path(machine["TMPDIR"])):
            folder.mkdir()
        done = gcs.tpurun("train", str(path), "--set", f"train.epochs={epochs}", **machine)
        assert done.returncode == 0, done.stderr
        machines.append(machine)
    assert "resuming at epoch 2 from" in done.stdout
    names = sorted(
        p.removeprefix(run + "/") for p in gcs.list(run + "/checkpoints/") if p[-1] != "/"
    )
    # The previous resume point (epoch 1's, committed by the first session) is kept.
    assert names == ["checkpoints/best.adapter.h5", "checkpoints/best.json",
                     "checkpoints/latest-e0001-s0000000.adapter.h5",
                     "checkpoints/latest-e0002-s0000000.adapter.h5", "checkpoints/latest.json",
                     "checkpoints/previous.json"]  # fmt: skip
    assert gcs.get(f"{run}/model.lora.h5") and gcs.get(f"{run}/model.keras") is None
    for machine in machines:  # staged in the temp folder, uploaded, gone
        assert (
            list(machine["cwd"].iterdir()) == [] and list(Path(machine["TMPDIR"]).iterdir()) == []
        )


# ------------------------------------------------------------------ refusals
@pytest.mark.slow
def test_resuming_against_a_changed_preset_is_refused(tiny_presets, data, tmp_path):
    preset = tmp_path / "preset"
    shutil.copytree(tiny_presets.gemma, preset)
    config = lm_config(tmp_path, preset, data, "lm", train={"epochs": 1})
    assert tpurun.train(config, verbose=False)["status"] == "completed"
    with h5py.File(preset / "model.weights.h5", "r+") as f:  # new values, same size
        found = []
        f.visititems(
            lambda n, o: found.append(o) if isinstance(o, h5py.Dataset) and o.ndim == 2 else None
        )
        found[0][...] = np.asarray(found[0]) * 1.5
    config["train"]["epochs"] = 2
    with pytest.raises(ModelError, match=r"other base weights than the preset .*model\.weights\.h5: "
                       r"other contents.*--restart"):  # fmt: skip
        tpurun.train(config, verbose=False)
    assert read_latest(tmp_path / "runs" / "lm")["epoch"] == 1  # left as it was


def test_an_adapter_of_another_rank_does_not_fit_and_says_which_variables(lora_run, tiny_presets,
                                                                          data, tmp_path):  # fmt: skip
    run_dir, _, _ = lora_run
    config = lm_config(tmp_path, tiny_presets.gemma, data, "rank8", model={"lora": {"rank": 8}})
    with pytest.raises(ModelError, match=r"does not fit this model \(decoder_block_0/attention/"
                       r"query/lora_kernel_a: float32\[4, 64, 4\] in the file, float32\[4, 64, 8\] "
                       r"here.*--restart"):  # fmt: skip
        tpurun.train(config, resume=str(latest_adapter(run_dir)), verbose=False)


# ------------------------------------------------------------------ NaN restore; without LoRA
@pytest.mark.slow
def test_on_nan_restore_reloads_the_adapter_checkpoint(tiny_presets, data, tmp_path):
    poison = {"name": f"{HERE}:PoisonAt", "epoch": 2, "step": 3,
              "marker": str(tmp_path / "poisoned")}  # fmt: skip
    config = lm_config(tmp_path, tiny_presets.gemma, data, "nan",
                       callbacks={"on_nan": "restore", "nan_lr_factor": 0.5, "max_nan_restores": 1,
                                  "extra": [poison]})  # fmt: skip
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed", summary
    assert [(r["restored_to"], r["lr_scale"]) for r in summary["nan_restores"]] == [([1, 0], 0.5)]
    assert all(np.isfinite(float(r["loss"])) for r in read_log(tmp_path / "runs" / "nan"))
    held = adapter.read(str(latest_adapter(tmp_path / "runs" / "nan")))
    assert all(np.isfinite(v).all() for v in held["model"].values())


@pytest.mark.slow
def test_a_preset_run_without_lora_checkpoints_whole_models_as_before(tiny_presets, data, tmp_path):
    config = lm_config(tmp_path, tiny_presets.gemma, data, "full", train={"epochs": 1})
    del config["model"]["lora"]
    assert tpurun.train(config, verbose=False)["status"] == "completed"
    run_dir = tmp_path / "runs" / "full"
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    # One epoch, one commit: no resume point before it to keep.
    assert names == ["best.json", "best.keras", "latest-e0001-s0000000.weights.h5", "latest.json"]
    assert (run_dir / "model.keras").is_file() and not (run_dir / "model.lora.h5").exists()
    assert "preset" not in read_latest(run_dir)
    config["train"]["epochs"] = 2
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and summary["resumes"][-1]["epoch"] == 1
    assert read_latest(run_dir)["weights"] == "latest-e0002-s0000000.weights.h5"


def test_a_finished_lora_run_is_finished_and_a_missing_adapter_is_saved_again(
    chat_lora_run, tmp_path
):
    """model.lora.h5 is a LoRA run's final artifact: with it, the run has trained its epochs;
    without it (the last session stopped before saving it), the next session trains nothing
    and saves it from the last adapter checkpoint."""
    run_dir, config = chat_lora_run.copy(tmp_path)
    final = run_dir / "model.lora.h5"
    before = adapter_values(final)
    checkpoint = latest_adapter(run_dir)
    summary = tpurun.train(config, verbose=False)
    assert summary["resumes"] == [] and latest_adapter(run_dir) == checkpoint
    final.unlink()
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and summary["resumes"][-1]["epoch"] == 4
    assert_same_log(run_dir, chat_lora_run.run_dir)  # nothing trained again
    after = adapter_values(final)
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)


@pytest.mark.slow
def test_resume_takes_a_lora_runs_adapter_files(chat_lora_run, tmp_path, capsys):
    """--resume with a pattern-named adapter (its state beside it) continues from its epoch;
    with model.lora.h5 (no state) it is a warm start: the adapter's weights, at epoch 1."""
    config = json.loads(json.dumps(chat_lora_run.config))
    config["output"]["dir"] = str(tmp_path / "runs")
    config["callbacks"]["extra"] = []
    checkpoints = chat_lora_run.run_dir / "checkpoints"
    on = {**config, "name": "on", "train": {**config["train"], "epochs": 5}}
    summary = tpurun.train(on, resume=str(checkpoints / "e4.adapter.h5"), verbose=False)
    assert (summary["resumes"][0]["epoch"], summary["epochs_completed"]) == (4, 5)

    warm = {**config, "name": "warm", "train": {**config["train"], "epochs": 1}}
    capsys.readouterr()
    summary = tpurun.train(warm, resume=str(chat_lora_run.run_dir / "model.lora.h5"))
    final = chat_lora_run.run_dir / "model.lora.h5"
    assert f"starting from the weights in {final} (no resume state beside it: epoch 1" in (
        capsys.readouterr().out
    )
    assert summary["epochs_completed"] == 1
    # It starts from the trained adapter: its first epoch's loss is below the first epoch's of
    # the run that trained it from zero.
    first = float(read_log(tmp_path / "runs" / "warm")[0]["loss"])
    assert first < float(read_log(chat_lora_run.run_dir)[0]["loss"])


def adapter_values(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of a model.lora.h5, by its name in the file."""
    values = {}
    with h5py.File(path) as f:
        f.visititems(
            lambda n, o: (
                values.update({n: np.asarray(o[()])}) if isinstance(o, h5py.Dataset) else None
            )
        )
    return values
