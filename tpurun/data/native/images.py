"""Images decoded and resized without TensorFlow, to the numbers TensorFlow's own ops give.

:func:`decode` is ``tf.io.decode_image(data, channels, expand_animations=False)``: the same pixels
for PNG, GIF and BMP (through Pillow), and for JPEG through ``simplejpeg`` where it is installed
(libjpeg-turbo with the fast integer DCT, TensorFlow's default: the same pixels), else Pillow,
whose accurate DCT differs by a few levels in some pixels. It refuses what TensorFlow refuses
(a JPEG to 4 channels, a GIF to other than 3, a BMP to 1).

:func:`resize` is ``tf.image.resize(image, [height, width])``: bilinear, half-pixel centres, no
antialiasing, in float32 with TensorFlow's order of operations (``resize_bilinear_op.cc``).
"""

from __future__ import annotations

import importlib.util
import io
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from tpurun.errors import DataError

#: The channel counts TensorFlow's decoders accept, by format (0, keeping the file's, aside).
_CHANNELS = {"JPEG": (1, 3), "PNG": (1, 3, 4), "GIF": (3,), "BMP": (3, 4)}
#: libpng's fixed-point weights for RGB to gray, from the 0.299/0.587 TensorFlow passes it.
_GRAY = (9797, 19234, 3737)
_HAS_SIMPLEJPEG = importlib.util.find_spec("simplejpeg") is not None


class ImageError(DataError):
    """An image's bytes cannot be decoded as the feature asks."""


def decode(data: bytes, channels: int) -> np.ndarray:
    """``(height, width, channels)`` uint8 pixels of a JPEG, PNG, GIF or BMP image.

    Raises:
        ImageError: the bytes do not decode, or the format cannot give ``channels``.
    """
    if data[:2] == b"\xff\xd8" and _HAS_SIMPLEJPEG and channels in (1, 3):
        pixels = _simplejpeg(data, channels)
        if pixels is not None:
            return pixels
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"cannot decode the image: {exc}") from None
    fmt = image.format or "?"
    if channels not in _CHANNELS.get(fmt, (1, 3, 4)):
        allowed = " or ".join(str(c) for c in _CHANNELS[fmt])
        raise ImageError(
            f"a {fmt} image cannot be decoded to {channels} channels (TensorFlow's decoder "
            f"takes {allowed}); set the feature's channels to {allowed}."
        )
    pixels = _pixels(image, channels)
    if fmt == "PNG" and channels == 4 and data[24] < 8 and image.mode in ("1", "L", "P"):
        if "transparency" not in image.info:
            # TF's PNG decoder fills the alpha it adds with the file's largest sample value, before
            # widening samples to 8 bits: 1, 3 or 15 for 1-, 2- and 4-bit images.
            pixels[..., 3] = (1 << data[24]) - 1
    return pixels


#: Channels ``tf.io.decode_image`` gives without ``channels``, by Pillow's mode (a palette gives
#: RGB, RGBA when it has a transparent entry).
_MODE_CHANNELS = {"1": 1, "L": 1, "I": 1, "I;16": 1, "I;16B": 1, "I;16L": 1, "LA": 2,
                  "RGB": 3, "YCbCr": 3, "P": 3, "RGBA": 4, "PA": 4, "CMYK": 4}  # fmt: skip


def shape_of(data: bytes) -> tuple[int, int, int]:
    """``(height, width, channels)`` of an encoded image, as ``tf.io.decode_image`` decodes it
    with its own channel count (GIF frames are RGB).

    Raises:
        ImageError: the bytes do not decode.
    """
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"cannot decode the image: {exc}") from None
    channels = _MODE_CHANNELS.get(image.mode, 3)
    if image.format == "GIF":
        channels = 3
    elif image.mode == "P" and "transparency" in image.info:
        channels = 4
    return image.height, image.width, channels


def _simplejpeg(data: bytes, channels: int) -> np.ndarray | None:
    """libjpeg-turbo's pixels with TensorFlow's settings; None where it cannot (CMYK, damage):
    Pillow then decodes or says what is wrong."""
    import simplejpeg

    try:
        pixels = simplejpeg.decode_jpeg(data, "GRAY" if channels == 1 else "RGB", fastdct=True)
    except ValueError:
        return None
    return pixels


def _pixels(image: Any, channels: int) -> np.ndarray:
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16-bit gray: its high byte, as TF keeps
        gray = (np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8)
        image = Image.fromarray(gray, "L")
    if channels == 1:
        if image.mode in ("1", "L", "LA"):
            return np.asarray(image.convert("L"))[..., None]
        rgb = np.asarray(image.convert("RGB")).astype(np.uint32)
        gray = (_GRAY[0] * rgb[..., 0] + _GRAY[1] * rgb[..., 1] + _GRAY[2] * rgb[..., 2]) >> 15
        return gray.astype(np.uint8)[..., None]
    return np.array(image.convert("RGB" if channels == 3 else "RGBA"))


def _interpolation(out_size: int, in_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TensorFlow's ``compute_interpolation_weights`` with half-pixel centres, in float32."""
    scale = np.float32(in_size) / np.float32(out_size)
    where = (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    floor = np.floor(where)
    lower = np.maximum(floor, 0).astype(np.intp)
    upper = np.minimum(np.ceil(where), in_size - 1).astype(np.intp)
    return lower, upper, (where - floor).astype(np.float32)


def resize(
    pixels: np.ndarray, height: int, width: int, out: np.ndarray | None = None
) -> np.ndarray:
    """``(height, width, channels)`` float32: ``tf.image.resize`` of ``pixels``, bilinear, in
    ``out`` where given.

    Each output value is TF's ``top + (bottom - top) * y_lerp`` of ``top = top_left +
    (top_right - top_left) * x_lerp`` (and ``bottom`` alike), in float32: the same numbers. The
    horizontal step runs once per input row used, not once per output pixel.
    """
    if out is None:
        out = np.empty((height, width, pixels.shape[2]), np.float32)
    if pixels.shape[:2] == (height, width):
        out[...] = pixels  # every weight is 0: TF's result is the input, exactly
        return out
    top_row, bottom_row, y_lerp = _interpolation(height, pixels.shape[0])
    left, right, x_lerp = _interpolation(width, pixels.shape[1])
    rows, which = np.unique(np.concatenate([top_row, bottom_row]), return_inverse=True)
    used = pixels[rows]
    # In place, as (b - a) * lerp + a: IEEE addition commutes, so these are TF's numbers.
    lefts = used[:, left].astype(np.float32)
    across = used[:, right].astype(np.float32)
    across -= lefts
    across *= x_lerp[None, :, None]
    across += lefts
    top, bottom = across[which[:height]], across[which[height:]]
    bottom -= top
    bottom *= y_lerp[:, None, None]
    return np.add(bottom, top, out=out)


def load(
    data: bytes,
    shape: tuple[int, int, int] | list[int],
    scale: bool,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """An image feature's value: decoded, resized to ``shape``, over 255 when ``scale``; written
    into ``out`` where given (a batch's row: no copy).

    Raises:
        ImageError: the bytes do not decode to ``shape``'s channels.
    """
    height, width, channels = shape
    image = resize(decode(data, channels), height, width, out)
    if scale:
        np.divide(image, np.float32(255.0), out=image)
    return image
