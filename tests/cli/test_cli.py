"""The `tpurun` command: CliRunner for the fast paths, real subprocesses for real runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers import (
    FACTORIES,
    ROOT,
    TPURUN,
    cli_env,
    logged_epochs,
    read_latest,
    read_summary,
    run_cli,
    start_cli,
    toy_config,
    write_config,
)
from typer.testing import CliRunner

from tpurun.cli.app import app
from tpurun.config import load_config
from tpurun.errors import ConfigError

runner = CliRunner()
ANSI = re.compile(r"\x1b\[")


def test_help_and_version():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "train" in result.output and "config" in result.output
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == "tpurun 0.1.0"


def test_every_exit_code_is_in_the_docs_table_and_the_cli_docstring():
    """One table, one column per kind of command: doctor's 1 (a check failed) is documented."""
    import tpurun.cli.app
    from tpurun import errors

    codes = {0} | {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    page = (ROOT / "docs" / "exit-codes.md").read_text()
    table = page[page.index("| code |") :].split("\n\n")[0]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert {int(row[0].strip("| ")) for row in rows} == codes == {0, 1, 2, 3, 130}
    assert table.splitlines()[0] == "| code | `train`, `config`, `data ...` | `doctor` |"
    assert "a check failed" in dict((int(r[0].strip("| ")), r[2]) for r in rows)[1]
    for code in codes:
        assert f" {code} " in tpurun.cli.app.__doc__.replace("\n", " "), code


def test_the_docs_commands_table_is_one_table_naming_every_command():
    """A blank line inside it split it: the rows after it rendered as raw pipe text."""
    page = (ROOT / "docs" / "commands.md").read_text()
    table = page[page.index("| command | what it does |") :].split("\n\n")[0].splitlines()
    assert all(line.startswith("|") for line in table)
    commands = {line.split("`")[1].split()[1] for line in table[2:]}
    registered = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert commands == registered | {"data", "--version"}, commands


@pytest.mark.slow
def test_help_imports_no_framework():
    code = (
        "import sys; sys.argv = ['tpurun', '--help'];\n"
        "from tpurun.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('tensorflow', 'jax', 'keras') if m in sys.modules]\n"
        "sys.stderr.write(repr(heavy)); sys.exit(3 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr  # exit 3 lists the framework that was imported


def test_config_errors_exit_2_with_every_problem_and_no_traceback(tmp_path, toy_data):
    config = toy_config(toy_data, tmp_path / "runs")
    config["train"]["epoch"] = 3
    config["runtime"]["backend"] = "torch"
    path = write_config(tmp_path, config)
    result = runner.invoke(app, ["train", str(path)])
    assert result.exit_code == 2
    assert "invalid config (2 problems)" in result.output
    assert "unknown key 'train.epoch'; did you mean 'epochs'?" in result.output
    assert f"{path}:" in result.output
    assert "Traceback" not in result.output


def test_missing_config_file_and_bad_set():
    result = runner.invoke(app, ["train", "nope.yaml"])
    assert result.exit_code == 2 and "nope.yaml: no such file" in result.output
    result = runner.invoke(app, ["config", "nope.yaml", "--set", "novalue"])
    assert result.exit_code == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "needs"),
    [
        (["data", "write", "$TMP/arrays.npz", "$TMP/out/shards"], False),
        (["data", "inspect", "$DATA/train-*.tfrecord"], False),
        (["config", "$CONFIG"], False),
        (["data", "bench", "$CONFIG", "--steps", "2", "--set", "data.reader=tf_data"], True),
        (["train", "$CONFIG", "--set", "data.reader=tf_data"], True),
    ],
    ids=lambda command: " ".join(command[:2]) if isinstance(command, list) else str(command),
)
def test_a_broken_tensorflow_is_a_message_not_a_traceback(tmp_path, toy_data, command, needs):
    """TensorFlow that fails its own import (a broken wheel, a protobuf clash) exits 2 with what to
    check, whichever command needed it first; the commands that need none never import it, so
    they work."""
    import numpy as np

    broken = tmp_path / "broken" / "tensorflow"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "raise ImportError('libtensorflow_framework.so.2: cannot open shared object file')\n"
    )
    np.savez(tmp_path / "arrays.npz", x=np.zeros((8, 2), np.float32), y=np.zeros(8, np.int64))
    path = write_config(tmp_path, toy_config(toy_data, tmp_path / "runs"))
    fill = {"$TMP": str(tmp_path), "$DATA": str(toy_data), "$CONFIG": str(path)}
    args = [
        fill.get(head, head) + sep + tail for head, sep, tail in (a.partition("/") for a in command)
    ]
    result = run_cli(*args, env={"PYTHONPATH": str(broken.parent)}, timeout=120)
    if not needs:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "cannot be imported" not in result.stdout + result.stderr
        return
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "unexpected failure" not in result.stderr
    assert result.stderr.startswith(
        "error: TensorFlow cannot be imported (ImportError: libtensorflow_framework.so.2: "
    ), result.stderr
    assert "python -c 'import tensorflow'" in result.stderr and "tpurun doctor" in result.stderr


@pytest.mark.parametrize(
    ("args", "meant"),
    [
        (["config", "$CONFIG", "--set", "train.epochs", "3"], "--set train.epochs=3"),
        (["train", "$CONFIG", "-s", "data.train", "[a, b]"], "--set 'data.train=[a, b]'"),
        (["doctor", "--set=train.epochs", "3", "$CONFIG"], "--set train.epochs=3"),
        (["train", "--set", "train.epochs", "$CONFIG"], "--set train.epochs=VALUE"),
        (["data", "bench", "$CONFIG", "--set", "train.epochs"], "--set train.epochs=VALUE"),
        (["config", "$CONFIG", "--set", "train.epochs", "--json"], "--set train.epochs=VALUE"),
    ],
)
def test_set_without_equals_says_key_equals_value(tmp_path, args, meant):
    """`--set KEY VALUE` would be Typer's "unexpected extra argument"; say what --set takes."""
    path = write_config(tmp_path, toy_config(tmp_path, tmp_path / "runs"))
    result = runner.invoke(app, [str(path) if a == "$CONFIG" else a for a in args])
    assert result.exit_code == 2, result.output
    assert "unexpected extra argument" not in result.output
    key = meant.split()[1].strip("'").split("=")[0]
    assert f"takes KEY=VALUE as one argument, and '{key}' has no '='; did you mean {meant}?" in (
        result.output
    )
    assert not (tmp_path / "runs").exists()


def test_set_with_equals_still_works_beside_a_bad_one(tmp_path):
    path = write_config(tmp_path, toy_config(tmp_path, tmp_path / "runs"))
    ok = runner.invoke(app, ["config", str(path), "--check", "--json", "-s", "train.epochs=3"])
    assert ok.exit_code == 0 and json.loads(ok.output)["train"]["epochs"] == 3
    bad = runner.invoke(app, ["config", str(path), "--set", "data.train=[a, b", "--check"])
    assert bad.exit_code == 2 and "starts like a YAML list but does not parse" in bad.output


def _frameworks_shut(monkeypatch) -> None:
    """--check answers without TensorFlow, JAX or Keras: asking for one fails the test."""
    from tpurun import frameworks

    for name in ("tensorflow", "jax", "keras"):
        monkeypatch.setattr(frameworks, name, lambda *a, n=name, **k: pytest.fail(f"{n} asked for"))


def test_config_check_says_valid_and_what_it_checked(tmp_path, monkeypatch):
    _frameworks_shut(monkeypatch)
    path = write_config(tmp_path, toy_config(tmp_path, tmp_path / "runs"))
    result = runner.invoke(app, ["config", str(path), "--check", "--set", "train.epochs=7"])
    assert result.exit_code == 0 and result.output == (
        f"{path}: valid\n"
        f"  checked: its keys and values; {FACTORIES} compiles and defines mlp (not imported)\n"
        f"  not checked: the data, the model as built, this machine (`tpurun doctor {path}`)\n"
    )


@pytest.mark.parametrize(
    ("factory", "source", "expected"),
    [
        ("model.py:build", "def build(:\n    pass\n",
         "model.factory 'model.py:build': $DIR/model.py does not compile: SyntaxError: invalid "
         "syntax (at $DIR/model.py:1, `def build(:`)"),
        ("model.py:biuld", "import keras\n\ndef build():\n    return keras.Sequential()\n",
         "model.factory 'model.py:biuld': $DIR/model.py defines no 'biuld'. Did you mean 'build'?"),
        ("models.nets:build", None,
         "model.factory 'models.nets:build': $DIR/models/nets.py does not compile: "
         "IndentationError: unexpected indent (at $DIR/models/nets.py:1, `x = 1`)"),
        ("gone.py:build", None, "model.factory 'gone.py:build': no such file $DIR/gone.py."),
    ],
    ids=["syntax-error", "misspelt-function", "module-path", "no-file"],
)  # fmt: skip
def test_config_check_compiles_the_factory_without_importing_it(
    tmp_path, monkeypatch, factory, source, expected
):
    _frameworks_shut(monkeypatch)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "nets.py").write_text("  x = 1\n")
    if source is not None:
        (tmp_path / "model.py").write_text(source)
    path = write_config(
        tmp_path, toy_config(tmp_path, tmp_path / "runs", model={"factory": factory})
    )
    result = runner.invoke(app, ["config", str(path), "--check"])
    assert result.exit_code == 2, result.output
    assert result.output == f"error: {expected.replace('$DIR', str(tmp_path))}\n"


def test_config_errors_have_one_prefix(tmp_path):
    """'invalid config: ' once, then where (a file's line) or the key itself: never 'config: '."""
    import numpy as np

    from tpurun.data.write import write_dataset

    arrays = tmp_path / "arrays.npz"
    np.savez(arrays, x=np.zeros((16, 2), np.float32), y=np.zeros(16, np.int64))
    write_dataset(str(arrays), str(tmp_path / "data" / "toy"), shard_multiple=1)
    config = toy_config(tmp_path, tmp_path / "runs")
    config["data"] = {"train": "data/toy-*.tfrecord", "inputs": "x", "targets": "z"}
    path = write_config(tmp_path, config)  # features come from the schema file, without 'z'
    result = runner.invoke(app, ["config", str(path)])
    assert result.exit_code == 2
    assert result.output.startswith(
        "error: invalid config: data.targets: 'z' is not a declared feature; declared: x, y"
    ), result.output
    # A config given as a dict (the Python API) has no file to name: its problems start with the key.
    with pytest.raises(ConfigError) as info:
        load_config({**config, "tran": {}})
    assert str(info.value) == "invalid config: unknown key 'tran'; did you mean 'train'?"


def test_config_check_json_is_instant(tmp_path, toy_data):
    path = write_config(tmp_path, toy_config(toy_data, tmp_path / "runs"))
    result = runner.invoke(
        app, ["config", str(path), "--check", "--json", "--set", "train.epochs=7"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["train"]["epochs"] == 7 and "derived" not in data


@pytest.mark.slow
def test_config_prints_derived_values(tmp_path, toy_data):
    path = write_config(
        tmp_path, toy_config(toy_data, tmp_path / "runs", runtime={"cpu_devices": 4})
    )
    result = run_cli("config", str(path), "--json")
    assert result.returncode == 0, result.stderr
    derived = json.loads(result.stdout)["derived"]
    assert derived["backend"] == "jax" and derived["replicas"] == 4
    assert derived["global_batch_size"] == 128 and derived["steps_per_epoch"] == 4
    assert derived["train_records"] == 512 and derived["validation_records"] == 128


@pytest.mark.slow
def test_tensorflow_multi_replica_with_steps_per_execution_is_refused(tmp_path, toy_data):
    config = toy_config(toy_data, tmp_path / "runs", runtime={"backend": "tensorflow", "cpu_devices": 2},
                        train={"steps_per_execution": 4})  # fmt: skip
    result = run_cli("train", str(write_config(tmp_path, config)))
    assert result.returncode == 2
    assert "keras-team/keras#19246" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_unexpected_failures_exit_1_with_the_traceback_in_the_run_directory(tmp_path, toy_data):
    config = toy_config(
        toy_data,
        tmp_path / "runs",
        callbacks={"extra": [f"{ROOT / 'tests' / 'factories.py'}:Exploding"]},
    )
    result = run_cli("train", str(write_config(tmp_path, config)))
    assert result.returncode == 1
    log = tmp_path / "runs" / "toy" / "error.log"
    assert f"the traceback is in {log}" in result.stderr
    assert "RuntimeError: boom" in log.read_text()
    assert read_summary(tmp_path / "runs" / "toy")["status"] == "failed"


@pytest.mark.slow
def test_notebook_cell_gets_plain_lines_even_on_a_pty(tmp_path, toy_data):
    """`!tpurun` in Jupyter runs on a pseudo-terminal with JPY_PARENT_PID set."""
    import os
    import pty

    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 1})
    path = write_config(tmp_path, config)
    env = cli_env(plain=False, JPY_PARENT_PID="1", TERM="xterm-color")
    controller, worker = pty.openpty()
    proc = subprocess.Popen([TPURUN, "train", str(path)], stdout=worker, stderr=worker, env=env,
                            cwd=ROOT)  # fmt: skip
    os.close(worker)
    chunks = []
    while True:
        try:
            data = os.read(controller, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    output = b"".join(chunks).decode()
    assert "[tpurun] epoch 1/1" in output
    assert not ANSI.search(output)
    assert "\r" not in output.replace("\r\n", "\n")  # the pty turns \n into \r\n; no bare \r


@pytest.mark.slow
def test_quickstart_reaches_95_percent(tmp_path):
    result = run_cli("train", "configs/quickstart.yaml", "--output", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["replicas"] == 8
    assert summary["backend"] == "jax" and summary["global_batch_size"] == 128
    assert summary["best"]["monitor"] == "val_accuracy" and summary["best"]["value"] >= 0.95


@pytest.mark.slow
def test_naic_like_example_runs_several_epochs_on_8_devices(tmp_path):
    """The second example, on data from its generator. Several epochs on 8 simulated devices with
    2 cores also guards against the Keras/XLA rendezvous abort an async_safe batch hook caused."""
    gen = subprocess.run(
        [sys.executable, "configs/data/make_naic_like.py", "--train", "4096", "--validation", "512", "--out", str(tmp_path / "naic")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    result = run_cli(
        "train", "configs/naic_like.yaml", "--output", str(tmp_path / "runs"),
        "--set", "train.epochs=4",
        "--set", f"data.train={tmp_path / 'naic'}/naic-train-*.tfrecord",
        "--set", f"data.validation={tmp_path / 'naic'}/naic-validation-*.tfrecord",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "runs" / "naic-like" / "summary.json").read_text())
    assert summary["epochs_completed"] == 4 and summary["replicas"] == 8
    assert summary["steps_per_execution"] == 32 and summary["final_metrics"]["val_accuracy"] > 0.8


@pytest.mark.slow
def test_the_time_limit_then_sigterm_each_exit_3_and_each_rerun_continues(tmp_path, toy_data):
    """One run directory, three sessions of the console script: --time-limit runs out (exit 3),
    the same command resumes where it stopped and is stopped by SIGTERM (exit 3), and the same
    command again finishes: each epoch logged once."""
    import signal

    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 400})
    path = write_config(tmp_path, config)
    run_dir = tmp_path / "runs" / "toy"

    limited = run_cli("train", str(path), "--time-limit", "4s")
    assert limited.returncode == 3, limited.stdout + limited.stderr
    assert "stopped: train.time_limit: stopped at" in limited.stderr
    assert "Run the same command again to continue" in limited.stderr
    state = read_latest(run_dir)
    assert (state["epoch"], state["step"]) > (0, 0)  # past the start, saved where it stopped
    assert read_summary(run_dir)["status"] == "interrupted"
    at = f"epoch {state['epoch'] + 1}" + (f", step {state['step']}" if state["step"] else "")

    proc = start_cli("train", str(path))  # the same command: no time limit this time
    resumed, seen = False, []
    for line in proc.stdout:  # until it trains an epoch past the one it resumed in
        seen.append(line)
        resumed = resumed or f"resuming at {at} from" in line
        words = line.split()
        if words[:2] == ["[tpurun]", "epoch"] and int(words[2].split("/")[0]) >= state["epoch"] + 3:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert resumed, "".join(seen)
    assert proc.returncode == 3, err
    assert "stopped: SIGTERM: stopped at" in err and "Run the same command again to continue" in err
    summary, stopped = read_summary(run_dir), read_latest(run_dir)
    assert summary["status"] == "interrupted"
    assert summary["epochs_completed"] == stopped["epoch"] >= state["epoch"] + 2

    config["train"]["epochs"] = stopped["epoch"] + 2
    result = run_cli("train", str(write_config(tmp_path, config)))
    assert result.returncode == 0, result.stderr
    assert f"resuming at epoch {stopped['epoch'] + 1}" in result.stdout
    assert logged_epochs(run_dir) == [str(i) for i in range(stopped["epoch"] + 2)]  # once each
    assert [(r["epoch"], r["step"]) for r in read_summary(run_dir)["resumes"]] == [
        (state["epoch"], state["step"]), (stopped["epoch"], stopped["step"])]  # fmt: skip
