"""gs:// against local disk, on the GCS test server of tests/gcs_server.py (127.0.0.1).

On the same shards, written once to a local folder and uploaded to the server:

1. input pipeline: ``tpurun.plan.bench.bench`` (the training pipeline alone, as ``tpurun data
   bench`` times it) reading the local files, then the same files from gs://; examples/s, MB/s and
   the ratio gs:// / local;
2. one checkpoint commit: ``Checkpointer.save_latest`` (weights under a new name, then
   ``latest.json``, then the old weights removed) of an MLP with its Adam state, into a local run
   directory and into a gs:// one; the median of ``--commits`` commits each;
3. fault cases, each a real ``tpurun train`` with tpurun's own GCS retry defaults: the server down
   at the start (seconds from launch to exit 2), the server killed mid-training (seconds from the
   kill to exit 2), SIGKILL during a checkpoint upload (seconds from the kill to the exit, and
   whether the previous resume point still loads: the rerun's resume).

The server is a pure-Python emulator on this machine (TensorFlow's client reaches it through a
Python TLS proxy): the gs:// figures measure tpurun's GCS client (gcsfs; TensorFlow's own for the
tf_data reader's reads) and the protocol's round trips against a slow server, not Google's
network. They bound what the client costs; real GCS throughput is higher per connection and its
latency is higher per request.

    .venv/bin/python benchmarks/gcs.py                  # ~2-3 min on 2 cores
    .venv/bin/python benchmarks/gcs.py --shards 8 --records-per-shard 2048 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gcs_server import GcsServer  # noqa: E402


def write_shards(folder: Path, shards: int, per_shard: int, width: int) -> None:
    """``x``: ``width`` float32 stored raw, ``y``: 0/1; the toy task of the tests, wider."""
    import numpy as np

    from tpurun.data.write import write_shards as write

    rng = np.random.default_rng(0)
    n = shards * per_shard
    x = rng.normal(size=(n, width)).astype(np.float32)
    y = (x[:, :8].sum(axis=1) > 0).astype(np.int64)
    folder.mkdir(parents=True, exist_ok=True)
    write(str(folder / "train"), ({"x": x[i].tobytes(), "y": int(y[i])} for i in range(n)), shards)


def config_dict(train: str, output: str, width: int, batch: int, reader: str = "auto") -> dict:
    return {
        "name": "bench",
        "seed": 1,  # (seed 0 trips a TF bug in the pipeline: reported)
        "runtime": {"accelerator": "cpu", "cpu_devices": 1},
        "model": {"factory": f"{ROOT / 'benchmarks' / 'gcs.py'}:mlp", "loss": "binary_crossentropy",
                  "kwargs": {"width": width}},
        "data": {"train": train, "inputs": "x", "targets": "y", "reader": reader,
                 "features": {"x": {"type": "raw", "dtype": "float32", "shape": [width]},
                              "y": {"type": "int64", "cast": "float32"}}},
        "train": {"per_core_batch_size": batch, "epochs": 1},
        "output": {"dir": output},
    }  # fmt: skip


def mlp(width: int = 256, units: int = 512):
    import keras

    inputs = keras.Input(shape=(width,), name="x")
    hidden = keras.layers.Dense(units, activation="relu")(inputs)
    hidden = keras.layers.Dense(units, activation="relu")(hidden)
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))


def pipeline(local: Path, remote: str, args) -> dict:
    from tpurun.config import load_config
    from tpurun.plan.bench import bench

    out = {}
    for where, glob in (("local", str(local / "train-*.tfrecord")), ("gs", f"{remote}/train-*")):
        config = load_config(config_dict(glob, "runs", args.width, args.batch, args.reader))
        runs = [bench(config, steps=args.steps, warmup=5) for _ in range(args.repeats)]
        best = max(runs, key=lambda r: r["examples_per_sec"])
        out[where] = {"examples_per_sec": round(best["examples_per_sec"]),
                      "mb_per_sec": round(best["mb_per_sec"], 1)}  # fmt: skip
    out["ratio"] = round(out["gs"]["examples_per_sec"] / out["local"]["examples_per_sec"], 3)
    return out


def commits(local_runs: Path, remote_runs: str, args) -> dict:
    import numpy as np

    from tpurun.storage.rundir import RunDir
    from tpurun.training.checkpoints.checkpointer import Checkpointer

    model = mlp(args.width)
    model.compile(optimizer="adam", loss="binary_crossentropy")
    model.train_on_batch(np.zeros((8, args.width), "float32"), np.zeros((8, 1), "float32"))
    out = {"params": int(model.count_params())}
    for where, folder in (("local", str(local_runs / "ckpt")), ("gs", f"{remote_runs}/ckpt")):
        run = RunDir(folder)
        run.create()
        saver = Checkpointer(run, steps_per_epoch=10, monitor="loss", mode="min")
        times = []
        for i in range(args.commits):
            started = time.perf_counter()
            saver.save_latest(model, i + 1, 0, "bench")
            times.append(time.perf_counter() - started)
        run.unlock()
        out[where] = {"median_seconds": round(statistics.median(times), 3),
                      "min_seconds": round(min(times), 3)}  # fmt: skip
    out["bytes"] = os.path.getsize(local_runs / "ckpt" / "checkpoints" / _latest(local_runs))
    out["ratio"] = round(out["gs"]["median_seconds"] / out["local"]["median_seconds"], 2)
    return out


def _latest(local_runs: Path) -> str:
    state = json.loads((local_runs / "ckpt" / "checkpoints" / "latest.json").read_text())
    return state["weights"]


def faults(server: GcsServer, remote: str, work: Path, args) -> dict:
    """Each case with a real `tpurun train` and tpurun's own retry defaults."""
    config = config_dict(f"{remote}/train-*", f"{server.bucket}/runs", args.width, args.batch,
                         args.reader)  # fmt: skip
    config["train"].update({"epochs": 30, "steps_per_execution": 1})
    config["callbacks"] = {"extra": [{"name": f"{ROOT / 'tests' / 'gcs_server.py'}:SlowBatches",
                                      "seconds": 0.02}]}  # fmt: skip
    path = work / "fault.yaml"
    path.write_text(json.dumps(config))
    run = f"{server.bucket}/runs/bench"

    def epoch() -> int:
        return (server.get_json(f"{run}/checkpoints/latest.json") or {}).get("epoch", 0)

    out = {}
    server.kill()
    started = time.monotonic()
    done = server.tpurun("train", str(path), cwd=work, tpurun_defaults=True)
    out["down_at_start"] = {"seconds_to_exit": round(time.monotonic() - started, 1),
                            "exit": done.returncode}  # fmt: skip
    server.start()

    proc = server.tpurun("train", str(path), cwd=work, wait=False, tpurun_defaults=True)
    server.wait_for(lambda: epoch() >= 1 or _ended(proc), 300, "a checkpoint")
    server.kill()
    killed = time.monotonic()
    proc.communicate(timeout=600)
    out["gone_mid_run"] = {"seconds_from_kill_to_exit": round(time.monotonic() - killed, 1),
                           "exit": proc.returncode}  # fmt: skip
    server.start()
    before = epoch()

    server.hold(f"latest-e{before + 1:04d}")
    proc = server.tpurun("train", str(path), cwd=work, wait=False, tpurun_defaults=True)
    server.wait_for(lambda: server.held() >= 1 or _ended(proc), 300, "the checkpoint upload")
    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    out["kill_during_upload"] = {"seconds_from_kill_to_exit": round(time.monotonic() - killed, 2),
                                 "resume_point_epoch": epoch(), "before": before}  # fmt: skip
    server.release()
    return out


def _ended(proc) -> bool:
    if proc.poll() is None:
        return False
    raise RuntimeError(
        f"the training run ended early (exit {proc.returncode}): {proc.stderr.read()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--records-per-shard", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256, help="float32 values per record")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60, help="batches timed per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--commits", type=int, default=5)
    parser.add_argument(
        "--reader",
        default="auto",
        choices=["auto", "native", "tf_data"],
        help="data.reader: what reads the records (gcsfs, or TF's own client)",
    )
    parser.add_argument("--skip-faults", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tpurun-gcs-bench-") as tmp:
        work = Path(tmp)
        server = GcsServer(work / "server")
        server.start()
        try:
            # This process talks to the server itself: its GCS settings, before TF starts.
            os.environ.update(server.cli_env())
            os.environ.pop("TPURUN_PLAIN", None)
            os.environ["KERAS_BACKEND"], os.environ["JAX_PLATFORMS"] = "jax", "cpu"
            server.bucket = server.make_bucket("bench")
            write_shards(work / "shards", args.shards, args.records_per_shard, args.width)
            remote = f"{server.bucket}/shards"
            server.upload(work / "shards", remote)
            size = sum(p.stat().st_size for p in (work / "shards").iterdir()) / 1e6
            report = {"shards": args.shards, "records": args.shards * args.records_per_shard,
                      "megabytes": round(size, 1), "reader": args.reader}  # fmt: skip
            report["pipeline"] = pipeline(work / "shards", remote, args)
            report["checkpoint_commit"] = commits(work / "runs", f"{server.bucket}/runs", args)
            if not args.skip_faults:
                report["faults"] = faults(server, remote, work, args)
        finally:
            server.kill()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    p, c = report["pipeline"], report["checkpoint_commit"]
    print(
        f"{report['shards']} shards, {report['records']} records, {report['megabytes']} MB, "
        f"data.reader: {report['reader']}"
    )
    print(f"input pipeline  local {p['local']['examples_per_sec']:>9,} ex/s "
          f"({p['local']['mb_per_sec']} MB/s)   gs:// {p['gs']['examples_per_sec']:>9,} ex/s "
          f"({p['gs']['mb_per_sec']} MB/s)   gs/local {p['ratio']}")  # fmt: skip
    print(f"checkpoint commit ({c['params']:,} params, {c['bytes'] / 1e6:.1f} MB)  local "
          f"{c['local']['median_seconds']} s   gs:// {c['gs']['median_seconds']} s   "
          f"gs/local {c['ratio']}")  # fmt: skip
    for case, figures in report.get("faults", {}).items():
        print(f"fault {case}: {figures}")


if __name__ == "__main__":
    main()
