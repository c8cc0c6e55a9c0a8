"""tpurun.storage.fileio on gs:// through gcsfs, in this process, against the GCS test server
(tests/gcs_server.py): every file operation and its result as the server has it, a streamed write
that appears whole when it is closed, the create-only write the run lock takes a bucket's lock
with, the errors a missing bucket, a refused permission and a dead store give, and that none of it
imports TensorFlow."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from tpurun.storage import fileio, remote

pytestmark = [pytest.mark.gcs, pytest.mark.slow]


@pytest.fixture
def store(gcs, monkeypatch):
    """The test server, which this process's gcsfs reaches (a store made for this test)."""
    for key, value in gcs.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(remote, "_stores", {})
    return gcs


def test_file_operations_read_and_write_what_the_server_has(store, tmp_path):
    b = store.bucket
    fileio.write_json(f"{b}/run/a.json", {"x": 1})
    assert store.get_json(f"{b}/run/a.json") == {"x": 1}
    assert fileio.read_json(f"{b}/run/a.json") == {"x": 1}
    store.put(f"{b}/run/sub/[x].txt", b"odd")  # glob characters in a name
    assert (fileio.exists(f"{b}/run/a.json"), fileio.exists(f"{b}/run/sub"),
            fileio.exists(f"{b}/run/none")) == (True, True, False)  # fmt: skip
    assert (fileio.isdir(f"{b}/run/sub"), fileio.isdir(f"{b}/run/a.json"),
            fileio.isdir(f"{b}/run/none")) == (True, False, False)  # fmt: skip
    assert fileio.glob(f"{b}/run/*") == [f"{b}/run/a.json", f"{b}/run/sub"]
    assert fileio.glob(fileio.escape(f"{b}/run/sub/[x].txt")) == [f"{b}/run/sub/[x].txt"]
    assert fileio.glob(f"{b}/nothing/*") == []
    meta = store.metadata(f"{b}/run/a.json")
    updated = datetime.datetime.fromisoformat(meta["updated"].replace("Z", "+00:00"))
    assert fileio.mtime(f"{b}/run/a.json") == updated.timestamp()
    assert fileio.size(f"{b}/run/a.json") == int(meta["size"]) == len(b'{\n  "x": 1\n}\n')
    assert fileio.read_text(f"{b}/run/sub/[x].txt") == "odd"

    local = tmp_path / "local.bin"
    local.write_bytes(b"local bytes")
    fileio.copy(str(local), f"{b}/copies/up.bin")  # up
    fileio.copy(f"{b}/copies/up.bin", f"{b}/copies/again.bin")  # within the store
    fileio.copy(f"{b}/copies/again.bin", str(tmp_path / "down.bin"))  # down
    assert store.get(f"{b}/copies/again.bin") == (tmp_path / "down.bin").read_bytes()
    assert (tmp_path / "down.bin").read_bytes() == b"local bytes"

    with fileio.local_copy(f"{b}/copies/again.bin") as copied:  # for Keras' loads, by name
        assert (os.path.basename(copied), open(copied, "rb").read()) == (
            "again.bin",
            b"local bytes",
        )
    assert not os.path.exists(copied)
    with fileio.local_copy(str(local)) as same:
        assert same == str(local)

    fileio.rename(f"{b}/copies/again.bin", f"{b}/copies/moved.bin")
    assert store.list(f"{b}/copies/") == [f"{b}/copies/moved.bin", f"{b}/copies/up.bin"]
    fileio.rename(f"{b}/run", f"{b}/run-aside")  # a folder, object by object
    assert store.list(f"{b}/run") == [f"{b}/run-aside/a.json", f"{b}/run-aside/sub/[x].txt"]

    fileio.remove(f"{b}/copies/moved.bin")
    fileio.remove(f"{b}/copies/moved.bin")  # gone already: nothing to do
    with pytest.raises(FileNotFoundError):
        fileio.remove(f"{b}/copies/moved.bin", missing_ok=False)
    fileio.remove_tree(f"{b}/run-aside")
    fileio.remove_tree(f"{b}/run-aside")
    fileio.makedirs(f"{b}/new/folder")  # a bucket has no folders: nothing is written
    assert store.list(f"{b}/") == [f"{b}/copies/up.bin"]


def test_a_streamed_write_appears_whole_when_closed_and_a_failed_one_not_at_all(store):
    path = f"{store.bucket}/big.bin"
    data = os.urandom(2 * remote.BLOCK_SIZE + 12345)  # three parts of a resumable upload
    with fileio.open_binary(path, "wb") as f:
        for start in range(0, len(data), 1 << 20):
            f.write(data[start : start + (1 << 20)])
        assert store.get(path) is None  # two parts sent; no object until the last one
    assert store.get(path) == data
    with fileio.open_binary(path) as f:
        head = f.read(100)
        f.seek(len(data) - 10)
        assert (head, f.read()) == (data[:100], data[-10:])

    for size in (10, remote.BLOCK_SIZE + 1):  # one request at close; a resumable upload begun
        failed = f"{store.bucket}/failed-{size}.bin"
        with pytest.raises(RuntimeError, match="the writer failed"):
            with fileio.open_binary(failed, "wb") as f:
                f.write(data[:size])
                raise RuntimeError("the writer failed")
        assert store.get(failed) is None


def test_only_the_first_create_only_write_succeeds(store):
    for folder in (store.bucket, "ram://tpurun-create"):
        path = f"{folder}/run.lock"
        fileio.create_exclusively(path, b"first")
        with pytest.raises(FileExistsError):
            fileio.create_exclusively(path, b"second")
        assert fileio.read_bytes(path) == b"first"


def test_errors_name_the_bucket_and_the_cause(store):
    missing = store.bucket + "-none"
    for call, path, doing in (
        (fileio.makedirs, f"{missing}/runs", "creating it"),
        (fileio.glob, f"{missing}/data/*.tfrecord", "listing it"),
        (lambda p: fileio.write_text(p, "x"), f"{missing}/runs/x", "uploading it"),
    ):
        with pytest.raises(fileio.StorageError) as caught:
            call(path)
        assert caught.value.message == (
            f"{path}: the bucket {missing} does not exist (or this account may not see it), so "
            f"{doing} failed. Create it (gcloud storage buckets create {missing}) or fix the path."
        )
        assert caught.value.kind == "missing"
    forbidden = store.make_bucket(store.bucket.removeprefix("gs://") + "-403")
    store.put(f"{forbidden}/x", b"1")
    store.forbid(forbidden.removeprefix("gs://"))
    with pytest.raises(fileio.StorageError) as caught:
        fileio.read_bytes(f"{forbidden}/x")
    assert caught.value.message.startswith(
        f"{forbidden}/x: permission denied while reading it (HTTP 403: tpurun-test@example.iam"
        ".gserviceaccount.com does not have storage.objects.get access"
    )
    assert f"cannot do this in {forbidden}: grant them access" in caught.value.message
    with pytest.raises(FileNotFoundError):  # a missing object is not a storage failure
        fileio.read_bytes(f"{store.bucket}/none")
    assert fileio.read_text_or_none(f"{store.bucket}/none") is None


def test_a_store_that_keeps_failing_is_tried_the_bounded_number_of_times(monkeypatch):
    requests = []
    listener = socket.create_server(("127.0.0.1", 0))

    def unavailable() -> None:  # every request answered 503, a server error worth retrying
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                requests.append(conn.recv(65536).split(b"\r\n", 1)[0])
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")  # fmt: skip

    threading.Thread(target=unavailable, daemon=True).start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{listener.getsockname()[1]}")
    monkeypatch.setenv("GCS_RETRY_CONFIG_MAX_RETRIES", "3")
    monkeypatch.setenv("GCS_RETRY_CONFIG_INIT_DELAY_TIME_US", "1000")
    monkeypatch.setattr(remote, "_stores", {})
    monkeypatch.setattr(remote, "_unreachable_at", None)
    try:
        with pytest.raises(fileio.StorageError) as caught:
            fileio.read_bytes("gs://bucket/x.json")
    finally:
        listener.close()
    # The first try and 3 retries (gcsfs's own would make 6 tries, 1 to 16 s apart).
    assert requests == [b"GET /download/storage/v1/b/bucket/o/x.json?alt=media HTTP/1.1"] * 4
    assert caught.value.kind == "unreachable"
    assert caught.value.message.startswith(
        "gs://bucket/x.json: Google Cloud Storage did not answer while reading it (HTTP 503"
    )
    assert "); tpurun gave up after 3 retries. Check the network" in caught.value.message
    assert fileio.recently_unreachable()


def test_ram_paths_are_this_processs_memory():
    import fsspec

    fileio.write_json("ram://tpurun-memory/a/b.json", {"b": 2})
    assert fsspec.filesystem("memory").cat_file("memory://tpurun-memory/a/b.json") == (
        b'{\n  "b": 2\n}\n'
    )
    assert fileio.glob("ram://tpurun-memory/*/*.json") == ["ram://tpurun-memory/a/b.json"]
    fileio.rename("ram://tpurun-memory/a", "ram://tpurun-memory/c")
    assert fileio.read_json("ram://tpurun-memory/c/b.json") == {"b": 2}
    assert not fileio.exists("ram://tpurun-memory/a/b.json")


ROUND_TRIP = """
import json, sys
from tpurun.storage import fileio
from tpurun.storage.rundir import RunDir

base = sys.argv[1]
fileio.makedirs(base + "/run")
fileio.write_json(base + "/run/a.json", {"a": 1})
with fileio.open_binary(base + "/run/b.bin", "wb") as f:
    f.write(b"0123456789")
with fileio.open_binary(base + "/run/b.bin") as f:
    read = f.read()
fileio.rename(base + "/run/b.bin", base + "/run/c.bin")
listed = fileio.glob(base + "/run/*")
sizes = [fileio.size(p) for p in listed]
fileio.mtime(listed[0]), fileio.isdir(base + "/run"), fileio.exists(base + "/run/b.bin")
fileio.copy(listed[0], base + "/copy.json")
fileio.remove_tree(base + "/run")
run = RunDir(base + "/runs/toy")
run.create()  # the run lock: a create-only write, a heartbeat thread
run.unlock()
print(json.dumps({"read": read.decode(), "listed": listed, "sizes": sizes,
                  "tensorflow": "tensorflow" in sys.modules}))
"""


def test_remote_file_operations_do_not_import_tensorflow(gcs):
    done = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP, gcs.bucket], capture_output=True, text=True,
        env=gcs.cli_env(), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer == {
        "read": "0123456789",
        "listed": [f"{gcs.bucket}/run/a.json", f"{gcs.bucket}/run/c.bin"],
        "sizes": [len(b'{\n  "a": 1\n}\n'), 10],
        "tensorflow": False,
    }
    assert gcs.list(f"{gcs.bucket}/") == [f"{gcs.bucket}/copy.json"]  # the lock released
