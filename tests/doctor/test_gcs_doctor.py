"""Doctor's GCS probe against the GCS test server: it reads the data, writes and deletes a test
object in the run directory's folder, and names the bucket and the fix for a bucket that does not
exist, a permission error and a server that does not answer. The probe is a child process: only
its environment points at the server (the test process never uses gs:// itself)."""

from __future__ import annotations

import pytest
from helpers import toy_config, write_toy_data

from tpurun.config import load_config
from tpurun.doctor.gcs import GcsProbe, gcs_targets, start_gcs_probe

pytestmark = [pytest.mark.gcs, pytest.mark.slow]


def config_for(tmp_path, data_bucket: str, out_bucket: str):
    config = toy_config(tmp_path, tmp_path)
    config["data"]["train"] = f"{data_bucket}/data/train-*.tfrecord"
    config["data"]["validation"] = f"{data_bucket}/data/val-*.tfrecord"
    config["output"]["dir"] = f"{out_bucket}/runs"
    return load_config(config)


def start_probe(gcs, monkeypatch, cfg, timeout: float = 60.0) -> GcsProbe:
    """The probe doctor starts for ``cfg``, in a child that reaches the test server."""
    with monkeypatch.context() as env:
        for key, value in gcs.cli_env().items():
            env.setenv(key, value)
        return start_gcs_probe(timeout, cfg)


def test_the_gcs_probe_reads_the_data_and_writes_where_the_run_goes(gcs, tmp_path, monkeypatch):
    gcs.upload(write_toy_data(tmp_path / "data"), f"{gcs.bucket}/data")
    cfg = config_for(tmp_path, gcs.bucket, gcs.bucket)
    assert gcs_targets(cfg) == [
        ("read", f"{gcs.bucket}/data/train-*.tfrecord"),
        ("read", f"{gcs.bucket}/data/val-*.tfrecord"),
        ("write", f"{gcs.bucket}/runs"),
    ]
    forbidden = gcs.make_bucket(gcs.bucket.removeprefix("gs://") + "-403")
    gcs.upload(tmp_path / "data", f"{forbidden}/data")
    gcs.forbid(forbidden.removeprefix("gs://"))
    missing = gcs.bucket + "-none"
    # The three run side by side, as doctor's children do.
    ok = start_probe(gcs, monkeypatch, cfg)
    no_bucket = start_probe(gcs, monkeypatch, config_for(tmp_path, gcs.bucket, missing))
    denied = start_probe(gcs, monkeypatch, config_for(tmp_path, forbidden, gcs.bucket))

    check = ok.check(uses_gcs=True)
    assert check.status == "ok", check
    assert f"{gcs.bucket}/data/train-*.tfrecord: 4 file(s), the first one read" in check.finding
    assert f"{gcs.bucket}/runs: a test object written and deleted" in check.finding

    check = no_bucket.check(uses_gcs=True)
    assert (check.status, check.finding) == (
        "fail",
        (f"{missing}/runs: cannot write the run directory: the bucket {missing} does not exist"),
    )
    assert check.fix.startswith(f"create it (gcloud storage buckets create {missing})")

    check = denied.check(uses_gcs=True)
    assert check.status == "fail"
    assert check.finding.startswith(
        f"{forbidden}/data/train-*.tfrecord: cannot read the data: permission denied (HTTP 403: "
    )
    assert f"roles/storage.objectViewer on {forbidden}" in check.fix
    # Each probe that wrote a test object deleted it. Listed once all three have ended: the
    # denied one writes where the first does (its run directory is the same bucket's), and under
    # load it may still be writing when the first has answered.
    assert [p for p in gcs.list(f"{gcs.bucket}/runs") if "tpurun-doctor" in p] == []


def test_the_gcs_probe_names_a_server_that_does_not_answer(gcs, tmp_path, monkeypatch):
    cfg = config_for(tmp_path, gcs.bucket, gcs.bucket)
    gcs.kill()
    check = start_probe(gcs, monkeypatch, cfg, timeout=120).check(uses_gcs=True)
    # Refused at once and named as such: not the probe's timeout (a hang guard here).
    assert check.status == "fail" and check.finding.startswith("GCS is not reachable: 127.0.0.1:")
    assert not check.data.get("timed_out"), check.data
    assert "HTTPS_PROXY" in check.fix


def test_the_output_check_leaves_a_bucket_to_the_gcs_probe(tmp_path):
    from tpurun.doctor.config_checks import check_output

    check = check_output(config_for(tmp_path, "gs://data", "gs://runs-bucket"), params=1000)
    assert check.status == "skip" and check.data["run_dir"] == "gs://runs-bucket/runs/toy"
    assert "gcs.reachable writes and deletes a test object" in check.finding
