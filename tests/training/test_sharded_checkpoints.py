"""Sharded, asynchronous checkpoints (Orbax) of a model split over a device mesh: a save under one
mesh restores under another, a checkpoint of another model is refused naming the variables, and
a full fine-tune under a 2x4 mesh resumes exactly after SIGKILL mid-epoch.

The tiny Gemma with 8 query and 4 key/value heads (tests/hub_presets.py ``gemma_mesh``) under
the 8 simulated CPU devices of the test process.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import keras
import numpy as np
import pytest
from factories import recorded_batches
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
)

import tpurun
from tpurun import frameworks
from tpurun.errors import Interrupted, ModelError
from tpurun.training.checkpoints import sharded

POISON = (
    Path(__file__).resolve().parents[1] / "hub" / "test_hub_checkpoints.py"
)  # its PoisonAt callback


@contextlib.contextmanager
def model_parallel(data: int, model: int):
    """Gemma's own layout over a (data, model) mesh of the 8 devices, for the block."""
    keras_hub = frameworks.keras_hub()
    mesh = keras.distribution.DeviceMesh((data, model), ["data", "model"],
                                         keras.distribution.list_devices())  # fmt: skip
    layout = keras_hub.models.GemmaBackbone.get_layout_map(mesh, data_parallel_dim_name="data")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="data")
    )
    try:
        yield
    finally:
        keras.distribution.set_distribution(None)


def tokens(seed: int = 0, n: int = 32, length: int = 16):
    rng = np.random.default_rng(seed)
    x = {"token_ids": rng.integers(0, 256, (n, length)).astype("int32"),
         "padding_mask": np.ones((n, length), "int32")}  # fmt: skip
    return x, rng.integers(0, 256, (n, length)).astype("int32")


def gemma(preset: Path, trained_steps: int = 0):
    """The tiny Gemma, compiled (AdamW), its optimizer built; trained a few steps if asked."""
    keras_hub = frameworks.keras_hub()
    model = keras_hub.models.GemmaCausalLM.from_preset(str(preset), preprocessor=None)
    model.compile(optimizer=keras.optimizers.AdamW(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    model.optimizer.build(model.trainable_variables)
    if trained_steps:
        x, y = tokens()
        model.fit(x, y, batch_size=len(y) // trained_steps, epochs=1, verbose=0, shuffle=False)
    return model


def values(model) -> dict[str, np.ndarray]:
    out = {f"model/{i}": np.asarray(v.value) for i, v in enumerate(model.weights)}
    out.update({f"optimizer/{i}": np.asarray(v.value)
                for i, v in enumerate(model.optimizer.variables)})  # fmt: skip
    return out


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.fixture(scope="module")
def saved_2x4(tiny_presets, tmp_path_factory):
    """A tiny Gemma trained 2 steps under a 2x4 mesh and saved (async, then 2 more steps while
    it writes): the folder and the values at the save."""
    folder = tmp_path_factory.mktemp("sharded") / "ck.orbax"
    with model_parallel(2, 4):
        model = gemma(tiny_presets.gemma_mesh, trained_steps=2)
        spec = model.backbone.token_embedding.embeddings.value.sharding.spec
        assert "model" in tuple(spec), spec  # really sharded over the model axis
        want = values(model)
        saver = sharded.Saver()
        saver.save(model, str(folder))
        x, y = tokens(1)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # reuses the buffers
        assert saver.wait() == str(folder)
        saver.close()
        assert values(model)["optimizer/0"] != want["optimizer/0"]  # iterations moved on
    return folder, want


@pytest.mark.parametrize("mesh", [(2, 4), (4, 2), (8, 1)])
def test_a_2x4_checkpoint_restores_weights_and_optimizer_under_another_mesh(
    saved_2x4, tiny_presets, mesh
):
    folder, want = saved_2x4
    with model_parallel(*mesh):
        model = gemma(tiny_presets.gemma_mesh)
        sharded.load(model, str(folder), "test")
        assert_same(values(model), want)
        embeddings = model.backbone.token_embedding.embeddings.value
        assert embeddings.sharding.mesh.shape == {"data": mesh[0], "model": mesh[1]}


def test_a_checkpoint_of_another_model_is_refused_naming_the_variables(saved_2x4, tiny_presets):
    folder, _ = saved_2x4
    with model_parallel(2, 4):
        other = gemma(tiny_presets.gemma_mesh)
        other.backbone.enable_lora(2)  # adapter kernels: more variables, other optimizer slots
        other.optimizer.build(other.trainable_variables)
        before = values(other)
        with pytest.raises(ModelError, match=r"ck\.orbax does not fit this model \(.*lora_kernel_a"
                           r".*--restart"):  # fmt: skip
            sharded.load(other, str(folder), "test")
        assert_same(values(other), before)  # nothing assigned


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path, tiny_presets):
    (tmp_path / "x.orbax").mkdir()
    with model_parallel(2, 4):
        model = gemma(tiny_presets.gemma_mesh)
        with pytest.raises(ModelError, match=r"x\.orbax is not a readable sharded checkpoint"):
            sharded.load(model, str(tmp_path / "x.orbax"), "test")


# ------------------------------------------------------------------ through tpurun train
@pytest.fixture(scope="module")
def chat(chat_records) -> Path:
    return chat_records(64)


def mesh_config(root: Path, preset: Path, data: Path, name: str, mesh=(2, 4), **sections) -> dict:
    """A full fine-tune (every weight trains: Orbax checkpoints) under a mesh: 6 steps an epoch
    of 8 records, a checkpoint every 2 steps."""
    config = {
        "name": name,
        "model": {"preset": str(preset), "sequence_length": 16},
        "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")},
        "train": {"per_core_batch_size": 1, "epochs": 2, "steps_per_execution": 1,
                  "learning_rate": {"base": 1e-3}},
        "runtime": {"cpu_devices": 8, "mesh": {"data": mesh[0], "model": mesh[1]}},
        "callbacks": {"checkpoint": {"every_steps": 2}},
        "output": {"dir": str(root / "runs")},
    }  # fmt: skip
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return config


def checkpoint_values(folder: Path) -> dict[str, np.ndarray]:
    """A sharded checkpoint's arrays, read whole on the host (no model needed)."""
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
        found = reader.restore(folder, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return {f"{g}/{k}": np.asarray(v) for g, d in found["state"].items() for k, v in d.items()}


def latest_folder(run_dir: Path) -> Path:
    name = read_latest(run_dir)["weights"]
    assert name.endswith(".orbax"), name
    return run_dir / "checkpoints" / name


def record_batches(out: Path) -> dict:
    """A ``callbacks.extra`` entry writing a digest of each training batch to ``out``."""
    return {"name": f"{FACTORIES}:RecordBatches", "out": str(out)}


@pytest.fixture(scope="module")
def unbroken_2x4(tiny_presets, chat, tmp_path_factory) -> tuple[Path, list[str]]:
    """The 2-epoch full fine-tune under 2x4 that the stopped and resumed runs are compared with:
    its run directory (read it, never write into it) and the batches it trained on, in order."""
    root = tmp_path_factory.mktemp("unbroken-2x4")
    config = mesh_config(root, tiny_presets.gemma_mesh, chat, "a",
                         callbacks={"extra": [record_batches(root / "batches")]})  # fmt: skip
    assert tpurun.train(config, verbose=False)["status"] == "completed"
    batches = recorded_batches(root / "batches")
    assert len(batches) == len(set(batches)) == 12  # 6 steps an epoch; each pass shuffles anew
    return root / "runs" / "a", batches


@pytest.mark.slow
def test_a_sigterm_under_2x4_commits_a_sharded_checkpoint_and_the_resume_is_exact(
    tiny_presets, chat, unbroken_2x4, tmp_path
):
    """SIGTERM after step 3 of epoch 2: the save of step 2 may still be in flight; the stop waits
    for it, saves step 3 and commits it; the resumed run ends on the unbroken run's bits."""
    reference, batches = unbroken_2x4
    extra = [signal_at(tmp_path / "fired", 2, 3), record_batches(tmp_path / "batches")]
    config = mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, "b",
                         callbacks={"extra": extra})  # fmt: skip
    with pytest.raises(Interrupted, match=r"stopped at epoch 2, step 3"):
        tpurun.train(config, verbose=False)
    run_dir = tmp_path / "runs" / "b"
    state = read_latest(run_dir)
    assert (state["epoch"], state["step"], state["weights"]) == (
        1,
        3,
        "latest-e0001-s0000003.orbax",
    )
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    previous = read_previous(run_dir)["weights"]
    assert names == sorted(["best.json", "best.orbax", "latest-e0001-s0000003.orbax",
                            "latest.json", previous, "previous.json"])  # fmt: skip
    assert read_latest(run_dir)["identity"]["model.preset"] == str(tiny_presets.gemma_mesh)

    resumed = tpurun.train(config, verbose=False)
    assert resumed["status"] == "completed" and resumed["resumes"][-1]["step"] == 3
    assert recorded_batches(tmp_path / "batches") == batches  # none again, none skipped
    assert_same_log(run_dir, reference)
    assert latest_folder(run_dir).name == "latest-e0002-s0000000.orbax"
    assert_same(
        checkpoint_values(latest_folder(run_dir)), checkpoint_values(latest_folder(reference))
    )


@pytest.mark.slow
def test_sigkill_mid_epoch_under_2x4_then_resume_gives_the_unbroken_run(
    tiny_presets, chat, unbroken_2x4, tmp_path
):
    """SIGKILL after step 5 of epoch 2 (saves every 2 steps, in the background), in a fresh
    process. The save of step 4 is in flight: the run's own callback, which commits a finished
    save at each step, runs after the user's that kills (and step 4's save began only once step
    2's was committed). So latest.json names step 2's complete folder, and the resume, in another
    process, ends on the unbroken run's bits."""
    reference, batches = unbroken_2x4
    extra = [signal_at(tmp_path / "fired", 2, 5, "SIGKILL"), record_batches(tmp_path / "batches")]
    config = mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, "b", callbacks={"extra": extra})
    path = write_config(tmp_path, config, "b")
    killed = run_cli("train", str(path))
    assert killed.returncode == -9, killed.stderr
    run_dir = tmp_path / "runs" / "b"
    state = read_latest(run_dir)
    assert (state["epoch"], state["step"], state["weights"]) == (
        1, 2, "latest-e0001-s0000002.orbax")  # fmt: skip
    checkpoint_values(latest_folder(run_dir))  # complete: it reads
    # Step 4's save was in flight at the kill: begun (its folder is there) and never committed.
    # The resume points of steps 0 and 2 are kept, whole; step 4's is Orbax's unfinished folder.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "best.json", "best.orbax", "latest-e0001-s0000000.orbax", "latest-e0001-s0000002.orbax",
        "latest-e0001-s0000004.orbax.orbax-checkpoint-tmp", "latest.json", "previous.json"]  # fmt: skip
    assert recorded_batches(tmp_path / "batches") == batches[:11]  # step 5 of epoch 2 trained

    done = run_cli("train", str(path))
    assert done.returncode == 0, done.stderr
    assert read_summary(run_dir)["resumes"][-1]["step"] == 2
    # Steps 3-5 of epoch 2 again (their updates were lost with the process), then on.
    assert recorded_batches(tmp_path / "batches") == batches[:11] + batches[8:]
    assert_same_log(run_dir, reference)
    assert_same(
        checkpoint_values(latest_folder(run_dir)), checkpoint_values(latest_folder(reference))
    )
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    previous = read_previous(run_dir)["weights"]
    assert names == sorted(["best.json", "best.orbax", "latest-e0002-s0000000.orbax",
                            "latest.json", previous, "previous.json"])  # fmt: skip


@pytest.mark.slow
def test_a_run_saved_under_2x4_resumes_under_4x2_and_from_its_best_folder(
    tiny_presets, chat, unbroken_2x4, tmp_path
):
    """Epoch 1 under 2x4; epoch 2 under 4x2 from its last folder, and under 8x1 from its best
    folder (epoch 1's, the only one yet). Another mesh rounds the numbers otherwise, so the proof
    that each resume kept its place in the data is the batches it trained on: epoch 2's of the
    unbroken run, in order."""
    reference_batches = unbroken_2x4[1]

    def config(name: str, mesh: tuple, epochs: int) -> dict:
        return mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, name, mesh=mesh,
                           train={"epochs": epochs},
                           callbacks={"extra": [record_batches(tmp_path / f"{name}.batches")]})  # fmt: skip

    assert tpurun.train(config("m", (2, 4), 1), verbose=False)["status"] == "completed"
    run_dir = tmp_path / "runs" / "m"
    saved = checkpoint_values(latest_folder(run_dir))
    assert recorded_batches(tmp_path / "m.batches") == reference_batches[:6]

    best = run_dir / "checkpoints" / "best.orbax"
    summary = tpurun.train(config("n", (8, 1), 2), resume=str(best), verbose=False)
    assert summary["status"] == "completed"
    resumed = summary["resumes"][-1]  # from the best folder, not a fresh start
    assert (resumed["from"], resumed["epoch"], resumed["step"]) == (str(best), 1, 0), resumed
    assert recorded_batches(tmp_path / "n.batches") == reference_batches[6:]

    summary = tpurun.train(config("m", (4, 2), 2), verbose=False)
    assert summary["status"] == "completed" and summary["resumes"][-1]["epoch"] == 1
    after = checkpoint_values(latest_folder(run_dir))
    assert after["optimizer/0000"] == saved["optimizer/0000"] + 6  # iterations went on from there
    assert recorded_batches(tmp_path / "m.batches") == reference_batches


@pytest.mark.gcs
@pytest.mark.slow
def test_a_sharded_run_in_a_bucket_commits_complete_folders_and_resumes(gcs, tiny_presets, chat,
                                                                         tmp_path):  # fmt: skip
    """Orbax writes through TensorStore, pointed at the test server's plain port (on Google
    Cloud it needs no setting); the folders' other files go through TensorFlow's client."""
    run = f"{gcs.bucket}/runs/m"
    config = mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, "m", train={"epochs": 1},
                         output={"dir": f"{gcs.bucket}/runs"})  # fmt: skip
    path = write_config(tmp_path, config, "m")
    tensorstore = {"TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{gcs.port}"}
    for epochs in ("1", "2"):
        done = gcs.tpurun("train", str(path), "--set", f"train.epochs={epochs}", cwd=tmp_path,
                          **tensorstore)  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert "resuming at epoch 2 from" in done.stdout
    latest = gcs.get_json(f"{run}/checkpoints/latest.json")
    assert latest["weights"] == "latest-e0002-s0000000.orbax"
    folders = {p.removeprefix(f"{run}/checkpoints/").split("/")[0]
               for p in gcs.list(f"{run}/checkpoints/")} - {""}  # the folder's marker  # fmt: skip
    previous = gcs.get_json(f"{run}/checkpoints/previous.json")["weights"]  # kept beside it
    assert folders == {"best.json", "best.orbax", "latest-e0002-s0000000.orbax", "latest.json",
                       "previous.json", previous}  # fmt: skip
    folder = f"{run}/checkpoints/latest-e0002-s0000000.orbax"
    assert gcs.get(f"{folder}/commit_success.txt") == (
        f"Checkpoint commit was successful to {folder}".encode()
    )


@pytest.mark.slow
def test_a_lora_run_under_2x4_keeps_its_adapter_files_and_resumes(tiny_presets, chat, tmp_path):
    """LoRA under a mesh: adapter files (what trains is small and replicated), not Orbax."""
    config = mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, "lora", train={"epochs": 1},
                         model={"lora": {"rank": 2}})  # fmt: skip
    assert tpurun.train(config, verbose=False)["status"] == "completed"
    run_dir = tmp_path / "runs" / "lora"
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    previous = read_previous(run_dir)["weights"]
    assert names == sorted(["best.adapter.h5", "best.json", "latest-e0001-s0000000.adapter.h5",
                            "latest.json", previous, "previous.json"])  # fmt: skip
    config["train"]["epochs"] = 2
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and summary["resumes"][-1]["epoch"] == 1
    assert read_latest(run_dir)["weights"] == "latest-e0002-s0000000.adapter.h5"


@pytest.mark.slow
def test_on_nan_restore_under_2x4_reloads_the_last_sharded_checkpoint(tiny_presets, chat, tmp_path):
    """NaN after step 3 of epoch 2: the save of step 2 (in the background) is committed, loaded
    back into the model on the mesh, and training goes on with a finite loss."""
    poison = {
        "name": f"{POISON}:PoisonAt",
        "epoch": 2,
        "step": 3,
        "marker": str(tmp_path / "done"),
        "variable": "token_embedding/embeddings",
    }
    config = mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, "nan",
                         callbacks={"on_nan": "restore", "max_nan_restores": 1,
                                    "extra": [poison]})  # fmt: skip
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed", summary
    assert [r["restored_to"] for r in summary["nan_restores"]] == [[1, 2]]
    assert all(np.isfinite(float(r["loss"])) for r in read_log(tmp_path / "runs" / "nan"))
    held = checkpoint_values(latest_folder(tmp_path / "runs" / "nan"))
    assert all(np.isfinite(v).all() for v in held.values())
