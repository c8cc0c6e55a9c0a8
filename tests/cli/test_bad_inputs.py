"""Bad inputs to `tpurun train`, one row each.

Every row must exit 2 with a message that names the key or file (and, for some, what was found or
what is allowed), print no traceback, and leave an existing run directory as it was: a second
attempt with a typo must not cost the first attempt's log or checkpoint state.

Rows that fail validation run in this process through Typer's CliRunner, with the door to
TensorFlow, JAX and Keras (tpurun.frameworks, the only way tpurun reaches them) shut: that proves
they answer before any framework loads. The others (``PAST_VALIDATION``) get past validation and
read the data, in this process too, the frameworks open; two of them (marked slow) run the real
console script in a subprocess, for the path a user's shell takes (its entry point, its exit code).
"""

from __future__ import annotations

import pytest
import yaml
from helpers import FACTORIES, run_cli, toy_config, write_toy_data
from typer.testing import CliRunner

from tpurun import frameworks
from tpurun.cli.app import app

SLOW = pytest.mark.slow

# An earlier run's files, which no failed attempt may change. It kept no resume point (a run
# that saved none), so every row starts the run as new. (A latest.json naming weights that are
# gone is a damaged resume point, refused before anything else: tests/training/test_resume_safety.py.)
EARLIER_RUN = {
    "log.csv": b"epoch,accuracy,loss\n0,0.71,0.58\n1,0.83,0.41\n",
    "checkpoints/notes.txt": b"the earlier run's notes\n",
    "config.yaml": b"# the earlier run's config\n",
    "summary.json": b'{"status": "completed", "epochs_completed": 2}\n',
}
FRAMEWORKS = ("tensorflow", "jax", "keras")


def _shut(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} was asked for while validating a config")

    return refuse


# ------------------------------------------------------------------- edits of the valid toy config
def put(dotted: str, value):
    """Set a dotted key."""

    def edit(config: dict) -> dict:
        *parents, key = dotted.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value
        return config

    return edit


def drop(dotted: str):
    """Remove a dotted key."""

    def edit(config: dict) -> dict:
        *parents, key = dotted.split(".")
        node = config
        for part in parents:
            node = node[part]
        del node[key]
        return config

    return edit


def rename(dotted: str, new_key: str):
    """Rename a dotted key's last part, keeping its value (a typo in a key)."""

    def edit(config: dict) -> dict:
        *parents, key = dotted.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[new_key] = node.pop(key)
        return config

    return edit


def edits(*steps):
    """Several edits in turn."""

    def edit(config: dict) -> dict:
        for step in steps:
            config = step(config)
        return config

    return edit


def text(content: str):
    """The file's exact text instead of the toy config."""
    return lambda config: content


def first_line(line: str):
    """The toy config with a line put before it."""
    return lambda config: line + "\n" + yaml.safe_dump(config, sort_keys=False)


def as_is(config: dict) -> dict:
    return config


def no_file(config: dict) -> None:
    return None


def factory(name: str):
    return put("model.factory", f"{FACTORIES}:{name}")


# ------------------------------------------------------------------------------------------ rows
# $CONFIG is the config file's path, $TMP the test's folder (the data is in $TMP/data).
ROWS = [
    # --- the file itself
    pytest.param(
        text("name: toy\ntrain:\n  epochs: 3\n per_core_batch_size: 32\n"), [],
        ["$CONFIG:4:2: not valid YAML"],
        id="invalid-yaml-indentation",
    ),
    pytest.param(
        text("name: toy\ntrain:\n\tepochs: 3\n"), [],
        ["$CONFIG:3:1: not valid YAML", "found character '\\t'"],
        id="invalid-yaml-tab",
    ),
    pytest.param(text(""), [], ["$CONFIG: the file is empty"], id="empty-file"),
    pytest.param(
        text("- train\n- epochs\n"), [], ["$CONFIG:1: expected a mapping of keys", "got list"],
        id="top-level-list",
    ),
    pytest.param(
        first_line("seed: 1"), [], ["$CONFIG:3: duplicate key 'seed'"], id="duplicate-key"
    ),
    pytest.param(no_file, [], ["$CONFIG: no such file"], id="missing-config-file"),
    # --- keys and values
    pytest.param(
        put("train.epoch", 3), [],
        ["$CONFIG:", "unknown key 'train.epoch'; did you mean 'epochs'?"],
        id="unknown-key",
    ),
    pytest.param(
        rename("data.features", "featurs"), [],
        ["unknown key 'data.featurs'; did you mean 'features'?"],
        id="features-section-typo",
    ),
    pytest.param(
        rename("data.features.x.dtype", "dtyp"), [],
        ["unknown key 'data.features.x.dtyp'; did you mean 'dtype'?"],
        id="feature-option-typo",
    ),
    pytest.param(
        put("data.inputs", "X"), [],
        ["data.inputs: 'X' is not a declared feature", "declared: x, y"],
        # checked once the features are complete (a partial features: block merges with the schema)
        id="inputs-name-an-undeclared-feature",
    ),
    pytest.param(
        put("data.features.x.type", "rawbytes"), [],
        ["data.features.x.type: unknown feature type 'rawbytes'", "did you mean"],
        id="unknown-feature-type",
    ),
    pytest.param(
        put("train.epochs", "three"), [], ["train.epochs: ", "received 'three'"], id="wrong-type"
    ),
    pytest.param(
        put("runtime.backend", "torch"), [],
        ["runtime.backend: ", "'auto', 'jax' or 'tensorflow'", "received 'torch'"],
        id="value-not-allowed",
    ),
    pytest.param(
        drop("data.train"), [], ["'data.train' is required but missing"], id="missing-required-key"
    ),
    pytest.param(  # optional for a preset, which may take them from its features
        drop("data.targets"), [], ["'data.targets' is required but missing"], id="factory-needs-targets"
    ),
    pytest.param(
        put("model.factory", "models.py"), [],
        ["model.factory: ", '"path/to/file.py:function"', "received 'models.py'"],
        id="factory-without-function",
    ),
    pytest.param(
        put("train.steps_per_execution", 0), [],
        ["train.steps_per_execution: expected 'auto' or an integer >= 1; received 0"],
        id="steps-per-execution-0",
    ),
    pytest.param(
        put("train.global_batch_size", 64), [],
        ["give per_core_batch_size or global_batch_size, not both"],
        id="both-batch-sizes",
    ),
    pytest.param(
        put("train.time_limit", "8 hours"), [],
        ["train.time_limit: expected a duration such as 8h45m", "received '8 hours'"],
        id="bad-time-limit",
    ),
    pytest.param(
        put("name", "my run"), [], ["name: use letters, digits", "received 'my run'"],
        id="run-name-with-space",
    ),
    # --- the command line
    pytest.param(
        as_is, ["--set", "train.epochs=0"],
        ["--set train.epochs=0: train.epochs: ", "greater than or equal to 1", "received 0"],
        id="set-bad-value",
    ),
    pytest.param(
        as_is, ["--set", "train.epoch=3"],
        ["--set train.epoch=3: unknown key 'train.epoch'; did you mean 'epochs'?"],
        id="set-unknown-key",
    ),
    pytest.param(
        as_is, ["--set", "train.epochs"],
        ["'train.epochs' has no '='; did you mean --set train.epochs=VALUE?"],
        id="set-without-value",
    ),
    pytest.param(
        as_is, ["--set", "train.epochs", "3"],
        ["'train.epochs' has no '='; did you mean --set train.epochs=3?"],
        id="set-key-space-value",
    ),
    pytest.param(
        as_is, ["--set", "data.train=[a/*.tfrecord, b/*.tfrecord"],
        ["--set data.train=[a/*.tfrecord, b/*.tfrecord: the value starts like a YAML list but "
         "does not parse"],
        id="set-unclosed-list",
    ),
    pytest.param(
        as_is, ["--time-limit", "soon"], ["--time-limit soon: expected a duration such as 8h45m"],
        id="time-limit-option-bad",
    ),
    # --- past validation: the data, the model, the machine, the output folder
    pytest.param(
        put("data.train", "$TMP/nothing/*.tfrecord"), [],
        ["data.train: $TMP/nothing/*.tfrecord: no file matches this glob"],
        id="glob-matches-nothing", marks=SLOW,
    ),
    pytest.param(
        put("model.factory", "no/such/file.py:build"), [],
        ["model.factory 'no/such/file.py:build': no such file $TMP/no/such/file.py"],
        id="factory-file-missing",
    ),
    pytest.param(
        factory("mpl"), [], ["model.factory", "has no 'mpl'. Did you mean 'mlp'?"],
        id="factory-function-missing",
    ),
    pytest.param(
        factory("raises"), [],
        ["model.factory", "raised RuntimeError: the factory broke on purpose", "factories.py:"],
        id="factory-raises", marks=SLOW,
    ),
    pytest.param(
        factory("not_a_model"), [], ["model.factory", "returned str, not a Keras model"],
        id="factory-returns-non-model",
    ),
    # The inputs are checked against the features before compiling: the message names the key
    # that sets the shape, what the records hold and what the model takes.
    pytest.param(
        factory("five_inputs"), [],
        ["data.features.x.shape is [8], and the model's input 'x' takes (5,) per record; the "
         "records hold 8 float32 values each. Build the model on keras.Input(shape=(8,))"],
        id="inputs-do-not-fit",
    ),
    pytest.param(
        factory("image_input"), [],
        ["data.features.x.shape is [8], and the model's input 'x' takes (8, 8, 1) per record"],
        id="inputs-of-another-rank",
    ),
    pytest.param(
        factory("two_inputs"), [],
        ["data.inputs names 1 feature(s) ('x'), and the model takes 2 input(s) ('a', 'b'). Name "
         "one feature per model input: data.inputs: {a: FEATURE, b: FEATURE}."],
        id="inputs-fewer-than-the-model-takes",
    ),
    pytest.param(
        put("data.inputs", {"z": "x"}), [],
        ["data.inputs has no entry for the model's input(s) 'x' and maps 'z', which the model "
         "does not take: the model's inputs are 'x'."],
        id="inputs-map-a-name-the-model-lacks",
    ),
    pytest.param(
        factory("three_outputs"), [],
        ["does not fit the data (data.inputs / data.targets)", "target.shape=(32,)",
         "output.shape=(32, 3)"],
        id="outputs-do-not-fit",
    ),
    pytest.param(
        factory("two_outputs"), [],
        ["does not fit the data (data.inputs / data.targets)", "output"],
        id="two-outputs-one-target",
    ),
    pytest.param(
        put("model.optimizer", "adamm"), [],
        ["model.optimizer: unknown name 'adamm'; did you mean 'adam'?"],
        id="unknown-optimizer",
    ),
    pytest.param(
        put("model.loss", "binary_crossentropyy"), [],
        ["model.loss: unknown name 'binary_crossentropyy'; did you mean 'binary_crossentropy'?"],
        id="unknown-loss",
    ),
    pytest.param(
        put("model.metrics", ["acuracy"]), [],
        ["model.metrics: unknown name 'acuracy'; did you mean 'accuracy'?"],
        id="unknown-metric",
    ),
    pytest.param(
        edits(put("runtime.cpu_devices", 8), drop("train.per_core_batch_size"),
              put("train.global_batch_size", 12)), [],
        ["train.global_batch_size: 12 does not divide evenly over 8 replicas",
         "use a multiple of 8"],
        id="global-batch-not-divisible",
    ),
    pytest.param(
        put("output.dir", "$TMP/data/train-00000-of-00004.tfrecord/runs"), [],
        ["output.dir: cannot create $TMP/data/train-00000-of-00004.tfrecord/runs/toy",
         "Not a directory"],
        id="output-dir-under-a-file",
    ),
]  # fmt: skip


#: The rows that get past validation: they need the data, and the frameworks.
PAST_VALIDATION = {
    "inputs-name-an-undeclared-feature",
    "glob-matches-nothing",
    "factory-file-missing",
    "factory-function-missing",
    "factory-raises",
    "factory-returns-non-model",
    "inputs-do-not-fit",
    "inputs-of-another-rank",
    "inputs-fewer-than-the-model-takes",
    "inputs-map-a-name-the-model-lacks",
    "outputs-do-not-fit",
    "two-outputs-one-target",
    "unknown-optimizer",
    "unknown-loss",
    "unknown-metric",
    "global-batch-not-divisible",
    "output-dir-under-a-file",
}


@pytest.mark.parametrize(("edit", "args", "expected"), ROWS)
def test_bad_input_exits_2_naming_the_problem_and_keeps_earlier_files(
    request, tmp_path, monkeypatch, edit, args, expected
):
    run_dir = tmp_path / "runs" / "toy"
    for name, content in EARLIER_RUN.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(content)
    config_path = tmp_path / "exp.yaml"

    def fill(s: str) -> str:
        return s.replace("$TMP", str(tmp_path)).replace("$CONFIG", str(config_path))

    config = edit(toy_config(tmp_path / "data", tmp_path / "runs"))
    if config is not None:
        dumped = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
        config_path.write_text(fill(dumped))
    argv = ["train", str(config_path), *map(fill, args)]
    if request.node.callspec.id in PAST_VALIDATION:
        write_toy_data(tmp_path / "data")
    if request.node.get_closest_marker("slow"):  # the console script, in a process of its own
        result = run_cli(*argv)
        output, code = result.stdout + result.stderr, result.returncode
    elif request.node.callspec.id in PAST_VALIDATION:
        result = CliRunner().invoke(app, argv)
        output, code = result.output, result.exit_code
    else:
        for name in FRAMEWORKS:
            monkeypatch.setattr(frameworks, name, _shut(name))
        result = CliRunner().invoke(app, argv)
        output, code = result.output, result.exit_code
    assert code == 2, output
    for part in expected:
        assert fill(part) in output, output
    assert "Traceback" not in output
    assert {name: (run_dir / name).read_bytes() for name in EARLIER_RUN} == EARLIER_RUN
    assert not (run_dir / "model.keras").exists()
