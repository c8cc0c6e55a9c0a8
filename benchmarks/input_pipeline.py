"""Input pipeline throughput: the Kaggle TPU recipe, tpurun's two readers and raw reads, side by side.

Three datasets are written once into benchmarks/_work/input_pipeline/ (gitignored; reused while
the parameters match):

* raw: NAIC-like records, ``x`` = 1024 float32 and ``y`` = 1 float32, each stored as raw bytes
  (16 shards x 4096 records, 272 MB, by default);
* images: 192x192x3 JPEGs (random smooth images with a little noise) and an int64 ``label``
  (16 shards x 256 records by default);
* tokens: tokenised text as ``tpurun data write --tokenize`` lays out a causal LM's records:
  ``token_ids``, ``padding_mask`` and ``weights``, int64 lists of ``--sequence-length`` + 1 (513)
  each; texts of 64 to 513 tokens with ids below 32,000, then padding (16 shards x 2048 records by
  default). Written with tpurun's own codec (:func:`tpurun.data.native.example.serialize`), no
  tokenizer needed.

On the same files, four pipelines are timed:

(a) recipe: the Kaggle TPU recipe, ``TFRecordDataset(files).map(decode_fn, num_parallel_calls=1)
    .batch(B, drop_remainder=True)``, no prefetch; ``decode_fn`` is ``parse_single_example`` then
    ``decode_raw`` and the seed's ``cast`` to float16 (images: ``decode_jpeg``, ``resize``, / 255;
    tokens: the three int64 lists, cast as the tokenised features declare them).
    The seed itself repeats the batched dataset (``dataset.repeat(1000)``); so does this, so that a
    measurement can outlast one pass.
(b) tpurun tf.data: ``tpurun.data.pipeline.make_dataset(files, DataConfig, B, training=True,
    seed=0)``, exactly as ``tpurun train`` builds it with ``data.reader: tf_data`` (seeded passes
    of file shuffle, interleaved reads in a deterministic order, 10,000-record shuffle; batch,
    ``parse_example`` per batch, decode, prefetch).
(c) read: the ceiling for reading the files with tf.data: the same file shuffle and interleave
    (cycle length, block length, parallelism) as tpurun's but in non-deterministic order (tpurun's
    order is fixed, so that a resume finds its place in the stream again), then batch and
    prefetch; no record shuffle, no parsing. Its interleave parallelism mirrors make_dataset's
    (one reader per core for local files): keep the two in step.
(d) native: ``tpurun.data.native.pipeline.make_dataset`` with the same arguments as (b), as
    ``tpurun train`` builds it with ``data.reader: native`` (numpy batches, no TensorFlow: its
    worker never imports it, which the report checks).

Each pipeline lives in its own worker process (so that its peak resident memory is its own), started
once per dataset. The parent asks the workers in turn for one measurement, rotating the order
each round, for ``--repeats`` rounds: machine load hits all of them alike; the medians are
reported. One measurement makes a fresh iterator, iterates a warm-up (``--warmup-seconds``, at
least 3 batches: fills the shuffle buffer and lets AUTOTUNE settle), then times with
``perf_counter`` until both ``--batches`` batches and ``--seconds`` seconds have passed. Batches
are only iterated: eager iteration of a ``tf.data`` iterator already materializes every tensor,
and the native reader's batches are numpy arrays.

CPU: each measurement also records the cores its process used (``os.times``) and the cores every
other process on the machine used meanwhile (/proc/stat minus its own). On a shared 2-core
machine another user's job often holds a whole core, and then a pipeline that needs two gets one:
the image ratio b/a falls from ~2.1 to ~1.1. The report says, per round, how much the others took,
and repeats the medians and ratios over the quiet rounds only (others < 0.3 cores in every
measurement of the round), when there are any.

Memory: each worker reports its resident set size (VmRSS) once its framework is imported and the
dataset is built, and the peak (VmHWM, reset before each measurement through
/proc/self/clear_refs where the kernel allows it, else the process's ``ru_maxrss``) during each
measurement; the growth over the baseline is the pipeline's buffers (shuffle buffer, prefetch,
batches in flight).

    .venv/bin/python benchmarks/input_pipeline.py                 # three datasets, ~6 min on 2 cores
    .venv/bin/python benchmarks/input_pipeline.py --datasets raw tokens --repeats 3
    .venv/bin/python benchmarks/input_pipeline.py --kinds tpurun native --records-per-shard 1024 --json

Targets (2 cores): raw b/a >= 3.5, b/c and d/c >= 0.8; images b/a >= 1.8; the native reader
against tf.data, d/b >= 1.0 on each dataset. They are reported, not asserted: on a shared machine
any figure can be off. The figures measured are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work" / "input_pipeline"
KINDS = ("recipe", "tpurun", "read", "native")
LABELS = {
    "recipe": "(a) recipe",
    "tpurun": "(b) tf.data",
    "read": "(c) read",
    "native": "(d) native",
}
LETTERS = {"recipe": "a", "tpurun": "b", "read": "c", "native": "d"}
DATASETS = ("raw", "images", "tokens")
RAW_WIDTH = 1024
IMAGE_SIZE = 192
VOCABULARY = 32000  # token ids below it: varints of 1-3 bytes, as a SentencePiece vocabulary's
SHORTEST_TEXT = 64  # tokens (of the stored N + 1) before the padding
TARGETS = {
    "raw": {"b/a": 3.5, "b/c": 0.8, "d/b": 1.0, "d/c": 0.8},
    "images": {"b/a": 1.8, "d/b": 1.0},
    "tokens": {"d/b": 1.0},
}
PROTOCOL = "@@ "  # marks the worker's answers on stdout; anything else there is ignored


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Examples/s of the Kaggle TPU recipe's tf.data, tpurun's two readers and raw "
        "reads."
    )
    p.add_argument("--shards", type=int, default=16, help="shards per dataset (default 16)")
    p.add_argument(
        "--records-per-shard", type=int, default=4096, help="raw records per shard (default 4096)"
    )
    p.add_argument(
        "--image-records-per-shard",
        type=int,
        default=256,
        help="JPEG records per shard (default 256)",
    )
    p.add_argument(
        "--token-records-per-shard",
        type=int,
        default=2048,
        help="tokenised records per shard (default 2048)",
    )
    p.add_argument(
        "--sequence-length",
        type=int,
        default=512,
        help="tokens per sequence; records hold one more (default 512)",
    )
    p.add_argument("--batch", type=int, default=1024, help="batch size B (default 1024)")
    p.add_argument(
        "--image-batch", type=int, default=None, help="batch size for the images (default: --batch)"
    )
    p.add_argument(
        "--batches", type=int, default=8, help="minimum timed batches per measurement (default 8)"
    )
    p.add_argument(
        "--seconds", type=float, default=2.0, help="minimum timed seconds per measurement (2)"
    )
    p.add_argument(
        "--warmup-seconds",
        type=float,
        default=1.0,
        help="untimed iteration before each measurement (default 1; at least 3 batches)",
    )
    p.add_argument(
        "--token-batch", type=int, default=None, help="batch size for the tokens (default: --batch)"
    )
    p.add_argument("--repeats", type=int, default=5, help="rounds of the pipelines (default 5)")
    p.add_argument(
        "--datasets",
        nargs="+",
        choices=DATASETS,
        default=list(DATASETS),
        help="which datasets (default: all three)",
    )
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="which pipelines: recipe (a), tpurun (b), read (c), native (d) (default: all four)",
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per measurement")
    p.add_argument("--json", action="store_true", help="print all figures as one JSON object")
    # Internal: the worker process that owns one pipeline.
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--dataset", choices=DATASETS, help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.image_batch is None:
        args.image_batch = args.batch
    if args.token_batch is None:
        args.token_batch = args.batch
    args.kinds = [k for k in KINDS if k in args.kinds]  # the report's order, each once
    args.datasets = [d for d in DATASETS if d in args.datasets]
    positive = ("shards", "records_per_shard", "image_records_per_shard", "token_records_per_shard",
                "batch", "image_batch", "token_batch")  # fmt: skip
    if args.sequence_length < SHORTEST_TEXT:
        p.error(f"--sequence-length must be at least {SHORTEST_TEXT}")
    for name in (*positive, "batches", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def log(args: argparse.Namespace, message: str) -> None:
    # Progress goes to stderr with --json, so that stdout is one JSON document.
    print(message, file=sys.stderr if args.json else sys.stdout, flush=True)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


# ------------------------------------------------------------------------------------------ data
def dataset_dir(kind: str, args: argparse.Namespace) -> tuple[Path, dict]:
    if kind == "raw":
        wanted = {"kind": "raw", "shards": args.shards, "per_shard": args.records_per_shard}
        wanted.update(width=RAW_WIDTH, seed=0, version=1)
        folder = WORK / f"raw-{args.shards}x{args.records_per_shard}"
    elif kind == "images":
        wanted = {
            "kind": "images",
            "shards": args.shards,
            "per_shard": args.image_records_per_shard,
        }
        wanted.update(size=IMAGE_SIZE, seed=0, version=1)
        folder = WORK / f"images-{args.shards}x{args.image_records_per_shard}"
    else:
        positions = args.sequence_length + 1
        wanted = {
            "kind": "tokens",
            "shards": args.shards,
            "per_shard": args.token_records_per_shard,
        }
        wanted.update(positions=positions, vocabulary=VOCABULARY, seed=0, version=1)
        folder = WORK / f"tokens-{args.shards}x{args.token_records_per_shard}x{positions}"
    return folder, wanted


def batch_size(dataset: str, args: argparse.Namespace) -> int:
    return {"raw": args.batch, "images": args.image_batch, "tokens": args.token_batch}[dataset]


def data_files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.glob("*.tfrecord"))


def ensure_data(kind: str, args: argparse.Namespace) -> Path:
    """Write the shards once; a marker file holds the parameters they were written with."""
    folder, wanted = dataset_dir(kind, args)
    marker = folder / "dataset.json"
    try:
        if json.loads(marker.read_text()) == wanted and len(data_files(folder)) == args.shards:
            return folder
    except (OSError, ValueError):
        pass
    started = time.monotonic()
    log(args, f"writing the {kind} dataset into {folder} ...")
    folder.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    for old in data_files(folder):
        os.unlink(old)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(ROOT))
    from tpurun.data.write import write_shards

    total = wanted["shards"] * wanted["per_shard"]
    if kind == "raw":
        records = raw_records(total)
    elif kind == "images":
        records = image_records(total)
    else:
        records = token_records(total, wanted["positions"])
    write_shards(str(folder / kind), records, wanted["shards"])
    marker.write_text(json.dumps(wanted))
    size = sum(os.path.getsize(f) for f in data_files(folder))
    log(args, f"  {total} records, {size / 1e6:.0f} MB, in {time.monotonic() - started:.0f} s")
    return folder


def raw_records(total: int):
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(total):
        x = rng.standard_normal(RAW_WIDTH, dtype=np.float32)
        y = np.float32(x[:8].sum() > 0)
        yield {"x": x.tobytes(), "y": y.tobytes()}


def image_records(total: int, chunk: int = 128):
    """Random smooth images (bicubic upsampling of 6x6 noise) plus mild pixel noise, as JPEGs."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    done = 0
    while done < total:
        n = min(chunk, total - done)
        low = rng.uniform(0, 255, size=(n, 6, 6, 3)).astype(np.float32)
        images = tf.image.resize(low, [IMAGE_SIZE, IMAGE_SIZE], method="bicubic").numpy()
        images += rng.normal(0, 6, size=images.shape).astype(np.float32)
        images = np.clip(images, 0, 255).astype(np.uint8)
        labels = rng.integers(0, 10, size=n)
        for image, label in zip(images, labels, strict=True):
            jpeg = tf.io.encode_jpeg(image, quality=90).numpy()
            yield {"image": jpeg, "label": int(label)}
        done += n


def token_records(total: int, positions: int):
    """A causal LM's records as ``tpurun data write --tokenize`` writes them: the ids of a text of
    64 to ``positions`` tokens then padding (0), its padding mask, and the loss weights (the mask,
    less the first position, which nothing predicts)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(total):
        length = int(rng.integers(SHORTEST_TEXT, positions + 1))
        mask = (np.arange(positions) < length).astype(np.int64)
        ids = rng.integers(1, VOCABULARY, positions) * mask
        weights = mask.copy()
        weights[0] = 0
        yield {"token_ids": ids, "padding_mask": mask, "weights": weights}


# ------------------------------------------------------------------------------------- pipelines
def features_of(dataset: str, args: argparse.Namespace) -> tuple[dict, object, object]:
    """The config's ``features``, ``inputs`` and ``targets`` for a dataset (what tpurun reads)."""
    if dataset == "raw":
        features = {
            "x": {"type": "raw", "dtype": "float32", "shape": [RAW_WIDTH]},
            "y": {"type": "raw", "dtype": "float32", "shape": [1]},
        }
        return features, "x", "y"
    if dataset == "images":
        features = {
            "image": {"type": "image", "shape": [IMAGE_SIZE, IMAGE_SIZE, 3]},
            "label": {"type": "int64"},
        }
        return features, "image", "label"
    # As the schema file of `data write --tokenize` declares them: int64, cast to the dtypes the
    # preprocessor made; the run's inputs and targets before the causal shift.
    positions = [args.sequence_length + 1]
    features = {
        "token_ids": {"type": "int64", "shape": positions, "cast": "int32"},
        "padding_mask": {"type": "int64", "shape": positions, "cast": "bool"},
        "weights": {"type": "int64", "shape": positions, "cast": "float32"},
    }
    inputs = {"token_ids": "token_ids", "padding_mask": "padding_mask"}
    return features, inputs, {"token_ids": "token_ids", "weights": "weights"}


def build_pipeline(kind: str, dataset: str, files: list[str], batch: int, args: argparse.Namespace):
    if kind in ("tpurun", "native"):
        from tpurun.config import DataConfig

        if kind == "native":
            from tpurun.data.native.pipeline import make_dataset
        else:
            from tpurun.data.pipeline import make_dataset

        features, inputs, targets = features_of(dataset, args)
        data = DataConfig.model_validate(
            {"train": files, "features": features, "inputs": inputs, "targets": targets}
        )
        return make_dataset(files, data, batch, training=True, seed=0)
    if kind == "recipe":
        return recipe_pipeline(dataset, files, batch, args.sequence_length + 1)

    # (c) the file reads of tpurun's pipeline, nothing else.
    import tensorflow as tf

    from tpurun.data.pipeline import cpu_cores

    n_files = len(files)
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(n_files, seed=0).repeat()
    ds = ds.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(n_files, 16),
        block_length=1,
        # as make_dataset does for local files: one reader per core
        num_parallel_calls=max(1, min(n_files, 16, cpu_cores())),
        deterministic=False,
    )
    ds = ds.batch(batch, drop_remainder=True)
    options = tf.data.Options()
    options.deterministic = False
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def recipe_pipeline(dataset: str, files: list[str], batch: int, positions: int):
    """(a): one record at a time through ``parse_single_example`` on one thread, no prefetch."""
    import tensorflow as tf

    if dataset == "raw":

        def decode_fn(record_bytes):  # the seed's, verbatim
            example = tf.io.parse_single_example(
                record_bytes,
                {
                    "x": tf.io.FixedLenFeature([], dtype=tf.string),
                    "y": tf.io.FixedLenFeature([], dtype=tf.string),
                },
            )
            x = tf.io.decode_raw(example["x"], tf.float32)
            y = tf.io.decode_raw(example["y"], tf.float32)
            return tf.cast(x, tf.float16), tf.cast(y, tf.float16)

    elif dataset == "images":

        def decode_fn(record_bytes):
            example = tf.io.parse_single_example(
                record_bytes,
                {
                    "image": tf.io.FixedLenFeature([], dtype=tf.string),
                    "label": tf.io.FixedLenFeature([], dtype=tf.int64),
                },
            )
            image = tf.io.decode_jpeg(example["image"], channels=3)
            image = tf.image.resize(image, [IMAGE_SIZE, IMAGE_SIZE]) / 255.0
            return image, example["label"]

    else:

        def decode_fn(record_bytes):
            names = ("token_ids", "padding_mask", "weights")
            spec = {name: tf.io.FixedLenFeature([positions], tf.int64) for name in names}
            example = tf.io.parse_single_example(record_bytes, spec)
            ids, mask, weights = (example[name] for name in names)
            x = {"token_ids": tf.cast(ids, tf.int32), "padding_mask": tf.cast(mask, tf.bool)}
            return x, {"token_ids": x["token_ids"], "weights": tf.cast(weights, tf.float32)}

    ds = tf.data.TFRecordDataset(files).map(decode_fn, num_parallel_calls=1)
    return ds.batch(batch, drop_remainder=True).repeat()


# ---------------------------------------------------------------------------------------- worker
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb() -> float | None:
    kb = _status_kb("VmRSS")
    return None if kb is None else round(kb / 1024, 1)


def peak_mb() -> float:
    kb = _status_kb("VmHWM")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return round(kb / 1024, 1)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def cpu_ticks() -> tuple[int, int] | None:
    """All CPUs' (total, idle) jiffies from /proc/stat, or None where there is none."""
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(values), values[3] + values[4]  # idle + iowait


def answer(message: dict) -> None:
    sys.stdout.write(PROTOCOL + json.dumps(message) + "\n")
    sys.stdout.flush()


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {key: _tree_map(fn, value) for key, value in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_tree_map(fn, value) for value in tree)
    return fn(tree)


def measure(ds, batch: int, args: argparse.Namespace) -> dict:
    peak_reset = reset_peak()
    before = rss_mb()
    it = iter(ds)
    started = time.perf_counter()
    warm = 0
    while warm < 3 or time.perf_counter() - started < args.warmup_seconds:
        next(it)
        warm += 1
    warmup_seconds = time.perf_counter() - started
    n = 0
    ticks0, times0 = cpu_ticks(), os.times()
    t0 = time.perf_counter()
    elapsed = 0.0
    while n < args.batches or elapsed < args.seconds:
        next(it)
        n += 1
        elapsed = time.perf_counter() - t0
    ticks1, times1 = cpu_ticks(), os.times()
    rss_end = rss_mb()
    close = getattr(it, "close", None)  # the native reader's threads; tf.data's go with `it`
    if close is not None:
        close()
    del it
    # CPU use while timed, in cores: this process's threads, and everything else on the machine
    # (other users' jobs: when they take a core, a 2-core pipeline gets one).
    own = (times1.user - times0.user + times1.system - times0.system) / elapsed
    others = None
    if ticks0 and ticks1:
        busy = (ticks1[0] - ticks0[0]) - (ticks1[1] - ticks0[1])
        others = max(0.0, busy / os.sysconf("SC_CLK_TCK") / elapsed - own)
    return {
        "examples_per_s": n * batch / elapsed,
        "batches": n,
        "seconds": elapsed,
        "cores_own": round(own, 2),
        "cores_others": None if others is None else round(others, 2),
        "warmup_batches": warm,
        "warmup_seconds": warmup_seconds,
        "rss_before_mb": before,
        "rss_end_mb": rss_end,
        "peak_rss_mb": peak_mb(),
        "peak_is_per_measurement": peak_reset,
    }


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    files = data_files(Path(args.data_dir))
    batch = batch_size(args.dataset, args)
    ds = build_pipeline(args.worker, args.dataset, files, batch, args)
    rss = rss_mb()
    if args.worker == "native":
        from tpurun.data.native.pipeline import spec_of
        from tpurun.data.reader import first_batch

        spec = spec_of(first_batch(ds))
        spec = _tree_map(lambda a: f"{a.dtype.name}{list(a.shape)}", spec)
    else:
        import tensorflow as tf

        spec = tf.nest.map_structure(lambda s: f"{s.dtype.name}{s.shape}", ds.element_spec)
    # The native reader's worker must run without TensorFlow, as `data.reader: native` does.
    tensorflow = "tensorflow" in sys.modules
    answer({"ready": True, "rss_mb": rss, "element_spec": str(spec), "tensorflow": tensorflow})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        answer(measure(ds, batch, args))


class Worker:
    """One pipeline in its own process; answers one measurement per ``run`` request."""

    def __init__(self, kind: str, dataset: str, folder: Path, args: argparse.Namespace):
        self.kind, self.args = kind, args
        logs = WORK / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"{dataset}-{kind}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind]
        cmd += ["--dataset", dataset, "--data-dir", str(folder)]
        sizes = ("batch", "image_batch", "token_batch", "sequence_length")
        for name in (*sizes, "batches", "seconds", "warmup_seconds"):
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        with open(self.log_path, "w") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                bufsize=0,
                env=child_env(),
                cwd=ROOT,
            )
        self._pending = b""

    def read(self) -> dict:
        """The worker's next answer; unbuffered reads, so the timeout holds."""
        deadline = time.monotonic() + self.args.timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(PROTOCOL):
                    return json.loads(text[len(PROTOCOL) :])
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise SystemExit(
                    f"error: the {self.kind} worker took more than {self.args.timeout:g}s"
                )
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                tail = "\n".join(self.log_path.read_text().strip().splitlines()[-15:])
                raise SystemExit(f"error: the {self.kind} worker died:\n{tail}")
            self._pending += chunk

    def run(self) -> dict:
        self.proc.stdin.write(b"run\n")
        return self.read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(b"quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------------------- bench
QUIET = 0.3  # cores used by other processes below which a round counts as quiet


def bench(dataset: str, args: argparse.Namespace) -> dict:
    folder = ensure_data(dataset, args)
    files = data_files(folder)
    batch = batch_size(dataset, args)
    kinds = args.kinds
    workers = {kind: Worker(kind, dataset, folder, args) for kind in kinds}
    try:
        ready = {kind: w.read() for kind, w in workers.items()}
        runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for r in range(args.repeats):
            turn = r % len(kinds)
            order = kinds[turn:] + kinds[:turn]
            line = []
            for kind in order:
                res = workers[kind].run()
                runs[kind].append(res)
                others = "" if res["cores_others"] is None else f" +{res['cores_others']:.1f}"
                line.append(
                    f"{kind} {res['examples_per_s']:9,.0f} ({res['cores_own']:.1f}{others})"
                )
            log(
                args,
                f"  [{dataset} {r + 1}/{args.repeats}] examples/s (cores: own +others): "
                + " | ".join(line),
            )
    finally:
        for w in workers.values():
            w.close()
    return summarize(dataset, args, files, batch, ready, runs)


RATIOS = ("b/a", "b/c", "c/a", "d/b", "d/c", "d/a")  # x/y: pipeline x's examples/s over y's


def _ratios(rate: dict[str, float]) -> dict[str, float]:
    """Each ratio of :data:`RATIOS` whose two pipelines ran."""
    by_letter = {LETTERS[kind]: value for kind, value in rate.items()}
    out = {}
    for key in RATIOS:
        top, bottom = key.split("/")
        if top in by_letter and bottom in by_letter:
            out[key] = round(by_letter[top] / by_letter[bottom], 3)
    return out


def _record_bytes(dataset: str, args: argparse.Namespace) -> int:
    """Bytes of one decoded record (the batch's arrays)."""
    if dataset == "raw":
        return RAW_WIDTH * 4 + 4
    if dataset == "images":
        return IMAGE_SIZE * IMAGE_SIZE * 3 * 4 + 8
    return (args.sequence_length + 1) * (4 + 1 + 4)  # int32 ids, bool mask, float32 weights


def _pipeline_summary(rs: list[dict], ready: dict) -> dict:
    rates = [r["examples_per_s"] for r in rs]
    p = {
        "examples_per_s_median": round(statistics.median(rates)),
        "examples_per_s_runs": [round(x) for x in rates],
        "batches_timed_median": statistics.median(r["batches"] for r in rs),
        "cores_own_median": round(statistics.median(r["cores_own"] for r in rs), 2),
        "cores_own_runs": [r["cores_own"] for r in rs],
        "cores_others_runs": [r["cores_others"] for r in rs],
        "rss_baseline_mb": ready["rss_mb"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
        "peak_rss_mb_runs": [r["peak_rss_mb"] for r in rs],
        "rss_end_mb_runs": [r["rss_end_mb"] for r in rs],
        "peak_is_per_measurement": all(r["peak_is_per_measurement"] for r in rs),
        "element_spec": ready["element_spec"],
        "tensorflow_imported": ready["tensorflow"],
    }
    if p["rss_baseline_mb"] is not None:
        p["peak_over_baseline_mb"] = round(p["peak_rss_mb"] - p["rss_baseline_mb"], 1)
    return p


def summarize(dataset, args, files, batch, ready, runs) -> dict:
    wanted = dataset_dir(dataset, args)[1]
    kinds = list(runs)
    out: dict = {
        "files": len(files),
        "records": wanted["shards"] * wanted["per_shard"],
        "what": _describe(dataset, args),
        "megabytes": round(sum(os.path.getsize(f) for f in files) / 1e6, 1),
        "batch": batch,
        "decoded_batch_mb": round(batch * _record_bytes(dataset, args) / 2**20, 1),
        "pipelines": {kind: _pipeline_summary(runs[kind], ready[kind]) for kind in kinds},
    }
    out["ratios"] = _ratios({k: out["pipelines"][k]["examples_per_s_median"] for k in kinds})
    # The ratio of medians can hide a noisy round; the median of per-round ratios is a check.
    per_round = [
        _ratios({k: runs[k][i]["examples_per_s"] for k in kinds}) for i in range(args.repeats)
    ]
    out["ratios_per_round_median"] = {
        key: round(statistics.median(r[key] for r in per_round), 3) for key in out["ratios"]
    }
    # Rounds in which no other process took a sizeable share of the CPUs during any of the
    # round's measurements: on a shared 2-core machine, the only rounds that show 2-core figures.
    others = [max((runs[k][i]["cores_others"] or 0.0) for k in kinds) for i in range(args.repeats)]
    quiet = [i for i, o in enumerate(others) if o < QUIET]
    out["cores_others_max_per_round"] = others
    out["quiet_rounds"] = len(quiet)
    if quiet:
        out["quiet"] = {
            "examples_per_s_median": {
                k: round(statistics.median(runs[k][i]["examples_per_s"] for i in quiet))
                for k in kinds
            },
        }
        out["quiet"]["ratios"] = _ratios(out["quiet"]["examples_per_s_median"])
    out["targets"] = {k: v for k, v in TARGETS[dataset].items() if k in out["ratios"]}
    out["meets_targets"] = {k: out["ratios"][k] >= v for k, v in out["targets"].items()}
    return out


def _describe(dataset: str, args: argparse.Namespace) -> str:
    if dataset == "raw":
        return f"{RAW_WIDTH} float32 raw bytes + 1 float32"
    if dataset == "images":
        return f"{IMAGE_SIZE}x{IMAGE_SIZE}x3 JPEG + int64 label"
    return f"token_ids, padding_mask, weights: int64 x {args.sequence_length + 1}"


def _ratio_line(ratios: dict[str, float], targets: dict[str, float]) -> str:
    parts = []
    for key, value in ratios.items():
        target = targets.get(key)
        mark = ""
        if target is not None:
            mark = f" (target >= {target}: {'met' if value >= target else 'MISSED'})"
        parts.append(f"{key} = {value:.2f}{mark}")
    return "; ".join(parts)


def print_report(result: dict) -> None:
    s = result["setup"]
    print(
        f"\n{s['cpu_count']} CPUs (os.cpu_count), {s['cpus_usable']} usable (sched_getaffinity); "
        f"load average {s['loadavg_start']} at start, {s['loadavg_end']} at end; "
        f"{s['repeats']} rounds, each measurement >= {s['batches']} batches and "
        f">= {s['seconds']:g} s after >= {s['warmup_seconds']:g} s warm-up"
    )
    for name, d in result["datasets"].items():
        print(
            f"\n{name}: {d['records']} records ({d['what']}) in {d['files']} shards, "
            f"{d['megabytes']:g} MB; batch {d['batch']} ({d['decoded_batch_mb']:g} MB decoded)"
        )
        print(
            f"  {'':12s}{'examples/s':>12s}{'min':>10s}{'max':>10s}{'cores':>7s}"
            f"{'RSS base MB':>13s}{'peak MB':>9s}{'growth':>8s}"
        )
        for kind, p in d["pipelines"].items():
            runs = p["examples_per_s_runs"]
            growth = p.get("peak_over_baseline_mb")
            print(
                f"  {LABELS[kind]:12s}{p['examples_per_s_median']:12,d}{min(runs):10,d}"
                f"{max(runs):10,d}{p['cores_own_median']:7.2f}{p['rss_baseline_mb'] or 0:13.0f}"
                f"{p['peak_rss_mb']:9.0f}{growth if growth is not None else float('nan'):8.0f}"
            )
        if d["ratios"]:
            print("  ratios of the medians: " + _ratio_line(d["ratios"], d["targets"]))
            per_round = d["ratios_per_round_median"]
            print(
                "  median of per-round ratios: "
                + ", ".join(f"{key} = {value:.2f}" for key, value in per_round.items())
            )
        others = " ".join(f"{o:.1f}" for o in d["cores_others_max_per_round"])
        print(f"  cores taken by other processes, per round (max of the round): {others}")
        if d.get("quiet"):
            q = d["quiet"]
            rates = ", ".join(f"{k} {v:,}" for k, v in q["examples_per_s_median"].items())
            print(f"  {d['quiet_rounds']} quiet round(s) (others < {QUIET} cores): {rates}")
            if q["ratios"]:
                print("    their ratios: " + _ratio_line(q["ratios"], d["targets"]))
        else:
            print(f"  no quiet round (others < {QUIET} cores): 2-core figures not measured")
        for kind in ("tpurun", "native"):
            if kind in d["pipelines"]:
                p = d["pipelines"][kind]
                print(
                    f"  {LETTERS[kind]} peak RSS per measurement (MB): "
                    + " ".join(f"{x:.0f}" for x in p["peak_rss_mb_runs"])
                    + ("" if p["peak_is_per_measurement"] else " (process peaks: no reset)")
                )
        if "native" in d["pipelines"]:
            imported = d["pipelines"]["native"]["tensorflow_imported"]
            print(f"  (d)'s worker imported TensorFlow: {'YES' if imported else 'no'}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    started = time.monotonic()
    setup = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "repeats": args.repeats,
        "batches": args.batches,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "kinds": args.kinds,
        "memory": "each pipeline in its own worker process; VmHWM per measurement",
    }
    datasets = {}
    for dataset in args.datasets:
        datasets[dataset] = bench(dataset, args)
    setup["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result = {"setup": setup, "datasets": datasets, "seconds": round(time.monotonic() - started)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
        print(f"\n({result['seconds']} s in all)")


if __name__ == "__main__":
    main()
