"""A kill inside each of the run's other writes: ``previous.json``, ``summary.json``, the log row,
TensorBoard's events. The process kills itself (SIGKILL) with the file half written; the rerun
must resume from a whole resume point and end where the unbroken run does: its whole log, its
final weights and its TensorBoard curves. (The weights file and ``latest.json`` are
tests/training/test_faults.py's; a sharded save in flight, tests/training/test_sharded_checkpoints.py's.)"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from helpers import ROOT, cli_env, write_config
from test_faults import check_finished, finish, longer  # noqa: F401 (the fixture)
from test_tensorboard import read_events

from tpurun.storage.rundir import RunDir
from tpurun.training.checkpoints import resume as resume_lib

pytestmark = pytest.mark.slow

# The driver: tpurun train, with one write torn at its Nth call: a file renamed into place whose
# name matches the target pattern (half of it, then SIGKILL before the rename), or a TensorBoard
# event appended (half its bytes).
DRIVER = """
import os, signal, sys
target, nth, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
count = [0]

def die_at_nth():
    count[0] += 1
    return count[0] == nth

if target == "events":
    from tpurun.observe import events
    real_add = events.EventFile._add
    def torn_add(self, event):
        if die_at_nth():
            framed = events.framing.frame(event.SerializeToString())
            with open(self.path, "ab") as f:
                f.write(framed[: len(framed) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real_add(self, event)
    events.EventFile._add = torn_add
else:
    real_replace = os.replace
    import fnmatch
    def torn_replace(src, dst):
        if fnmatch.fnmatch(os.path.basename(str(dst)), target) and die_at_nth():
            with open(src, "r+b") as f:
                f.truncate(os.path.getsize(src) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)
    os.replace = torn_replace
sys.argv = ["tpurun", "train", path]
from tpurun.cli.app import main
main()
"""


@pytest.mark.parametrize(
    ("target", "nth", "kept"),
    [
        ("previous.json", 5, (0, 20)),  # the 6th commit's: saves every 4 steps
        ("summary.json", 3, (2, 0)),  # written once the epoch-2 point is committed
        ("log.csv", 2, (1, 124)),  # epoch 2's row: its checkpoint comes after it
        ("events", 5, (0, 124)),  # epoch 1's end: TensorBoard writes before its checkpoint
    ],
)  # fmt: skip
def test_a_kill_inside_a_write_resumes_to_the_unbroken_run(longer, target, nth, kept):  # noqa: F811
    tmp, config, reference = longer
    name = f"torn-{target.split('.')[0]}"
    path = write_config(tmp, config, name)
    killed = subprocess.run([sys.executable, "-c", DRIVER, target, str(nth), str(path)],
                            capture_output=True, text=True, cwd=ROOT, env=cli_env(),
                            timeout=600)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_dir = tmp / "runs" / name
    point = resume_lib.latest(RunDir(str(run_dir)))
    assert point.position == kept and point.damaged == []
    finish(path)
    check_finished(run_dir, 3, reference)
    # TensorBoard: every curve has the unbroken run's steps, and the model's its values (the
    # speed curves are measured anew).
    events, expected = read_events(run_dir), read_events(reference)
    assert {t: [s for s, _ in p] for t, p in events.items()} == {
        t: [s for s, _ in p] for t, p in expected.items()
    }
    timed = ("input_wait", "tflops_per_device", "examples_per_sec", "mfu", "tokens_per_sec")
    same = [t for t in expected if not t.endswith(timed)]
    assert "train/epoch_loss" in same and "validation/epoch_loss" in same
    assert {t: events[t] for t in same} == {t: expected[t] for t in same}


def test_a_kill_inside_a_lora_adapter_write_resumes_to_the_unbroken_run(
    tiny_presets, chat_records, tmp_path
):
    """A LoRA fine-tune saving its adapter every 2 steps, killed halfway through writing its 3rd
    (step 6): it resumes from step 4's adapter, and ends on the unbroken run's log and bits."""
    from helpers import read_log, run_cli
    from test_hub_checkpoints import assert_same_adapter, latest_adapter, lm_config

    def config(name: str) -> dict:
        return lm_config(tmp_path, tiny_presets.gemma, chat_records(), name,
                         callbacks={"checkpoint": {"every_steps": 2}})  # fmt: skip

    unbroken = run_cli("train", str(write_config(tmp_path, config("unbroken"), "unbroken")))
    assert unbroken.returncode == 0, unbroken.stderr
    path = write_config(tmp_path, config("torn"), "torn")
    killed = subprocess.run([sys.executable, "-c", DRIVER, "latest-*.adapter.h5", "3", str(path)],
                            capture_output=True, text=True, cwd=ROOT, env=cli_env(),
                            timeout=600)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_dir = tmp_path / "runs" / "torn"
    point = resume_lib.latest(RunDir(str(run_dir)))
    assert point.position == (0, 4) and point.weights.endswith(".adapter.h5")
    done = run_cli("train", str(path))
    assert done.returncode == 0, done.stderr
    reference = tmp_path / "runs" / "unbroken"
    assert read_log(run_dir) == read_log(reference)
    assert_same_adapter(latest_adapter(run_dir), latest_adapter(reference))
