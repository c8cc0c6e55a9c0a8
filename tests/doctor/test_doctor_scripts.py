"""Doctor's child-process scripts (tpurun.doctor.scripts) and the protocol they answer by
(tpurun.doctor.child), in-process: what each script prints, parses, counts and concludes, without
starting JAX, TensorFlow or a child. test_doctor.py runs them in their child processes."""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import toy_config

from tpurun.doctor import child
from tpurun.doctor.child import MARK, Child, answer_line, last_error_line, parse_answer
from tpurun.doctor.gcs import _problem
from tpurun.doctor.model_check import CPU_OVERRIDES, cpu_overrides, from_answer, model_step_payload
from tpurun.doctor.scripts import devices, gcs_probe, health, model_step

SCRIPTS = ["devices", "health", "gcs_probe", "model_step"]


# ------------------------------------------------------------------------------- the protocol
def test_an_answer_line_reads_back_as_the_answer():
    answer = {"platforms": {"cpu": 8}, "kinds": ["cpu"], "nan": float("nan")}
    out = "\n".join(["noise from a library", answer_line({"old": 1}), answer_line(answer), "bye"])
    parsed = parse_answer(out, "", 0)
    assert parsed["platforms"] == {"cpu": 8} and "old" not in parsed  # the last answer counts
    assert parsed["nan"] != parsed["nan"]


def test_no_answer_is_reported_by_the_last_error_line_and_the_exit_code():
    err = "Traceback (most recent call last):\n  ...\nValueError: the real cause\nwarning: later\n"
    assert parse_answer("", err, 1) == {"error": "ValueError: the real cause (exit 1)"}
    assert parse_answer("only stdout\n", "", -9) == {"error": "only stdout (exit -9)"}
    assert last_error_line("") == "no output"
    assert len(last_error_line("Error " + "x" * 1000)) == 300


def test_a_script_reads_its_payload_and_replies_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["health.py", json.dumps({"replicas": 4})])
    assert child.payload() == {"replicas": 4}
    monkeypatch.setattr(sys, "argv", ["health.py"])
    assert child.payload() == {}
    child.reply({"agree": True})
    assert capsys.readouterr().out == MARK + '{"agree": true}\n'


def test_child_env_drops_the_parents_choices_and_adds_the_probes():
    env = child.child_env({"XLA_FLAGS": ""}, drop=("JAX_PLATFORMS",))
    assert "KERAS_BACKEND" not in env and "JAX_PLATFORMS" not in env
    assert env["XLA_FLAGS"] == "" and "TF_CPP_MIN_LOG_LEVEL" in env


@pytest.mark.slow
def test_a_script_that_crashes_is_reported_with_its_error():
    """Through the real ``python -m``: the GCS probe without a payload fails before TensorFlow."""
    result = Child.script("gcs_probe", {}, timeout=60).result()
    assert result["error"] == "KeyError: 'endpoint' (exit 1)", result
    assert result["seconds"] > 0


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_is_a_module_with_a_main(name):
    module = importlib.import_module(f"tpurun.doctor.scripts.{name}")
    assert callable(module.main)
    source = Path(module.__file__).read_text()
    assert source.rstrip().endswith('if __name__ == "__main__":\n    main()')


@pytest.mark.slow
def test_importing_the_scripts_starts_no_framework():
    """The children's environment must be in place before JAX or TensorFlow start, and the
    package's own start stays small: the frameworks come inside the scripts' functions."""
    code = (
        "import json, sys\n"
        + "".join(f"import tpurun.doctor.scripts.{name}\n" for name in SCRIPTS)
        + "print(json.dumps([m for m in ('jax', 'tensorflow', 'keras', 'numpy') if m in sys.modules]))\n"
        + "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tpurun'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    frameworks, loaded = (json.loads(line) for line in out.stdout.splitlines())
    assert frameworks == []
    # (tpurun.frameworks, the door, imports none of them itself: the children's TF log level)
    assert set(loaded) <= {"tpurun", "tpurun._version", "tpurun.doctor", "tpurun.doctor.check",
                           "tpurun.doctor.child", "tpurun.doctor.scripts", "tpurun.errors",
                           "tpurun.frameworks",
                           *(f"tpurun.doctor.scripts.{n}" for n in SCRIPTS)}  # fmt: skip


@pytest.mark.slow
def test_importing_the_doctor_starts_no_framework():
    """Every doctor module imports JAX, TensorFlow and Keras inside the functions that use them:
    ``tpurun doctor`` must not start one before it has chosen, nor hold the TPU itself."""
    modules = [
        "check",
        "child",
        "machine",
        "libtpu_lock",
        "probes",
        "gcs",
        "config_checks",
        "model_check",
    ]
    code = (
        "import json, sys\n"
        + "".join(f"import tpurun.doctor.{name}\n" for name in modules)
        + "print(json.dumps([m for m in ('jax', 'tensorflow', 'keras') if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


# ------------------------------------------------------------------------------------ devices
def test_device_summaries():
    tpu = [SimpleNamespace(platform="tpu", device_kind="TPU v3")] * 8
    assert devices.jax_summary(tpu, cpu=1) == {"platforms": {"tpu": 8}, "cpu": 1,
                                               "kinds": ["TPU v3"], "bytes_limit": None}  # fmt: skip
    v5e = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite",
                          memory_stats=lambda: {"bytes_limit": 16_900_000_000})  # fmt: skip
    assert devices.jax_summary([v5e], cpu=1)["bytes_limit"] == 16_900_000_000
    assert devices.tf_summary(["CPU", "GPU", "GPU"], ["Tesla T4", "Tesla T4"]) == {
        "platforms": {"cpu": 1, "gpu": 2}, "gpu_names": ["Tesla T4", "Tesla T4"],
    }  # fmt: skip


def test_a_jax_error_keeps_its_last_line():
    exc = RuntimeError("Unable to initialize backend 'tpu'\nABORTED: TPU in use by pid 7\n")
    assert devices.jax_error(exc) == "RuntimeError: ABORTED: TPU in use by pid 7"
    assert devices.jax_error(RuntimeError()) == "RuntimeError: "


# ------------------------------------------------------------------------------------- health
def test_the_all_reduce_agrees_only_when_every_replica_has_the_expected_sum():
    assert health.agree([1280.0, 1280.0], 1280.0)
    assert health.agree([1280.5, 1280.5], 1280.0)  # within 1e-3
    assert not health.agree([1280.0, 1279.0], 1280.0)  # replicas differ
    assert not health.agree([1300.0, 1300.0], 1280.0)  # the sum is wrong
    assert not health.agree([], 0.0)


def test_tensorflows_expected_sum():
    # replica i's SIZE x SIZE matrix is filled with (i + 1) / SIZE: its square sums to SIZE (i+1)^2
    assert health.tf_expected(1) == health.SIZE
    assert health.tf_expected(2) == health.SIZE * (1 + 4)


def test_the_health_answer():
    answer = health.answer([5.0] * 12, 5.0, 0.002, "cpu", started=0.0)
    assert answer["replicas"] == 12 and answer["values"] == [5.0] * health.SHOWN
    assert answer["agree"] and answer["platform"] == "cpu" and answer["total_seconds"] > 0


# ---------------------------------------------------------------------------------------- gcs
def test_the_gcs_actions_read_write_and_ask(tmp_path):
    from tpurun.storage import fileio  # the probe's own file operations, on local files

    for name in ("a.rec", "b.rec"):
        (tmp_path / name).write_bytes(b"0123456789" * 4)
    act = gcs_probe.actions(fileio)
    assert act["url"](str(tmp_path / "a.rec")) == "exists: True"
    assert act["url"](str(tmp_path / "none")) == "exists: False"
    assert act["read"](str(tmp_path / "*.rec")) == "2 file(s), the first one read"
    with pytest.raises(LookupError, match="no file matches"):
        act["read"](str(tmp_path / "*.none"))
    assert act["write"](str(tmp_path) + "/") == "a test object written and deleted"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.rec", "b.rec"]  # nothing left


def test_each_target_is_tried_and_reported(tmp_path):
    from tpurun.storage.fileio import StorageError

    def down(path):
        raise StorageError(f"{path}: did not answer", "unreachable", "  connection reset  ")

    results = gcs_probe.run_targets(
        [("read", "gs://b/x"), ("write", "gs://b/out")], {"read": lambda p: "ok", "write": down}
    )
    assert results[0] == {"kind": "read", "path": "gs://b/x", "ok": True, "detail": "ok",
                          "seconds": results[0]["seconds"]}  # fmt: skip
    assert (results[1]["ok"], results[1]["error_type"], results[1]["error"]) == (
        False, "unreachable", "connection reset",
    )  # fmt: skip
    assert gcs_probe.verdict(results)["reachable"]  # one target worked: storage answered
    failed = gcs_probe.verdict(results[1:])
    assert (failed["reachable"], failed["stage"], failed["error"]) == (
        False, "files", "connection reset",
    )  # fmt: skip
    other = [{**results[1], "error_type": "missing"}]
    assert gcs_probe.verdict(other)["reachable"]  # the store answered: the bucket is missing
    assert gcs_probe.error_text(ValueError()) == "ValueError"
    lookup = gcs_probe.run_targets([("read", "x")], {"read": lambda p: [][0]})[0]
    assert (lookup["error_type"], lookup["error"]) == ("IndexError", "list index out of range")


def test_the_tcp_connection_comes_first():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert gcs_probe.connect(server.getsockname(), timeout=5) is None
        port = server.getsockname()[1]
    refused = gcs_probe.connect(("127.0.0.1", port), timeout=5)
    assert refused["reachable"] is False and refused["stage"] == "connect"
    assert refused["error"].startswith(f"127.0.0.1:{port}: ")


def test_the_parent_names_the_path_the_bucket_and_the_fix():
    def failed(kind, error_type, error="boom"):
        return {"kind": kind, "path": "gs://bkt/data/*.rec", "error_type": error_type,
                "error": error}  # fmt: skip

    finding, fix = _problem(failed("read", "permission", "HTTP 403"))
    assert finding == "gs://bkt/data/*.rec: cannot read the data: permission denied (HTTP 403)"
    assert "roles/storage.objectViewer on gs://bkt" in fix
    finding, fix = _problem(failed("write", "missing"))
    assert finding == (
        "gs://bkt/data/*.rec: cannot write the run directory: the bucket gs://bkt does not exist"
    )
    assert fix.startswith("create it (gcloud storage buckets create gs://bkt)")
    finding, _ = _problem(failed("read", "unreachable", "Cannot connect to host"))
    assert finding == (
        "gs://bkt/data/*.rec: cannot read the data: storage did not answer (Cannot connect to host)"
    )


# ---------------------------------------------------------------------------------- the model
def test_the_model_step_gets_the_config_on_one_cpu(tmp_path):
    from tpurun.config import load_config

    cfg = load_config(toy_config(tmp_path / "data", tmp_path / "runs",
                                 runtime={"accelerator": "tpu"}))  # fmt: skip
    asked = json.loads(json.dumps(model_step_payload(cfg)))  # as the child receives it
    loaded = model_step.load(asked)
    assert (loaded.runtime.accelerator, loaded.runtime.cpu_devices) == ("cpu", 1)
    assert loaded.base_dir == cfg.base_dir and loaded.data.train == cfg.data.train
    assert CPU_OVERRIDES == ("runtime.accelerator=cpu", "runtime.cpu_devices=1")


def test_the_model_step_keeps_a_model_axis_on_as_many_cpu_devices(tmp_path):
    """A 2 x 4 mesh for a TPU is checked in the CPU child on a 1 x 4 mesh of 4 CPU devices: the
    layout's model axis as the run will have it."""
    from tpurun.config import load_config

    cfg = load_config(toy_config(tmp_path / "data", tmp_path / "runs",
                                 runtime={"accelerator": "tpu", "mesh": {"data": 2, "model": 4}}))  # fmt: skip
    asked = json.loads(json.dumps(model_step_payload(cfg)))
    loaded = model_step.load(asked)
    assert (loaded.runtime.accelerator, loaded.runtime.cpu_devices) == ("cpu", 4)
    assert (loaded.runtime.mesh.data, loaded.runtime.mesh.model) == (1, 4)
    assert cpu_overrides({"runtime": {"mesh": {"model": 1}}}) == list(CPU_OVERRIDES)
    assert cpu_overrides({}) == list(CPU_OVERRIDES)


def test_the_model_steps_answer_becomes_the_check():
    check = {"name": "model", "status": "ok", "finding": "mlp: 161 parameters", "fix": None,
             "data": {"params": 161}, "seconds": 0.5}  # fmt: skip
    got, params = from_answer({"check": check, "params": 161})
    assert (got.status, got.finding, params) == (
        "ok",
        "mlp: 161 parameters (checked on the CPU)",
        161,
    )
    failed, params = from_answer({"error": "ImportError: no module x (exit 1)"})
    assert failed.status == "fail" and "no module x" in failed.finding and params is None
    slow, _ = from_answer({"error": "timed out after 45 s", "timed_out": True})
    assert slow.status == "warn"
