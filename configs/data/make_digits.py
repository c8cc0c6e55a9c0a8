"""Regenerate the quickstart's TFRecord shards from scikit-learn's 8x8 digits (1,797 images).

The shards are committed (configs/data/digits/, about 0.3 MB), so nobody needs to run this; it is
here to show how they were made. Needs scikit-learn: `pip install scikit-learn`.

The layout is the one of Kaggle's public image TFRecords (e.g. the flowers competition): a PNG in
`image`, an int64 `class`, and a string `id`.

    python configs/data/make_digits.py
"""

import io
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

from tpurun.data.write import write_shards

HERE = Path(__file__).parent / "digits"


def main() -> None:
    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)[..., None]  # 0..16 -> 0..255
    order = np.random.default_rng(0).permutation(len(images))
    split = int(0.8 * len(order))

    def records(indices):
        for i in indices:
            png = io.BytesIO()
            Image.fromarray(images[i][..., 0], mode="L").save(png, format="PNG")
            yield {"image": png.getvalue(), "class": int(digits.target[i]), "id": f"digit-{i:04d}"}

    HERE.mkdir(parents=True, exist_ok=True)
    for old in HERE.glob("*.tfrecord"):
        old.unlink()
    write_shards(str(HERE / "digits-train"), records(order[:split]), num_shards=8)
    write_shards(str(HERE / "digits-validation"), records(order[split:]), num_shards=2)
    print(f"{split} train and {len(order) - split} validation records in {HERE}")


if __name__ == "__main__":
    main()
