"""A full disk during a run: named with the path and the space it needs, exit 2, nothing written
before lost, and the run continues exactly once space is freed.

The run directory sits on a real small tmpfs (``mount -t tmpfs``, as root; the test is skipped
where mounting is not allowed), filled with a file to leave the space each case needs.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import FACTORIES, TPURUN, cli_env, read_log, toy_config, write_config, write_toy_data

import tpurun
from tpurun.storage import space
from tpurun.storage.rundir import RunDir
from tpurun.training.checkpoints import resume

pytestmark = pytest.mark.slow


@pytest.fixture
def disk(tmp_path):
    """A 4 MB tmpfs at tmp_path/disk, unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` with one file, leaving about ``leave`` bytes free."""
    filler = disk / "filler"
    free = shutil.disk_usage(disk).free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def _config(
    toy_data, out: Path, epochs: int, fill_at: int | None = None, leave: int = 0,
    tensorboard: bool = True,
) -> dict:  # fmt: skip
    """The toy run (no best checkpoint: the epoch's writes are TensorBoard's events, the log row,
    then the resume point), filling ``out``'s disk at the end of epoch ``fill_at``."""
    extra = [{"name": f"{FACTORIES}:FillDisk", "folder": str(out), "epoch": fill_at,
              "leave": leave}] if fill_at else []  # fmt: skip
    callbacks = {
        "checkpoint": None,
        "extra": extra,
        **({} if tensorboard else {"tensorboard": None}),
    }
    return toy_config(toy_data, out, name="full", train={"epochs": epochs}, callbacks=callbacks)


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory):
    return write_toy_data(tmp_path_factory.mktemp("disk-full-data"))


@pytest.fixture(scope="module")
def reference(shared_data, tmp_path_factory):
    """The run unbroken, elsewhere (once for the module): what each resumed run must equal."""
    out = tmp_path_factory.mktemp("disk-full-reference")
    summary = tpurun.train(_config(shared_data, out, 3), verbose=False)
    return read_log(out / "full"), summary["final_metrics"]


@pytest.fixture
def toy_data(shared_data):
    """The module's data (the reference was trained on it)."""
    return shared_data


def _continues_exactly(toy_data, disk: Path, reference) -> None:
    """Once the filler is gone, the rerun finishes as the unbroken run did."""
    (disk / "filler").unlink()
    resumed = tpurun.train(_config(toy_data, disk, 3), verbose=False)
    assert resumed["epochs_completed"] == 3
    assert (read_log(disk / "full"), resumed["final_metrics"]) == reference


def _kept_epoch_2(run_dir: Path) -> None:
    """The last complete resume point is epoch 2's, whole; no temporary file is left."""
    point = resume.latest(RunDir(str(run_dir)))
    assert point.position == (2, 0) and point.damaged == []
    assert not list(run_dir.rglob(".tmp-*"))


def test_a_checkpoint_that_does_not_fit_exits_2_naming_it_and_the_run_continues(
    toy_data, tmp_path, disk, reference
):
    # 16 KB left: the log row's rewrite (a page) fits, the 21 KB weights do not.
    path = write_config(tmp_path, _config(toy_data, disk, 3, fill_at=3, leave=16384))
    tpurun.train(_config(toy_data, disk, 2), verbose=False)
    done = subprocess.run([TPURUN, "train", str(path)], capture_output=True, text=True,
                          env=cli_env(), timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    weights = disk / "full" / "checkpoints" / "latest-e0003-s0000000.weights.h5"
    size = (disk / "full" / "checkpoints" / "latest-e0002-s0000000.weights.h5").stat().st_size
    assert done.stderr.startswith(
        f"error: no space left on the disk writing {weights}. It needs about {size / 1024:.1f} KB; "
    )
    assert "the last complete checkpoint, are kept" in done.stderr
    assert "run the same command again to continue" in done.stderr
    _kept_epoch_2(disk / "full")
    _continues_exactly(toy_data, disk, reference)


def test_a_log_row_that_does_not_fit_stops_the_run_before_its_checkpoint(toy_data, disk, reference):
    tpurun.train(_config(toy_data, disk, 2), verbose=False)
    with pytest.raises(space.DiskFull, match=rf"writing {disk / 'full' / 'log.csv'}\. It needs"):
        tpurun.train(_config(toy_data, disk, 3, fill_at=3, tensorboard=False), verbose=False)
    _kept_epoch_2(disk / "full")
    _continues_exactly(toy_data, disk, reference)


def test_tensorboard_events_that_do_not_fit_are_said_as_a_full_disk(toy_data, disk, reference):
    """TensorBoard writes first at an epoch's end (its events files, opened then)."""
    tpurun.train(_config(toy_data, disk, 2), verbose=False)
    with pytest.raises(
        space.DiskFull, match=rf"^no space left on the disk writing {disk / 'full'}\. Nothing"
    ):
        tpurun.train(_config(toy_data, disk, 3, fill_at=3), verbose=False)
    _kept_epoch_2(disk / "full")
    _continues_exactly(toy_data, disk, reference)


def test_a_summary_that_does_not_fit_is_said_at_the_os_boundary(
    toy_data, tmp_path, reference, monkeypatch
):
    """summary.json is written after each epoch's resume point: a rename that fails there (the OS
    saying ENOSPC, injected at os.replace) stops the run with the resume point committed."""
    out = tmp_path / "out"
    tpurun.train(_config(toy_data, out, 2), verbose=False)
    real = os.replace

    def full(src, dst):
        if str(dst).endswith("summary.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(space.DiskFull, match=rf"writing {out / 'full' / 'summary.json'}\."):
        tpurun.train(_config(toy_data, out, 3), verbose=False)
    monkeypatch.setattr(os, "replace", real)
    assert resume.latest(RunDir(str(out / "full"))).position == (2, 0)  # before the first write
    resumed = tpurun.train(_config(toy_data, out, 3), verbose=False)
    assert (read_log(out / "full"), resumed["final_metrics"]) == reference


def test_no_space_at_all_at_the_start_changes_nothing(toy_data, tmp_path, disk):
    tpurun.train(_config(toy_data, disk, 1), verbose=False)
    run_dir = disk / "full"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "run.lock"}
    filler = fill(disk, leave=0)
    with pytest.raises(space.DiskFull, match=rf"writing {run_dir / 'config.yaml'}\."):
        tpurun.train(_config(toy_data, disk, 2), verbose=False)
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "run.lock"}
    assert after == before
    filler.unlink()
    assert tpurun.train(_config(toy_data, disk, 2), verbose=False)["epochs_completed"] == 2


def test_an_error_log_that_does_not_fit_is_left_to_the_temporary_folder(disk):
    run = RunDir(str(disk / "run"))
    (disk / "run").mkdir()
    fill(disk, leave=0)
    assert run.write_error("Traceback: ..." * 1000) is None
    assert not (disk / "run" / "error.log").exists()


def test_a_full_disk_is_found_however_deep_a_library_wrapped_it():
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as inner:
            raise RuntimeError("Unable to synchronously create file") from inner
    except RuntimeError as outer:
        assert space.is_disk_full(outer)
    assert space.is_disk_full(OSError("Can't write data (file write failed: errno = 28)"))
    assert not space.is_disk_full(OSError(errno.EACCES, "Permission denied"))
