"""Config loading: strict schema, file:line errors, did-you-mean, every problem at once, --set."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import yaml

from tpurun.config import Config, load_config
from tpurun.errors import ConfigError

GOOD = """\
# a comment at the top
name: naic-recognizer            # run directory = <output.dir>/<name>
seed: 42
runtime:
  backend: auto
  accelerator: auto
  tpu: auto
  cpu_devices: 1
  precision: auto
model:
  factory: models/recognizer.py:build
  kwargs: {units: 256}
  optimizer: {name: adam}
  loss: binary_crossentropy
  metrics: [accuracy]
data:
  train: gs://bucket/naic/tfrecords_train/*.tfrecords
  validation: gs://bucket/naic/tfrecords_test/*.tfrecords
  features:
    x: {type: raw, dtype: float32, shape: [1024], cast: bfloat16}
    y: {type: raw, dtype: float32, shape: [1]}
  inputs: x
  targets: y
  shuffle_buffer: 10000
train:
  per_core_batch_size: 16
  epochs: 100
  steps_per_epoch: auto
  validation_steps: auto
  steps_per_execution: 32
  learning_rate:
    base: 1.0e-3
    base_batch_size: 128
    scaling: linear
    warmup_epochs: 0
    schedule: constant
callbacks:
  checkpoint: {monitor: loss, save_best_only: true}
  csv_log: {filename: log.csv}
  reduce_lr_on_plateau: {monitor: loss, factor: 0.666, patience: 5, min_lr: 1.0e-5}
  early_stopping: null
  on_nan: stop
  extra: []
output:
  dir: runs
"""


def write(tmp_path, text, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems(tmp_path, text, overrides=()):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    return info.value.problems


def test_the_issue_example_loads_with_every_key(tmp_path):
    config = load_config(write(tmp_path, GOOD))
    assert config.name == "naic-recognizer"
    assert config.train.steps_per_execution == 32
    assert config.data.features["x"].cast == "bfloat16"
    assert config.model.optimizer.name == "adam"
    assert config.callbacks.reduce_lr_on_plateau.factor == 0.666
    assert config.callbacks.early_stopping is None
    # relative paths resolve from the config file's folder, remote ones are left alone
    assert config.resolve_path("models/x.py") == str(tmp_path / "models/x.py")
    assert config.resolve_path("gs://b/*.tfrecord") == "gs://b/*.tfrecord"


def test_bad_value_reports_file_line_key_received_and_allowed(tmp_path):
    text = GOOD.replace("  backend: auto", "  backend: torch")
    [problem] = problems(tmp_path, text)
    assert problem.startswith(f"{tmp_path / 'exp.yaml'}:5: runtime.backend:")
    assert "'auto', 'jax' or 'tensorflow'" in problem
    assert "received 'torch'" in problem


def test_unknown_key_gets_did_you_mean_with_its_line(tmp_path):
    text = GOOD.replace("  epochs: 100", "  epoch: 100")
    [problem] = problems(tmp_path, text)
    assert ":27: unknown key 'train.epoch'; did you mean 'epochs'?" in problem


def test_unknown_key_in_a_nested_feature(tmp_path):
    text = GOOD.replace("shape: [1]}", "shap: [1]}")
    found = problems(tmp_path, text)
    assert any("unknown key 'data.features.y.shap'; did you mean 'shape'?" in p for p in found)


@pytest.mark.parametrize(
    ("key", "allowed"),
    [
        ("callbacks.csv_log.foo", "allowed here: append, filename"),
        ("callbacks.checkpoint.zzz", "allowed here: every_minutes, every_steps, filename, keep,"),
        ("callbacks.early_stopping.zzz", "allowed here: min_delta, mode, monitor, patience,"),
        ("callbacks.reduce_lr_on_plateau.zzz", "allowed here: cooldown, factor, min_delta,"),
        ("train.learning_rate.zzz", "allowed here: base, base_batch_size, scaling,"),
        ("data.features.x.zzz", "allowed here: cast, dtype, key, normalize, shape, type"),
    ],
)
def test_unknown_key_lists_what_is_allowed_in_every_section(tmp_path, key, allowed):
    """Optional sections (``X | None``) and union members list their keys, not an empty list."""
    [problem] = problems(tmp_path, GOOD, [f"{key}=1"])
    assert f"--set {key}=1: unknown key '{key}'; {allowed}" in problem


def test_a_feature_without_type_takes_options_only(tmp_path):
    """Its type comes from the schema file when the data is resolved (tests/data/test_categories.py);
    here only its keys are checked, and a wrong one lists the options."""
    [problem] = problems(tmp_path, GOOD, ["data.features.z={normalize: true, zzz: 1}"])
    assert problem == (
        "--set data.features.z={normalize: true, zzz: 1}: unknown key 'data.features.z.zzz'; "
        "allowed here: cast, dtype, encode, key, normalize, scale, shape, vocabulary"
    )


def test_every_problem_is_reported_at_once(tmp_path):
    text = (
        GOOD.replace("  backend: auto", "  backend: torch")
        .replace("  epochs: 100", "  epochs: ten")
        .replace("seed: 42", "sed: 42")
        .replace(
            "type: raw, dtype: float32, shape: [1024]", "type: rawx, dtype: float32, shape: [1024]"
        )
    )
    found = problems(tmp_path, text)
    assert len(found) == 4, found
    joined = "\n".join(found)
    assert ":3: unknown key 'sed'; did you mean 'seed'?" in joined
    assert ":27: train.epochs:" in joined and "received 'ten'" in joined
    assert ":20: data.features.x.type: unknown feature type 'rawx'; did you mean 'raw'?" in joined


def test_the_seed_callback_keys_load_with_their_seed_meaning(tmp_path):
    """Issue 2's config: ``csv_log: {append: true}`` and ``terminate_on_nan: true``."""
    seed_form = GOOD.replace("csv_log: {filename: log.csv}", "csv_log: {append: true}")
    seed_form = seed_form.replace("  on_nan: stop", "  terminate_on_nan: true")
    config = load_config(write(tmp_path, seed_form))
    assert config.callbacks.on_nan == "stop" and config.callbacks.csv_log.filename == "log.csv"
    # recorded as on_nan in the run's config.yaml, which loads back
    assert "terminate_on_nan" not in config.to_dict()["callbacks"]
    assert "append" not in config.to_dict()["callbacks"]["csv_log"]
    ignore = load_config(write(tmp_path, seed_form.replace("nan: true", "nan: false")))
    assert ignore.callbacks.on_nan == "ignore"
    both = load_config(write(tmp_path, GOOD), ["callbacks.terminate_on_nan=true"])
    assert both.callbacks.on_nan == "stop"


def test_terminate_on_nan_that_disagrees_with_on_nan_is_an_error_at_its_line(tmp_path):
    text = GOOD.replace("  on_nan: stop", "  on_nan: restore\n  terminate_on_nan: true")
    [problem] = problems(tmp_path, text)
    line = text.splitlines().index("  terminate_on_nan: true") + 1
    assert problem.startswith(f"{tmp_path / 'exp.yaml'}:{line}: callbacks.terminate_on_nan: ")
    assert "disagrees with callbacks.on_nan: restore" in problem
    assert "terminate_on_nan: true means on_nan: stop" in problem
    [problem] = problems(tmp_path, GOOD, ["callbacks.terminate_on_nan=false"])
    assert "--set callbacks.terminate_on_nan=false: " in problem and "on_nan: ignore" in problem


def test_csv_log_append_false_is_refused_with_what_to_do(tmp_path):
    text = GOOD.replace("{filename: log.csv}", "{append: false}")
    [problem] = problems(tmp_path, text)
    line = text.splitlines().index("  csv_log: {append: false}") + 1
    assert problem.startswith(f"{tmp_path / 'exp.yaml'}:{line}: callbacks.csv_log.append: false ")
    assert "a resumed run continues it" in problem and "--restart" in problem
    [problem] = problems(tmp_path, GOOD, ["callbacks.csv_log.append=maybe"])
    assert "callbacks.csv_log.append: Input should be a valid boolean" in problem


def test_missing_required_key(tmp_path):
    # model.loss may be left out (the factory's own compile supplies it); model.factory may not,
    # unless a model.preset stands in for it.
    text = GOOD.replace("  factory: models/recognizer.py:build\n", "")
    [problem] = problems(tmp_path, text)
    assert "model: set one of model.factory" in problem and "model.preset" in problem
    assert "neither is set" in problem


def test_invalid_yaml_reports_line_and_column(tmp_path):
    text = GOOD.replace("  epochs: 100", "  epochs: [100")
    [problem] = problems(tmp_path, text)
    assert "not valid YAML" in problem
    assert f"{tmp_path / 'exp.yaml'}:" in problem


def test_duplicate_keys_are_errors(tmp_path):
    text = GOOD.replace("seed: 42", "seed: 42\nseed: 43")
    [problem] = problems(tmp_path, text)
    assert ":4: duplicate key 'seed'" in problem


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(write(tmp_path, "# only a comment\n"))
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_overrides_are_typed_and_located(tmp_path):
    path = write(tmp_path, GOOD)
    config = load_config(path, ["train.epochs=3", "train.learning_rate.schedule=cosine",
                                "callbacks.reduce_lr_on_plateau=null", "data.train=[a/*.tfrecord, b/*.tfrecord]"])  # fmt: skip
    assert config.train.epochs == 3
    assert config.train.learning_rate.schedule == "cosine"
    assert config.data.train == ["a/*.tfrecord", "b/*.tfrecord"]
    with pytest.raises(ConfigError) as info:
        load_config(path, ["train.epochs=three", "train.epoch=3", "runtime.cpu_devices=0"])
    joined = "\n".join(info.value.problems)
    assert "--set train.epochs=three: train.epochs:" in joined
    assert "--set train.epoch=3: unknown key 'train.epoch'; did you mean 'epochs'?" in joined
    assert (
        "--set runtime.cpu_devices=0: runtime.cpu_devices: Input should be greater than or equal to 1"
        in joined
    )


@pytest.mark.parametrize(
    ("item", "kind", "problem"),
    [
        ("data.train=[a/*.tfrecord, b/*.tfrecord", "list", "expected ',' or ']'"),
        ("model.kwargs={units: 3", "mapping", "expected ',' or '}'"),
        ("model.kwargs={units: [3}", "mapping", "expected ',' or ']'"),
        ("name='quoted", "quoted string", "unexpected end of stream"),
        ('data.train="a/*.tfrecord', "quoted string", "unexpected end of stream"),
    ],
)
def test_an_override_that_starts_like_yaml_and_does_not_parse_is_an_error(item, kind, problem):
    with pytest.raises(ConfigError) as info:
        load_config({"name": "x"}, [item])
    [message] = info.value.problems
    assert message.startswith(f"--set {item}: the value starts like a YAML {kind} but does not ")
    assert problem in message and "quote the whole value" in message


@pytest.mark.parametrize(
    ("item", "value"),
    [
        ("data.train=*.tfrecord", "*.tfrecord"),  # YAML would read '*' as an alias
        ("data.train=gs://bucket/x-*.tfrecord", "gs://bucket/x-*.tfrecord"),
        ("data.train=a: b: c", "a: b: c"),
        ("data.train=[a, b]", ["a", "b"]),
        ("data.train='[a, b'", "[a, b"),  # quoted: the text itself
    ],
)
def test_other_override_values_are_read_as_yaml_or_kept_as_text(item, value):
    from tpurun.config import parse_override

    assert parse_override(item) == (["data", "train"], value)


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config({"name": "x"}, ["train.epochs"])


def test_steps_accept_auto_or_positive_integers(tmp_path):
    path = write(tmp_path, GOOD)
    assert load_config(path, ["train.steps_per_execution=auto"]).train.steps_per_execution == "auto"
    for bad in ("0", "-1", "fast", "1.5", "true"):
        with pytest.raises(ConfigError, match="expected 'auto' or an integer >= 1"):
            load_config(path, [f"train.steps_per_execution={bad}"])


def test_batch_size_given_twice(tmp_path):
    with pytest.raises(
        ConfigError, match="give per_core_batch_size or global_batch_size, not both"
    ):
        load_config(write(tmp_path, GOOD), ["train.global_batch_size=128"])


def test_plateau_cannot_drive_a_schedule(tmp_path):
    with pytest.raises(ConfigError, match="reduce_lr_on_plateau cannot change a scheduled"):
        load_config(write(tmp_path, GOOD), ["train.learning_rate.schedule=cosine"])


def test_feature_type_rules(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(ConfigError, match="channels .* must be 1, 3 or 4"):
        load_config(path, ["data.features.x={type: image, shape: [32, 32, 2]}"])
    with pytest.raises(ConfigError, match="data.features.y.dtype"):
        load_config(path, ["data.features.y.dtype=complex64"])
    config = load_config(path, ["data.features.x={type: image, shape: [32, 32, 3]}"])
    assert config.data.features["x"].scale is True


def test_checkpoint_filename_pattern(tmp_path):
    path = write(tmp_path, GOOD)
    ok = load_config(path, ["callbacks.checkpoint.filename='ep{epoch:03d}_loss{loss:.4f}.keras'"])
    assert ok.callbacks.checkpoint.filename == "ep{epoch:03d}_loss{loss:.4f}.keras"
    with pytest.raises(ConfigError, match="must end in .keras"):
        load_config(path, ["callbacks.checkpoint.filename=model.pb"])


def test_named_objects_round_trip_in_the_users_form(tmp_path):
    config = load_config(write(tmp_path, GOOD), [
        "model.loss={name: binary_crossentropy, from_logits: true}",
        "model.metrics=[accuracy, {name: AUC, curve: PR}]",
    ])  # fmt: skip
    data = config.to_dict()
    assert data["model"]["loss"] == {"name": "binary_crossentropy", "from_logits": True}
    assert data["model"]["metrics"] == ["accuracy", {"name": "AUC", "curve": "PR"}]
    assert data["model"]["optimizer"] == "adam"


def test_resolved_config_with_derived_section_loads_again(tmp_path):
    config = load_config(write(tmp_path, GOOD))
    dumped = {**config.to_dict(), "derived": {"replicas": 8, "global_batch_size": 128}}
    again = write(tmp_path, yaml.safe_dump(dumped, sort_keys=False), "again.yaml")
    assert load_config(again).to_dict() == config.to_dict()


def test_name_defaults_to_file_stem(tmp_path):
    text = GOOD.replace(
        "name: naic-recognizer            # run directory = <output.dir>/<name>\n", ""
    )
    assert load_config(write(tmp_path, text, "my-exp.yaml")).name == "my-exp"


def test_dict_configs_and_defaults():
    config = load_config({"model": {"factory": "m:f", "loss": "mse"},
                          "data": {"train": "a", "features": {"x": {"type": "float"}}, "inputs": "x", "targets": "x"}})  # fmt: skip
    assert isinstance(config, Config)
    assert config.train.per_core_batch_size is None and config.train.global_batch_size is None
    assert config.train.steps_per_execution == "auto"
    assert config.callbacks.checkpoint.monitor == "auto"
    assert config.callbacks.reduce_lr_on_plateau is None


@pytest.mark.slow
def test_validation_imports_no_framework(tmp_path):
    path = write(tmp_path, GOOD)
    code = (
        "import sys; from tpurun.config import load_config; load_config(sys.argv[1]);"
        "import tpurun.cli.app;"
        "heavy = [m for m in ('tensorflow', 'jax', 'keras') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_time_limit_durations(tmp_path):
    path = write(tmp_path, GOOD)
    assert load_config(path, ["train.time_limit=8h45m"]).train.time_limit == 31500
    assert load_config(path, ["train.time_limit=90"]).train.time_limit == 90
    for bad in ("soon", "0s", "5d"):
        with pytest.raises(ConfigError, match="train.time_limit: expected a"):
            load_config(path, [f"train.time_limit={bad}"])


def test_output_dir_takes_a_bucket_and_refuses_other_schemes(tmp_path):
    from helpers import toy_config

    config = toy_config(tmp_path, tmp_path, output={"dir": "gs://bucket/runs"})
    assert load_config(config).output.dir == "gs://bucket/runs"
    for bad, says in (
        ("s3://bucket/runs", "'s3://' is not supported"),
        ("gs:///runs", "name the bucket"),
    ):
        config = toy_config(tmp_path, tmp_path, output={"dir": bad})
        with pytest.raises(ConfigError, match=rf"output.dir: .*{says}"):
            load_config(config)
