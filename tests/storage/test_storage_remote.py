"""tpurun.storage.remote without a server: which credentials gcsfs is told to use, the retry
delays, and what each of gcsfs's failures is called (the word doctor and the messages go by)."""

from __future__ import annotations

import aiohttp
import pytest
from gcsfs.retry import HttpError

from tpurun.storage import remote

SETTINGS = ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_HOST",
            "GCE_METADATA_IP", "CLOUDSDK_CONFIG")  # fmt: skip


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """A machine with no credentials of any kind, whose metadata server's name cannot resolve."""
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setattr(remote, "METADATA_HOST", "metadata.invalid")  # RFC 6761: never resolves
    monkeypatch.setattr(remote, "_anonymous", False)
    return tmp_path


def test_credentials_are_searched_for_only_where_some_can_be_found(no_credentials, monkeypatch):
    assert remote.credentials() == "anon"  # at once, not after the metadata server's timeouts
    assert remote._anonymous  # and a refusal will say so
    monkeypatch.setattr(remote, "_anonymous", False)

    adc = no_credentials / "gcloud" / "application_default_credentials.json"
    adc.parent.mkdir()
    adc.write_text("{}")  # gcloud auth application-default login's file
    assert remote.credentials() is None  # gcsfs's own search finds it
    adc.unlink()
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(no_credentials / "key.json"))
    assert remote.credentials() is None
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS")
    monkeypatch.setattr(remote, "METADATA_HOST", "localhost")  # as on a Google Cloud VM
    assert remote.credentials() is None
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")
    assert remote.credentials() == "anon"  # an emulator, as Google's own clients do
    assert not remote._anonymous


def test_a_refusal_without_credentials_says_there_are_none(no_credentials):
    remote.credentials()
    error = remote.storage_error(
        "gs://b/x", "reading it", HttpError({"code": 401, "message": "Anonymous"})
    )
    assert error.message == (
        "gs://b/x: permission denied while reading it (HTTP 401: Anonymous). This machine has no "
        "Google Cloud credentials (no GOOGLE_APPLICATION_CREDENTIALS, no `gcloud auth "
        "application-default login`, no metadata server), so tpurun asked without any: give it "
        "an account that may use gs://b (gcloud auth application-default login, or "
        "GOOGLE_APPLICATION_CREDENTIALS=KEY.json)."
    )


def test_the_retry_delays_double_up_to_the_longest():
    retries = remote.Retries(4, 0.25, 2.0)
    assert [retries.delay(attempt) for attempt in range(5)] == [0.25, 0.5, 1.0, 2.0, 2.0]


def test_the_retry_settings_come_from_the_environment_or_tpuruns_defaults(monkeypatch):
    for name in ("GCS_RETRY_CONFIG_MAX_RETRIES", "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US",
                 "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert remote.Retries.from_environment() == remote.Retries(4, 0.25, 2.0)
    monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_RETRIES", "10")
    monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_DELAY_TIME_US", "not a number")
    assert remote.Retries.from_environment() == remote.Retries(10, 0.25, 2.0)


@pytest.mark.parametrize(
    ("exc", "kind", "detail"),
    [
        (FileNotFoundError("b/o/x"), "missing", "b/o/x"),
        (FileExistsError("b/o/x"), "exists", "b/o/x"),
        (OSError("Forbidden: https://storage/b/o/x\nno storage.objects.get access"), "permission",
         "HTTP 403: no storage.objects.get access"),
        (HttpError({"code": 401, "message": "Invalid Credentials"}), "permission",
         "HTTP 401: Invalid Credentials"),
        (HttpError({"code": 503, "message": "Backend Error"}), "unreachable",
         "HTTP 503: Backend Error"),
        (aiohttp.ServerDisconnectedError(), "unreachable", "Server disconnected"),
        (ConnectionRefusedError(111, "Connection refused"), "unreachable",
         "[Errno 111] Connection refused"),
        (TimeoutError(), "unreachable", "TimeoutError"),
        (HttpError({"code": 400, "message": "Bad Request"}), "other", "HTTP 400: Bad Request"),
        (ValueError("a bug of ours"), None, "a bug of ours"),
    ],
)  # fmt: skip
def test_each_failure_is_named_by_what_it_means(exc, kind, detail):
    assert (remote.error_kind(exc), remote.detail(exc)) == (kind, detail)
