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

from tpurun import frameworks
from tpurun.errors import ModelError
from tpurun.training.checkpoints import sharded


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
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # the next steps reuse the buffers
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
