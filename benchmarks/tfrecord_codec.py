"""The native TFRecord codec against tf.data, one process: records/s of the framing (with both
CRCs), of BatchParser, and of the two together, beside tf.data's TFRecordDataset + batched
parse_example + tpurun's decode on the same files.

    .venv/bin/python benchmarks/tfrecord_codec.py [--records 100000] [--batch 256]

Each figure is the best of three passes, in wall seconds and in CPU seconds of the process (tf.data
runs threads; on a loaded machine the CPU figure is the steadier one). Datasets: 512 int64 token
ids and a label (as `data write --tokenize` stores them); 64 raw float32 values and a label; JPEG
photo crops (sklearn's sample images: the bench extra, `.venv/bin/pip install -e '.[bench]'`)
stored at 224x224 and at 256x256, decoded to 224x224.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SETS = {
    "tokens": {"token_ids": {"type": "int64", "shape": [512]}, "label": {"type": "int64"}},
    "raw": {"x": {"type": "raw", "dtype": "float32", "shape": [64]}, "y": {"type": "int64"}},
    "jpeg224": {"image": {"type": "image", "shape": [224, 224, 3]}, "label": {"type": "int64"}},
    "jpeg256": {"image": {"type": "image", "shape": [224, 224, 3]}, "label": {"type": "int64"}},
}


def records(kind: str, total: int):
    from tpurun.data.native import example

    rng = np.random.default_rng(0)
    if kind.startswith("jpeg"):
        from PIL import Image
        from sklearn.datasets import load_sample_images

        photos, size = load_sample_images().images, int(kind[4:])
        for i in range(total):
            photo = photos[i % len(photos)]
            y, x = rng.integers(0, photo.shape[0] - size), rng.integers(0, photo.shape[1] - size)
            out = io.BytesIO()
            Image.fromarray(photo[y : y + size, x : x + size]).save(out, "JPEG", quality=90)
            yield example.serialize({"image": out.getvalue(), "label": i % 10})
    for _ in range(0 if kind.startswith("jpeg") else total):
        if kind == "tokens":
            yield example.serialize({"token_ids": rng.integers(0, 32000, 512), "label": 1})
        else:
            x = rng.standard_normal(64, dtype=np.float32)
            yield example.serialize({"x": x.tobytes(), "y": int(x[0] > 0)})


def best(run, passes: int = 3) -> tuple[float, float]:
    """(records/s in wall time, records per CPU second), the best of ``passes``."""
    wall = cpu = float("inf")
    for _ in range(passes):
        w, c = time.perf_counter(), time.process_time()
        n = run()
        wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
    return n / wall, n / cpu


def measure(kind: str, files: list[str], batch: int) -> dict[str, tuple[float, float]]:
    from pydantic import TypeAdapter

    from tpurun.config.features import Feature
    from tpurun.data import decode
    from tpurun.data.native import framing
    from tpurun.data.native.decode import BatchParser

    used = {k: TypeAdapter(Feature).validate_python(v) for k, v in SETS[kind].items()}
    parser = BatchParser(used)

    def read() -> int:
        return sum(1 for f in files for _ in framing.iter_records(f))

    def read_parse() -> int:
        done, pending = 0, []
        for f in files:
            for record in framing.iter_records(f):
                pending.append(record)
                if len(pending) == batch:
                    parser(pending)
                    done, pending = done + batch, []
        return done

    from tpurun import frameworks

    tf = frameworks.tensorflow()
    spec = decode.parse_spec(used)
    dataset = (
        tf.data.TFRecordDataset(files)
        .batch(batch, drop_remainder=True)
        .map(lambda b: decode.decode_batch(tf.io.parse_example(b, spec), used),
             num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(2)
    )  # fmt: skip
    return {
        "iter_records (+CRC)": best(read),
        "iter_records + BatchParser": best(read_parse),
        "tf.data + parse_example": best(lambda: batch * sum(1 for _ in dataset)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    from tpurun.data.native import framing

    with tempfile.TemporaryDirectory() as folder:
        for kind in SETS:
            total = (
                args.records if not kind.startswith("jpeg") else max(args.batch, args.records // 50)
            )
            files = [str(Path(folder) / f"{kind}-{i}.tfrecord") for i in range(4)]
            found = list(records(kind, total))
            for i, path in enumerate(files):
                framing.write_records(path, found[i::4])
            for name, (wall, cpu) in measure(kind, files, args.batch).items():
                print(f"{kind:8} {name:28} {wall:>10,.0f} rec/s  {cpu:>10,.0f} rec/CPU-s")


if __name__ == "__main__":
    main()
