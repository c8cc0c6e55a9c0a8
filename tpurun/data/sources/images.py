"""A folder of images as a source: one subfolder per class, the images kept encoded (or
re-encoded at one size)."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image

from tpurun.data.decode import image_format
from tpurun.data.native import images as native_images
from tpurun.data.sources.base import OVERHEAD_PER_FEATURE, Source
from tpurun.errors import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def visible_subfolders(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


class ImageFolderSource(Source):
    """``<folder>/<class>/**/*.jpg|jpeg|png``: features ``image`` (encoded bytes) and ``label``.

    Labels index the sorted class subfolder names, as Keras' ``image_dataset_from_directory``
    does. The files are written in an order shuffled by ``seed``: listed in class order, every
    shard would otherwise hold one or two classes.
    """

    def __init__(self, path: str, *, image_size: tuple[int, int] | None, seed: int):
        self.path = path
        self.class_names = visible_subfolders(path)
        files: list[tuple[str, int]] = []
        for label, name in enumerate(self.class_names):
            for root, dirs, names in os.walk(os.path.join(path, name)):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files.extend(
                    (os.path.join(root, f), label)
                    for f in sorted(names)
                    if f.lower().endswith(IMAGE_SUFFIXES) and not f.startswith(".")
                )
        if not files:
            raise DataError(
                f"{path}: no .jpg, .jpeg or .png file in its subfolders "
                f"({', '.join(self.class_names)}); expected one subfolder of images per class."
            )
        first_height, first_width, channels = _image_shape(_read_image(files[0][0]), files[0][0])
        # Gray+alpha is read as gray (configs allow 1, 3 or 4 channels) and RGBA as RGB: JPEGs
        # cannot be decoded to 4 channels, and a class folder often mixes JPEGs and PNGs.
        channels = 1 if channels <= 2 else 3
        self._size = tuple(image_size) if image_size else None
        height, width = self._size or (first_height, first_width)
        self._channels = channels
        self.features = {
            "image": {"type": "image", "shape": [height, width, channels]},
            "label": {"type": "int64", "shape": []},
        }
        self.records = len(files)
        order = np.random.default_rng(seed).permutation(len(files))
        self._files = [files[i] for i in order]
        self.nbytes = sum(os.path.getsize(f) for f, _ in files)
        if self._size:  # encoded size grows roughly with the pixel count
            self.nbytes = int(self.nbytes * height * width / (first_height * first_width))
        self.nbytes += 2 * OVERHEAD_PER_FEATURE * self.records

    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        for start in range(0, self.records, size):
            batch = self._files[start : start + size]
            images = []
            for file, _ in batch:
                data = _read_image(file)
                images.append(self._resize(data, file) if self._size else data)
            yield {"image": images, "label": np.array([label for _, label in batch], np.int64)}

    def _resize(self, data: bytes, file: str) -> bytes:
        """The image at ``image_size``, antialiased (Pillow's bilinear filter widens when it
        shrinks), re-encoded in its own format: PNG, or JPEG at quality 95."""
        height, width = self._size
        pixels = _decoded(data, file, self._channels)
        image = Image.fromarray(pixels[..., 0] if self._channels == 1 else pixels)  # L or RGB
        image = image.resize((width, height), Image.Resampling.BILINEAR)
        out = io.BytesIO()
        if image_format(data) == "png":
            image.save(out, format="PNG")
        else:
            image.save(out, format="JPEG", quality=95)
        return out.getvalue()


def _read_image(file: str) -> bytes:
    with open(file, "rb") as f:
        data = f.read()
    if image_format(data) is None:
        raise DataError(
            f"{file}: not a JPEG or PNG image (by its first bytes); remove or convert it."
        )
    return data


def _decoded(data: bytes, file: str, channels: int) -> np.ndarray:
    try:
        return native_images.decode(data, channels)
    except native_images.ImageError as exc:
        raise DataError(f"{file}: {exc.message}") from None


def _image_shape(data: bytes, file: str) -> tuple[int, int, int]:
    """Height, width and channels, as ``tf.io.decode_image`` gives them."""
    try:
        return native_images.shape_of(data)
    except native_images.ImageError as exc:
        raise DataError(f"{file}: {exc.message}") from None
