"""tpurun doctor: each check on fake machines, the libtpu lock held by a child, and a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from types import SimpleNamespace

import pytest
from helpers import HAS_TENSORFLOW, installed_tensorflow_build, toy_config

from tpurun.config import RuntimeConfig, load_config
from tpurun.doctor import Check, config_uses_gcs, exit_code, libtpu_lock, probes, report, run_checks
from tpurun.doctor import config_checks as cc
from tpurun.doctor import machine as mc
from tpurun.doctor.child import Child
from tpurun.doctor.gcs import GcsProbe
from tpurun.errors import ConfigError
from tpurun.runtime.choice import Choice
from tpurun.runtime.machine import Machine, probe


def fake_dev(tmp_path, *names):
    root = tmp_path / "dev"
    (root / "vfio").mkdir(parents=True)
    for name in names:
        (root / name).write_text("")
    return str(root)


# ---------------------------------------------------------------------------------- platform
@pytest.mark.parametrize(
    ("env", "files", "platform", "status"),
    [
        ({}, (), "CPU machine", "ok"),
        ({}, ("nvidia0", "nvidiactl"), "GPU machine", "ok"),
        ({}, ("accel0",), "Cloud TPU VM", "ok"),
        ({}, ("vfio/0",), "Cloud TPU VM", "ok"),
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "ISTPUVM": "1"}, (), "Kaggle TPU VM", "ok"),
        ({"COLAB_TPU_1VM": "1", "COLAB_RELEASE_TAG": "x"}, (), "Colab TPU VM", "ok"),
        ({"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, (), "Kaggle CPU machine", "ok"),
        ({"TPU_NAME": "grpc://10.0.0.2:8470"}, (), "legacy TPU node", "warn"),
    ],
)
def test_platform(tmp_path, env, files, platform, status):
    machine = probe(env, fake_dev(tmp_path, *files))
    check = mc.check_platform(machine, env)
    assert (check.data["platform"], check.status) == (platform, status)
    assert (check.fix is None) == (status == "ok")


# ---------------------------------------------------------------------------------- versions
@pytest.mark.skipif(not HAS_TENSORFLOW, reason="names the TensorFlow build installed")
def test_versions_ok_here():
    check = mc.check_versions(probe({}, "/nonexistent"))
    assert check.status == "ok"
    assert check.data["versions"]["keras"].startswith("3.")
    # The build is named: tensorflow-cpu, or tensorflow where the hub extra's tensorflow-text
    # pulled the full wheel in beside it (both install the same package), with its version.
    build = installed_tensorflow_build()
    assert check.data["versions"]["tensorflow_build"] == build
    assert f"{build} {version(build)}, " in check.finding, check.finding


def test_versions_tpu_without_libtpu_fails_with_pip_command():
    m = Machine(env={"ISTPUVM": "1"}, tensorflow="2.20.0", tensorflow_build="tensorflow-cpu",
                jax="0.10.2", keras="3.15.1")  # fmt: skip
    check = mc.check_versions(m)
    assert check.status == "fail"
    assert check.fix == "pip install -U 'jax[tpu]'"


def test_versions_keras2_fails_and_a_missing_tensorflow_does_not():
    check = mc.check_versions(Machine(jax="0.10.2", keras="2.15.0"))
    assert check.status == "fail"
    assert "Keras 2" in check.finding
    assert "TensorFlow" not in check.finding
    assert mc.check_versions(Machine(jax="0.10.2", keras="3.15.1")).status == "ok"


# --------------------------------------------------------------------------------------- tpu
def test_tpu_paths():
    assert mc.check_tpu(Machine(), {}).status == "skip"
    tpu_vm = Machine(env={"ISTPUVM": "1"}, jax="0.10.2", jax_tpu=True, keras="3.15.1")
    ok = mc.check_tpu(tpu_vm, {"jax": {"platforms": {"tpu": 8}}})
    assert ok.status == "ok" and "8 TPU core" in ok.finding
    busy = mc.check_tpu(tpu_vm, {"jax": {"error": "TPU is already in use by process with pid 7"}})
    assert busy.status == "fail" and "libtpu_lock" in busy.fix
    nobody = mc.check_tpu(Machine(env={"ISTPUVM": "1"}, jax="0.10.2", tensorflow="2.21.0",
                                  tensorflow_build="tensorflow-cpu"), {})  # fmt: skip
    assert nobody.status == "fail" and "jax[tpu]" in nobody.fix


# -------------------------------------------------------------------------------------- lock
def test_lock_absent_and_stale(tmp_path):
    lock = tmp_path / "libtpu_lockfile"
    absent = libtpu_lock.check_lock(str(lock))
    assert absent.status == "ok" and absent.data["exists"] is False
    lock.write_text("")
    stale = libtpu_lock.check_lock(str(lock))
    assert stale.status == "ok" and "stale" in stale.finding and stale.data["held"] is False


HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "a+")
if sys.argv[2] == "flock":
    fcntl.flock(f, fcntl.LOCK_EX)
else:
    fcntl.lockf(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flock", "lockf"])
def test_lock_held_by_a_child_names_it(tmp_path, kind):
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), kind],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        check = libtpu_lock.check_lock(str(lock))
    finally:
        holder.kill()
        holder.wait()
    assert check.status == "fail"
    assert holder.pid in [h["pid"] for h in check.data["holders"]]
    assert f"pid {holder.pid}" in check.finding and "-c" in check.finding
    assert "restart" in check.fix and "kernel" in check.fix
    # doctor released whatever it tried: the file is free again once the holder is gone
    assert libtpu_lock.check_lock(str(lock)).status == "ok"


# ----------------------------------------------------------------------------------- devices
def test_devices_paths():
    ok = mc.check_devices({"jax": {"platforms": {"cpu": 8}}, "tensorflow": {"platforms": {"cpu": 1}},
                           "gpus": [{"name": "NVIDIA T4", "memory": "15360 MiB"}]})  # fmt: skip
    assert ok.status == "ok" and "8 CPU" in ok.finding and "T4 (15360 MiB)" in ok.finding
    part = mc.check_devices({"jax": {"error": "timed out after 60 s", "timed_out": True},
                             "tensorflow": {"platforms": {"cpu": 1}}})  # fmt: skip
    assert part.status == "warn" and "timed out" in part.finding
    assert mc.check_devices({"jax": {"error": "boom"}}).status == "fail"
    assert mc.check_devices({}).status == "skip"


# ------------------------------------------------------------------------------ choice, health
def test_choice_calls_runtime_choose():
    holder: list = []
    check = probes.check_choice(None, probe({}, "/nonexistent"), holder)
    assert check.status == "ok" and holder and holder[0].accelerator == "cpu"
    assert check.data["reason"] in check.finding

    class Cfg:  # only the two fields choose() reads
        runtime = RuntimeConfig(accelerator="tpu")
        train = type("T", (), {"steps_per_execution": "auto"})

    failed = probes.check_choice(Cfg, probe({}, "/nonexistent"), [])
    assert failed.status == "fail" and "no TPU" in failed.finding


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "distribution"), [("jax", "data_parallel"),
                                                         ("tensorflow", "mirrored")])  # fmt: skip
def test_health_all_reduce_agrees_over_replicas(backend, distribution):
    choice = Choice(backend, "cpu", distribution, 4, "float32", "test", cpu_devices=4)
    check = probes.check_health([choice], timeout=60)
    assert check.status == "ok", check.finding
    assert check.data["replicas"] == 4 and check.data["agree"]
    assert check.data["platform"] == "cpu"
    assert probes.check_health([], 60).status == "skip"
    tpu = Choice("tensorflow", "tpu", "tpu_strategy", None, "mixed_bfloat16", "test")
    assert probes.check_health([tpu], 60).status == "skip"


@pytest.mark.slow
def test_a_child_that_hangs_is_reported_as_timed_out():
    result = Child(["-c", "import time; time.sleep(30)"], timeout=1).result()
    assert result["timed_out"] and "timed out after 1 s" in result["error"]


# --------------------------------------------------------------------------------------- gcs
def test_gcs_credentials(tmp_path):
    key = tmp_path / "key.json"
    key.write_text('{"private_key": "SECRET"}')
    m = Machine()
    found = mc.check_gcs_credentials(m, {"GOOGLE_APPLICATION_CREDENTIALS": str(key)}, True)
    assert found.status == "ok" and str(key) in found.finding
    assert "SECRET" not in json.dumps(found.data)
    home = tmp_path / "home"
    (home / ".config" / "gcloud").mkdir(parents=True)
    (home / ".config" / "gcloud" / "application_default_credentials.json").write_text("{}")
    assert "gcloud" in mc.check_gcs_credentials(m, {"HOME": str(home)}, True).finding
    none = mc.check_gcs_credentials(m, {"HOME": str(tmp_path)}, uses_gcs=True)
    assert none.status == "warn" and "GOOGLE_APPLICATION_CREDENTIALS" in none.fix
    kaggle = mc.check_gcs_credentials(m, {"HOME": str(tmp_path), "KAGGLE_KERNEL_RUN_TYPE": "x"},
                                      False)  # fmt: skip
    assert kaggle.status == "ok" and "Kaggle" in kaggle.finding


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again on return: connections are refused


@pytest.mark.slow
def test_gcs_probe_refused_fails_a_config_that_needs_gcs_and_warns_otherwise():
    endpoint = ("127.0.0.1", _closed_port())
    check = GcsProbe(5.0, endpoint=endpoint).check(uses_gcs=True)
    # Refused at connect: the probe says so, not that it timed out after 5 s.
    assert check.status == "fail", check
    assert check.finding.startswith(f"GCS is not reachable: 127.0.0.1:{endpoint[1]}: ")
    assert "Connection refused" in check.finding and check.data["stage"] == "connect"
    assert check.data["url"].startswith("gs://")
    # No config (uses_gcs None): the same finding is a warning, not a failure.
    check = GcsProbe(5.0, endpoint=endpoint).check(uses_gcs=None)
    assert check.status == "warn" and "not reachable" in check.finding


@pytest.mark.slow
def test_gcs_probe_is_bounded_by_its_timeout(monkeypatch):
    import socket

    with socket.socket() as server:  # accepts connections into its backlog, never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        host, port = server.getsockname()
        # The storage client talks to this silent server too (as to an emulator), so nothing but
        # the probe's timeout can end it, with or without a network and a resolver on this machine.
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://{host}:{port}")
        check = GcsProbe(1.0).check(uses_gcs=True)
    # The probe's own timeout ended it, and it says so: not a refusal, not a failed read.
    assert check.status == "fail" and check.finding == (
        "GCS did not answer: the probe timed out after 1 s"
    )
    assert check.data["timed_out"] is True, check.data  # the child was ended by the timeout


@pytest.mark.slow
def test_gcs_probe_ok_when_storage_answers():
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check = GcsProbe(60.0, url="ram://nothing-here", endpoint=server.getsockname())
        check = check.check(uses_gcs=True)
    assert check.status == "ok", check
    assert "(ram://nothing-here exists: False)" in check.finding


@pytest.mark.parametrize(
    ("overrides", "uses"),
    [
        ([], False),
        (["data.validation=gs://bucket/val-*.tfrecord"], True),
        (["data.cache=gs://bucket/cache/train"], True),
        (["output.dir=gs://bucket/runs"], True),
        (["data.kaggle_dataset=owner/name", "data.train=train-*.tfrecord"], None),
        (["data.kaggle_dataset=owner/name"], False),  # absolute globs: read as they are
    ],
)
def test_which_configs_need_gcs(tmp_path, overrides, uses):
    assert config_uses_gcs(load_config(toy_config(tmp_path, tmp_path / "out"), overrides)) is uses


# --------------------------------------------------------------------------- config checks
def test_data_mismatch_and_tpu_node_local_paths(toy_data, tmp_path):
    cfg = load_config(toy_config(toy_data, tmp_path / "out"),
                      ["data.features.x.shape=[9]"])  # fmt: skip
    checks = cc.data_checks(cfg, probe({}, "/nonexistent"), 1)
    assert checks[0].status == "fail" and "x" in checks[0].finding
    good = load_config(toy_config(toy_data, tmp_path / "out"))
    node = Machine(env={"TPU_NAME": "grpc://10.0.0.2:8470"})
    check = cc.check_split(good, "train", node, 8)
    assert check.status == "fail" and "gs://" in check.fix
    few = cc.check_split(good, "train", Machine(), 8)
    assert few.status == "warn" and "fewer files than the 8 replicas" in few.finding
    from test_data_cli import suggested_commands  # parses each with the real CLI

    assert suggested_commands(few.fix) == ["tpurun data write SOURCE OUT_PREFIX --shard-multiple 8"]
    missing = load_config(toy_config(toy_data, tmp_path / "out"), ["data.train=nowhere-*.rec"])
    assert cc.data_checks(missing, Machine(), 1)[0].status == "fail"


def test_advice_and_output(toy_data, tmp_path):
    cfg = load_config(toy_config(toy_data, tmp_path / "out", train={"per_core_batch_size": 4}))
    choice = Choice("jax", "tpu", "data_parallel", None, "mixed_float16", "t")
    advice = cc.check_advice(cfg, choice, None)
    assert advice.status == "warn" and "below 8" in advice.finding
    assert "mixed_float16" in advice.finding and "128" in advice.fix
    tf_cpu = Choice("tensorflow", "cpu", "mirrored", 4, "float32", "t", cpu_devices=4)
    assert "keras#19246" in cc.check_advice(cfg, tf_cpu, None).finding
    assert cc.check_output(cfg, 1000).status == "ok"
    # An output dir under a regular file cannot be created (a mode-based test fails as root).
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    blocked = load_config(toy_config(toy_data, blocker / "runs"))
    assert cc.check_output(blocked, 1000).status == "fail"


def test_config_error_propagates(tmp_path):
    with pytest.raises(ConfigError, match="tran"):
        run_checks({"tran": {}, "model": {"factory": "x:y"}, "data": {}}, gcs_timeout=1)


# ------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_run_with_config_on_toy_data(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "out")
    checks = run_checks(config, env={}, dev_root=fake_dev(tmp_path),
                        lock_path=str(tmp_path / "lock"), gcs_timeout=5)  # fmt: skip
    status = {c.name: c.status for c in checks}
    for name in ("platform", "versions", "libtpu_lock", "devices", "choice", "health", "config",
                 "data.train", "data.validation", "plan", "output", "model", "advice"):  # fmt: skip
        assert status[name] == "ok", [c for c in checks if c.name == name]
    assert status["tpu"] == "skip"
    gcs = next(c for c in checks if c.name == "gcs.reachable")
    assert (gcs.status, gcs.finding) == ("skip", "not needed: no gs:// path in this config")
    model = next(c for c in checks if c.name == "model")
    assert model.data["params"] == 161
    plan = next(c for c in checks if c.name == "plan")
    assert plan.data["global_batch_size"] == 32
    data = json.loads(json.dumps(report(checks)))
    assert data["version"] == 1 and data["exit_code"] == exit_code(checks) == 0
    assert [c["name"] for c in data["checks"]] == [c.name for c in checks]
    assert all(set(c) >= {"name", "status", "finding", "fix", "data", "seconds"}
               for c in data["checks"])  # fmt: skip


def test_exit_code_and_report():
    checks = [Check("a", "ok", "fine"), Check("b", "warn", "hmm", "do x")]
    assert exit_code(checks) == 0 and report(checks)["status"] == "warn"
    checks.append(Check("c", "fail", "bad", "do y"))
    assert exit_code(checks) == 1
    out = report(checks)
    assert out["counts"] == {"ok": 1, "warn": 1, "fail": 1, "skip": 0} and out["status"] == "fail"
    with pytest.raises(ValueError, match="status"):
        Check("d", "bad", "x")


def test_doctor_command_on_an_invalid_config_exits_2_before_any_check():
    from helpers import ROOT
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    result = CliRunner().invoke(app, ["doctor", quickstart, "--set", "train.epoch=3"])
    assert result.exit_code == 2 and "did you mean 'epochs'" in result.output


# ------------------------------------------------------------------- the command, in real processes
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_doctor_command_on_the_quickstart(backend):
    from helpers import run_cli

    result = run_cli(
        "doctor", "configs/quickstart.yaml", "--json", "--set", f"runtime.backend={backend}"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert report["version"] == 1
    # a fresh process, as `!tpurun doctor` is: the plan and the model step run as train would
    assert by_name["plan"]["status"] == "ok", by_name["plan"]
    assert by_name["model"]["status"] == "ok", by_name["model"]
    assert by_name["choice"]["data"]["backend"] == backend
    cache = by_name["compilation_cache"]
    if backend == "jax":  # the suite's folder (conftest.py), which a launch here would use
        assert cache["status"] == "ok", cache
        assert cache["data"]["folder"] == os.environ["JAX_COMPILATION_CACHE_DIR"]
    else:
        assert cache["status"] == "skip"


def test_the_compilation_cache_check_counts_the_programs_kept_or_says_why_there_are_none(tmp_path):
    from tpurun.doctor.cache_check import check_compilation_cache

    jax = SimpleNamespace(backend="jax")
    folder = tmp_path / "jax"
    folder.mkdir()
    (folder / "jit_step-1-cache").write_bytes(b"x" * 1000)
    (folder / "jit_step-1-atime").write_bytes(b"x" * 8)  # JAX's access times are not programs
    (folder / "jit_init-2-cache").write_bytes(b"x" * 500)
    check = check_compilation_cache(str(folder), jax)
    assert (check.status, check.finding) == ("ok", f"{folder}: 2 compiled program(s), 1.5 kB; a "
                                             "launch loads the programs it finds there instead of "
                                             "compiling them")  # fmt: skip
    assert check.data == {"folder": str(folder), "programs": 2, "bytes": 1500}
    off = check_compilation_cache(False, jax)
    assert (off.status, off.finding) == (
        "ok",
        "off (runtime.compilation_cache: false): each launch compiles afresh",
    )
    in_the_way = check_compilation_cache(str(folder / "jit_step-1-cache"), jax)
    assert in_the_way.status == "fail" and "a file of that name is in the way" in in_the_way.finding
    tensorflow = check_compilation_cache("auto", SimpleNamespace(backend="tensorflow"))
    assert tensorflow.status == "skip"


@pytest.mark.slow
def test_doctor_command_exit_codes_and_plain_text(tmp_path):
    from helpers import run_cli

    result = run_cli("doctor")
    assert result.returncode == 0, result.stderr
    assert "platform" in result.stdout and "\x1b[" not in result.stdout
    result = run_cli(
        "doctor", "configs/quickstart.yaml", "--set", f"data.train={tmp_path}/none-*.tfrecord"
    )
    assert result.returncode == 1 and "no file matches this glob" in result.stdout


@pytest.mark.slow
def test_model_check_for_an_accelerator_runs_in_a_cpu_child(tmp_path):
    """Where train would use a TPU or GPU, doctor checks the model in a CPU-only child process."""
    from helpers import toy_config, write_toy_data

    from tpurun.config import load_config
    from tpurun.doctor.model_check import check_model_on_cpu

    cfg = load_config(toy_config(write_toy_data(tmp_path / "data"), tmp_path / "runs"))
    check, params = check_model_on_cpu(cfg, timeout=120)
    assert check.status == "ok", check
    assert params == 8 * 16 + 16 + 16 + 1 and "(checked on the CPU)" in check.finding
    bad = load_config(
        toy_config(tmp_path / "data", tmp_path / "runs", model={"factory": "nope.py:build"})
    )
    check, params = check_model_on_cpu(bad, timeout=120)
    assert check.status == "fail" and params is None and "nope.py" in check.finding


def test_resume_check_says_where_train_continues_or_why_it_would_refuse(toy_data, tmp_path):
    import tpurun
    from tpurun.config import load_config
    from tpurun.plan.prepare import prepare_here as prepare

    config = toy_config(toy_data, tmp_path / "out", train={"epochs": 1})
    fresh = load_config(config)
    check = cc.check_resume(fresh, prepare(fresh))
    assert check.status == "ok" and "training starts at epoch 1" in check.finding
    tpurun.train(config, verbose=False)

    config["train"]["epochs"] = 3
    cfg = load_config(config)
    check = cc.check_resume(cfg, prepare(cfg))
    assert check.status == "ok" and check.finding.startswith("train will be resuming at epoch 2")
    config["model"]["kwargs"] = {"units": 4}
    cfg = load_config(config)
    check = cc.check_resume(cfg, prepare(cfg))
    assert check.status == "fail" and "model.kwargs.units: unset -> 4" in check.finding
    assert "--restart" in check.fix
