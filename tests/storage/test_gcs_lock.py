"""The run lock of a run directory in a bucket (tpurun.storage.runlock.RemoteLock).

What does not depend on atomic writes runs on ``ram://`` (fsspec's in-memory file system), the same
object-store code path as gs:// without a server; the takeover of a stale lock and two runs racing
for one run against the GCS protocol server (tests/gcs_server.py), whose uploads are atomic and
which honours the create-only precondition."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid

import pytest

from tpurun.errors import TpurunError
from tpurun.storage import fileio, runlock
from tpurun.storage.rundir import LOCK, RunDir
from tpurun.storage.summary import Summary


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


@pytest.mark.parametrize("content", [b'{"pid": 4242, "ho', b"\x00\xff garbage", b"[1, 2]"])
def test_a_damaged_remote_lock_is_held_until_it_goes_stale(fast, monkeypatch, content):
    """A lock object that is not a lock record (cut short, garbage, not an object) is never read
    as "no lock": it counts as held from its last write, and is taken over once that is stale."""
    run = bucket_run()
    fileio.makedirs(run.path)
    with fileio.open_binary(run.file(LOCK), "wb") as f:
        f.write(content)
    assert run.is_locked()
    with pytest.raises(TpurunError) as info:
        RunDir(run.path).lock()
    assert info.value.message == (
        f"{run.path}/run.lock is damaged (not a lock record), so tpurun cannot tell whether a run "
        "holds it: it is taken over 3 minutes after it was last written. Wait and rerun, or train "
        "this one elsewhere (--output DIR)."
    )
    monkeypatch.setattr(runlock, "STALE_SECONDS", 0.0)  # its last write is now long ago
    assert not run.is_locked()
    taker = RunDir(run.path)
    taker.lock()
    assert fileio.read_json(run.file(LOCK))["pid"] == os.getpid()
    taker.unlock()


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


# ------------------------------------------------------------ against the GCS protocol server
# ram:// writes are not atomic, GCS uploads are: the takeover and the race are proven on the
# server that TensorFlow's own GCS client talks to, in processes of their own (the client reads
# its settings once per process).
LOCKER = """
import json, sys, time
from tpurun.storage import runlock
from tpurun.storage.rundir import RunDir
path, start_at, hold = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
runlock.HEARTBEAT_SECONDS = 0.5
run = RunDir(path)
time.sleep(max(0.0, start_at - time.time()))  # both try at once
try:
    run.lock()
except Exception as exc:
    print(json.dumps({"held": False, "error": str(exc)}), flush=True)
    sys.exit(0)
print(json.dumps({"held": True, "pid": __import__("os").getpid()}), flush=True)
time.sleep(hold)
run.unlock()
"""


def start_locker(gcs, path: str, start_at: float, hold: float) -> subprocess.Popen:
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", LOCKER, path, str(start_at), str(hold)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=gcs.cli_env(),
    )  # fmt: skip


def outcome(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)  # a hang guard
    assert proc.returncode == 0 and out.strip(), err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.gcs
@pytest.mark.slow
def test_a_stale_remote_lock_is_taken_over_and_a_live_one_is_not(gcs):
    run = f"{gcs.bucket}/runs/toy"
    gcs.put(f"{run}/summary.json", json.dumps(Summary(status="running").to_dict()).encode())
    record = {"pid": 4242, "host": "another-host", "since": "2026-01-01T00:00:00+0000",
              "token": "theirs"}  # fmt: skip
    gcs.put(f"{run}/{LOCK}", json.dumps({**record, "heartbeat": time.time()}).encode())
    refused = outcome(start_locker(gcs, run, 0, 0))
    assert not refused["held"] and "pid 4242 on another-host" in refused["error"]
    assert gcs.get_json(f"{run}/{LOCK}")["token"] == "theirs"

    stale = time.time() - runlock.STALE_SECONDS - 1  # its holder stopped beating
    gcs.put(f"{run}/{LOCK}", json.dumps({**record, "heartbeat": stale}).encode())
    taker = start_locker(gcs, run, 0, 3)
    line = json.loads(taker.stdout.readline())
    assert line["held"], line
    lock = gcs.get_json(f"{run}/{LOCK}")
    assert lock["pid"] == line["pid"] and lock["token"] != "theirs"
    _, err = taker.communicate(timeout=300)
    assert taker.returncode == 0, err
    assert gcs.get(f"{run}/{LOCK}") is None  # released at the end


@pytest.mark.gcs
@pytest.mark.slow
def test_of_two_runs_racing_for_a_new_remote_lock_exactly_one_holds_it(gcs):
    # A free lock is created with ifGenerationMatch=0: the store lets exactly one create it.
    for attempt in range(2):
        run = f"{gcs.bucket}/runs/race-{attempt}"
        start_at = time.time() + 5  # after both processes have imported tpurun and gcsfs
        racers = [start_locker(gcs, run, start_at, 4) for _ in range(2)]
        outcomes = [outcome(proc) for proc in racers]
        assert sorted(o["held"] for o in outcomes) == [False, True], outcomes
        holder = next(o for o in outcomes if o["held"])
        refused = next(o for o in outcomes if not o["held"])
        assert f"in use by another tpurun run (pid {holder['pid']} on " in refused["error"]


@pytest.mark.gcs
@pytest.mark.slow
def test_two_runs_racing_to_take_over_a_stale_remote_lock_never_both_hold_it(gcs):
    # Safety on every try: never two holders. Liveness: on a very loaded machine both may read
    # back the other's token and step aside (the user reruns), so one of three tries must end
    # with a holder.
    outcomes = []
    for attempt in range(3):
        run = f"{gcs.bucket}/runs/race-{attempt}"
        gcs.put(f"{run}/{LOCK}", json.dumps({"pid": 4242, "host": "another-host",
                                             "token": "theirs", "heartbeat": 0}).encode())  # fmt: skip
        start_at = time.time() + 5  # after both processes have imported tpurun and gcsfs
        racers = [start_locker(gcs, run, start_at, 4) for _ in range(2)]
        held = sorted(outcome(proc)["held"] for proc in racers)
        assert held != [True, True], "two holders"
        outcomes.append(held)
        if held == [False, True]:
            break
    assert [False, True] in outcomes, outcomes
