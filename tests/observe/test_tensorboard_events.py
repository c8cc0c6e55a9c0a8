"""Event files written and trimmed without TensorFlow (tpurun.observe.events), read back with
TensorBoard's own readers: the one its scalars dashboard's Python path uses too."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_tensorboard import scalars_in

from tpurun.data.native import framing
from tpurun.observe.events import EventFile, trim_events


def write_steps(folder: Path, steps, tag: str = "epoch_loss") -> Path:
    """An event file in ``folder`` with ``tag`` at each step (value: step / 4, exact in float32)."""
    events = EventFile(str(folder))
    for step in steps:
        events.scalars({tag: step / 4}, step)
    events.close()
    return Path(events.path)


def test_tags_steps_and_values_read_back_as_written(tmp_path):
    events = EventFile(str(tmp_path / "train"))
    events.scalars({"epoch_loss": 0.25, "epoch_top-1 accuracy": 1 / 3, "mfu": 0.5}, 16)
    events.scalars({"epoch_loss": 0.125, "epoch_top-1 accuracy": 2 / 3, "mfu": 0.5}, 32)
    events.flush()  # local files are written event by event: read before close
    assert scalars_in(Path(events.path)) == {
        "epoch_loss": [(16, 0.25), (32, 0.125)],
        "epoch_top-1 accuracy": [(16, float(np.float32(1 / 3))), (32, float(np.float32(2 / 3)))],
        "mfu": [(16, 0.5), (32, 0.5)],
    }  # every tag as given, not made to fit a TensorFlow op name
    events.close()
    name = re.escape(f"{socket.gethostname()}.{os.getpid()}.")
    assert re.fullmatch(rf"events\.out\.tfevents\.\d{{10}}\.{name}\d+\.v2", Path(events.path).name)

    from tensorboard.backend.event_processing import event_accumulator as ea

    reader = ea.EventAccumulator(events.path)
    reader.Reload()
    assert reader.file_version == 2.0  # the brain.Event:2 record that opens the file


def test_trimming_drops_the_events_past_a_step_and_files_left_without_any(tmp_path):
    train = tmp_path / "train"
    older = write_steps(train, [4, 8, 12, 16])
    newer = write_steps(train, [20, 24])
    validation = write_steps(tmp_path / "validation", [8, 16])
    before = validation.read_bytes()

    assert trim_events(str(tmp_path), 12) == 3 + 1  # steps 16, 20, 24; and 16 in validation
    assert scalars_in(older) == {"epoch_loss": [(4, 1.0), (8, 2.0), (12, 3.0)]}
    assert not newer.exists()  # only its version record was left
    assert scalars_in(validation) == {"epoch_loss": [(8, 2.0)]}
    after = validation.read_bytes()
    assert len(after) < len(before) and before.startswith(after)  # kept records as they were
    assert trim_events(str(tmp_path), 12) == 0


def test_a_damaged_record_is_dropped_with_what_follows_it(tmp_path):
    """A session killed while writing leaves a record cut short; trimming leaves a whole file."""
    cut = write_steps(tmp_path / "train", [4, 8, 12])
    cut.write_bytes(cut.read_bytes()[:-3])
    flipped = write_steps(tmp_path / "validation", [4, 8, 12])
    data = bytearray(flipped.read_bytes())
    records = [framing.frame(r) for r in framing.iter_records(str(flipped))]
    at = sum(map(len, records[:2])) + 14  # inside step 8's data
    data[at] ^= 0xFF
    flipped.write_bytes(bytes(data))

    assert trim_events(str(tmp_path), 100) == 0  # nothing past the step: only the damage goes
    assert scalars_in(cut) == {"epoch_loss": [(4, 1.0), (8, 2.0)]}
    assert scalars_in(flipped) == {"epoch_loss": [(4, 1.0)]}
    assert len(list(framing.iter_records(str(cut)))) == 3  # version + 2: read to a clean end


def test_a_run_begun_with_tensorflows_scalars_continues_as_one_curve(tmp_path):
    """Before tpurun wrote its events itself, TensorFlow wrote its tensor form; TensorBoard's
    scalars dashboard reads that and tensorboardX's ``simple_value`` as one series."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
    from tensorboard.util import tensor_util

    train = tmp_path / "train"
    train.mkdir()
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    )
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[0.5])
    value = summary_pb2.Summary.Value(tag="epoch_loss", tensor=tensor, metadata=metadata)
    old = [
        event_pb2.Event(wall_time=1.0, file_version="brain.Event:2"),
        event_pb2.Event(wall_time=2.0, step=16, summary=summary_pb2.Summary(value=[value])),
    ]
    seconds = int(time.time()) - 60
    framing.write_records(str(train / f"events.out.tfevents.{seconds}.old.1.0.v2"),
                          [e.SerializeToString() for e in old])  # fmt: skip
    write_steps(train, [32])

    reader = pea.EventAccumulator(str(train), size_guidance={pea.TENSORS: 0})
    reader.Reload()
    assert reader.Tags()["tensors"] == ["epoch_loss"]
    assert reader.SummaryMetadata("epoch_loss").plugin_data.plugin_name == "scalars"
    points = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
              for e in reader.Tensors("epoch_loss")]  # fmt: skip
    assert points == [(16, 0.5), (32, 8.0)]


WRITE_EVENTS = """
import sys
if sys.argv[2] == "without-tensorboard":
    sys.modules["tensorboard"] = None  # `import tensorboard` raises ImportError
from tpurun.observe.events import EventFile, event_pb2
events = EventFile(sys.argv[1])
events.scalars({"epoch_loss": 0.5}, 4)
events.close()
print(event_pb2.__name__, "google.cloud.storage" in sys.modules, "tensorboardX" in sys.modules)
"""


@pytest.mark.slow  # two Python processes
def test_events_are_the_same_from_tensorboards_messages_and_tensorboardxs(tmp_path):
    """Where TensorBoard is installed its messages write the events, and neither tensorboardX nor
    the GCS client it imports (0.2-0.3 s) is loaded; without it, tensorboardX's messages write the
    same file. TensorBoard's reader reads both alike."""
    said = {}
    for source in ("with-tensorboard", "without-tensorboard"):
        done = subprocess.run(
            [sys.executable, "-c", WRITE_EVENTS, str(tmp_path / source), source],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        said[source] = done.stdout.split()
    assert said == {
        "with-tensorboard": ["tensorboard.compat.proto.event_pb2", "False", "False"],
        "without-tensorboard": ["tensorboardX.proto.event_pb2", "True", "True"],
    }
    files = [next((tmp_path / source).glob("events.out.tfevents.*")) for source in said]
    assert [scalars_in(f) for f in files] == [{"epoch_loss": [(4, 0.5)]}] * 2
    assert [len(f.read_bytes()) for f in files] == [len(files[0].read_bytes())] * 2
