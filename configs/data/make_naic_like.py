"""Write a synthetic, learnable dataset laid out like the NAIC recipe's TFRecords.

The recipe (a Kaggle TPU notebook for the NAIC 2021 wireless competition) reads records
with two features, ``x`` and ``y``, each one bytes value holding raw float32 data that it decodes
with ``tf.io.decode_raw``. This script writes the same layout:

* ``x``: 1024 float32 values, stored as ``arr.astype(np.float32).tobytes()``;
* ``y``: 1 float32 value (a 0/1 label), stored the same way.

The label is a fixed rule of ``x`` plus a little noise, so a model can learn it: ``x`` is drawn
from a 32-dimensional subspace (plus noise), and ``y`` is the sign of a fixed random projection of
that subspace. Everything is seeded, so the same arguments write the same bytes.

    .venv/bin/python configs/data/make_naic_like.py            # into configs/data/naic_like/
    .venv/bin/python configs/data/make_naic_like.py --train 32768 --out /tmp/naic

The folder is gitignored; configs/naic_like.yaml reads it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import numpy as np

FEATURES = 1024
LATENT = 32  # the dimension the label really depends on
LABEL_NOISE = 0.1  # relative to the projection's spread: a few labels near the boundary flip
INPUT_NOISE = 0.3
TRAIN_SHARDS = 8
VALIDATION_SHARDS = 2
DEFAULT_OUT = Path(__file__).parent / "naic_like"


class Rule:
    """The fixed, seeded mapping from latent draws to inputs and labels."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.basis = rng.standard_normal((LATENT, FEATURES)) / np.sqrt(LATENT)
        self.direction = rng.standard_normal(LATENT) / np.sqrt(LATENT)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` inputs of shape (1024,) and their 0/1 labels, both float32."""
        z = rng.standard_normal((n, LATENT))
        x = z @ self.basis + INPUT_NOISE * rng.standard_normal((n, FEATURES))
        score = z @ self.direction + LABEL_NOISE * rng.standard_normal(n)
        y = (score > 0).astype(np.float32)[:, None]
        return x.astype(np.float32), y


def records(x: np.ndarray, y: np.ndarray) -> Iterator[dict[str, bytes]]:
    """One record per row, each feature as raw float32 bytes (the recipe's layout)."""
    for xi, yi in zip(x, y, strict=True):
        yield {"x": xi.astype(np.float32).tobytes(), "y": yi.astype(np.float32).tobytes()}


def write_dataset(
    out: str | Path = DEFAULT_OUT,
    train: int = 8192,
    validation: int = 1024,
    seed: int = 0,
    prefix: str = "naic",
) -> dict[str, dict]:
    """Write train and validation shards into ``out``, replacing older shards of this prefix.

    Returns:
        For each split (``train``, ``validation``): ``{"paths": [...], "records": n,
        "positives": fraction of labels that are 1}``.
    """
    from tpurun.data.write import write_shards

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{prefix}-*.tfrecord"):
        old.unlink()
    rule = Rule(seed)
    rng = np.random.default_rng(seed + 1)
    written = {}
    for split, count, shards in (
        ("train", train, TRAIN_SHARDS),
        ("validation", validation, VALIDATION_SHARDS),
    ):
        x, y = rule.sample(count, rng)
        paths = write_shards(str(out / f"{prefix}-{split}"), records(x, y), shards)
        written[split] = {"paths": paths, "records": count, "positives": float(y.mean())}
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=8192, help="train records (default 8192)")
    parser.add_argument(
        "--validation", type=int, default=1024, help="validation records (default 1024)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed for the rule and the draws")
    args = parser.parse_args(argv)
    written = write_dataset(args.out, args.train, args.validation, args.seed)
    for split, info in written.items():
        print(
            f"{info['records']} {split} records ({info['positives']:.1%} labelled 1) in "
            f"{len(info['paths'])} shards: {Path(info['paths'][0]).name} ..."
        )
    print(f"in {args.out}: x = {FEATURES} float32 and y = 1 float32, each as raw bytes")


if __name__ == "__main__":
    main()
