"""The run lock of a run directory in a bucket (tpurun.storage.runlock.RemoteLock), on TensorFlow's
``ram://`` file system: the same object-store code path as gs://, without a server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid

import pytest

from tpurun.errors import TpurunError
from tpurun.storage import fileio, runlock
from tpurun.storage.rundir import LOCK, RunDir, Summary


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(runlock, "SETTLE_SECONDS", 0.05)
    monkeypatch.setattr(runlock, "HEARTBEAT_SECONDS", 0.05)


def bucket_run() -> RunDir:
    return RunDir(f"ram://lock-{uuid.uuid4().hex}/runs/toy")


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def put_lock(run: RunDir, **fields) -> None:
    record = {"pid": 4242, "host": "another-host", "since": "2026-01-01T00:00:00+0000",
              "token": "theirs", "heartbeat": time.time(), **fields}  # fmt: skip
    fileio.write_json(run.file(LOCK), record)


def test_a_remote_lock_names_its_holder_refuses_a_second_run_and_goes_on_release(fast):
    run = bucket_run()
    run.create()
    holder = fileio.read_json(run.file(LOCK))
    assert holder["pid"] > 0 and holder["host"] == socket.gethostname() and holder["token"]
    assert run.is_locked()
    with pytest.raises(TpurunError, match=rf"in use by another tpurun run \(pid {holder['pid']} "
                       r"on .*last heartbeat was \d+ s ago.*taken over"):  # fmt: skip
        RunDir(run.path).lock()
    deadline = time.monotonic() + 10
    while (fileio.read_json(run.file(LOCK)) or holder)["heartbeat"] == holder["heartbeat"]:
        assert time.monotonic() < deadline, "no heartbeat"  # (ram:// writes are not atomic)
        time.sleep(0.02)
    run.unlock()
    assert not fileio.exists(run.file(LOCK)) and not run.is_locked()


def test_status_tells_a_live_remote_run_from_a_dead_or_silent_one(fast):
    run = bucket_run()
    fileio.makedirs(run.checkpoints)
    fileio.write_json(run.file("summary.json"), Summary(status="running").to_dict())
    put_lock(run)  # another host, heartbeat now
    assert run.status() == "running"
    put_lock(run, heartbeat=time.time() - runlock.STALE_SECONDS - 1)
    assert run.status() == "died"
    put_lock(run, host=socket.gethostname(), pid=dead_pid())  # this host: the process is gone
    assert run.status() == "died"
    taker = RunDir(run.path)
    taker.lock()  # and such a lock is taken over at once
    assert fileio.read_json(run.file(LOCK))["pid"] == os.getpid()
    taker.unlock()


def test_a_run_whose_lock_was_taken_stops_writing(fast):
    run = bucket_run()
    run.create()
    put_lock(run)  # someone else wrote the lock (the race the settle time narrows)
    deadline = time.monotonic() + 10
    while run._lock.lost is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(runlock.LockLost, match="another tpurun run .pid 4242 on another-host"):
        run.write_summary(Summary())
    run.unlock()
    assert json.loads(fileio.read_text(run.file(LOCK)))["token"] == "theirs"  # theirs stays


def test_two_runs_that_both_find_the_lock_free_agree_on_one_holder(fast):
    # Safety: never two holders. Liveness: on a very loaded machine both may read back the
    # other's token and step aside (the user reruns), so one of three tries must find a holder.
    outcomes = []
    for _ in range(3):
        path = bucket_run().path
        fileio.makedirs(path)
        runs = [RunDir(path), RunDir(path)]
        results: list = [None, None]

        def take(i: int, runs=runs, results=results) -> None:
            try:
                runs[i].lock()
                results[i] = "held"
            except TpurunError:
                results[i] = "busy"

        threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for run in runs:
            run.unlock()
        assert results.count("held") <= 1, results
        outcomes.append(sorted(results))
        if outcomes[-1] == ["busy", "held"]:
            break
    assert ["busy", "held"] in outcomes, outcomes
