"""Do the data's features fit the model's inputs? Checked from the features' declared shapes and
the model's ``keras.Input``s, before anything is compiled, so that a mismatch names the config key
that sets the shape (``data.features.NAME.shape``), what the records hold and what the model takes,
instead of Keras' "expected shape=..., found shape=..." after compiling.

Only what can be known without running the model is checked: the number of inputs and their names
(``data.inputs`` as a name, a list or a mapping), each input's shape per record (Keras' own rule:
a trailing axis of 1 may be added or dropped) and numbers fed to a string input. A string feature
fed to a numeric input is left to the feature's own check (text columns have their own advice). A
model that declares no inputs (a subclassed model, a Sequential without ``keras.Input``) is not
checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from tpurun.config import DataConfig, ImageFeature, RawFeature, TextFeature
from tpurun.data.decode import decoded_dtype, record_key
from tpurun.data.native import framing
from tpurun.errors import ModelError

#: The first record of the training data, for what a mismatch says the records hold (lazy: read
#: only when there is a mismatch to explain).
FirstRecord = Callable[[], bytes | None]


def first_record_of(files: Sequence[str], compression: str) -> FirstRecord:
    """A :data:`FirstRecord` reading ``files[0]`` (compression "none" or "gzip")."""

    def read() -> bytes | None:
        if not files:
            return None
        records = framing.iter_records(files[0], compression)
        try:
            return next(records, None)
        finally:
            records.close()

    return read


def slots(ref: Any) -> list[tuple[Any, str]]:
    """``(position or model input name, feature)`` for each entry of ``data.inputs``."""
    if isinstance(ref, str):
        return [(None, ref)]
    if isinstance(ref, dict):
        return list(ref.items())
    return list(enumerate(ref))


def _declared_inputs(model: Any) -> Any:
    """The model's inputs as it declared them (a tensor, a list or a dict); None without any."""
    try:
        return model.input
    except (AttributeError, ValueError):  # a subclassed model, a Sequential without an Input
        return None


def check_inputs_fit(model: Any, data: DataConfig, first_record: FirstRecord | None = None) -> None:
    """Check the features named by ``data.inputs`` against the model's inputs.

    Args:
        model: what the factory returned.
        data: the effective ``data`` section (features filled in from the schema file).
        first_record: reads the first training record; None where there is no data at hand.

    Raises:
        ModelError: naming the ``data`` key to change, what it holds and what the model takes.
    """
    declared = _declared_inputs(model)
    if declared is None:
        return
    ref = data.inputs
    pairs = _pairs(declared, ref)
    for slot_name, feature, tensor in pairs:
        problem = _mismatch(data, feature, tensor, slot_name, first_record)
        if problem:
            raise ModelError(problem)


def _names(tensors: Sequence[Any]) -> str:
    return ", ".join(f"'{t.name}'" for t in tensors)


def _pairs(declared: Any, ref: Any) -> list[tuple[str, str, Any]]:
    """``(model input name, feature, model input)`` for each of the model's inputs.

    Raises:
        ModelError: the model's inputs and ``data.inputs`` differ in number or names.
    """
    if isinstance(declared, dict):
        tensors = dict(declared)
    else:
        flat = list(declared) if isinstance(declared, (list, tuple)) else [declared]
        tensors = {t.name: t for t in flat}
    entries = slots(ref)
    if isinstance(ref, dict):
        problem = _unmatched_names(list(tensors), ref)
        if problem:
            raise ModelError(problem)
        return [(name, feature, tensors[name]) for name, feature in entries]
    ordered = list(tensors.values())
    if len(ordered) != len(entries):
        features = ", ".join(f"'{f}'" for _, f in entries)
        example = ", ".join(f"{t.name}: FEATURE" for t in ordered)
        raise ModelError(
            f"data.inputs names {len(entries)} feature(s) ({features}), and the model takes "
            f"{len(ordered)} input(s) ({_names(ordered)}). Name one feature per model input: "
            f"data.inputs: {{{example}}}."
        )
    return [(t.name, feature, t) for (_, feature), t in zip(entries, ordered, strict=True)]


def _unmatched_names(wanted: list[str], ref: dict[str, str]) -> str | None:
    """What is wrong when ``data.inputs`` maps other names than the model's inputs."""
    missing = [name for name in wanted if name not in ref]
    extra = [name for name in ref if name not in wanted]
    said = []
    if missing:
        said.append(f"has no entry for the model's input(s) {', '.join(map(repr, missing))}")
    if extra:
        said.append(f"maps {', '.join(map(repr, extra))}, which the model does not take")
    if not said:
        return None
    return (
        f"data.inputs {' and '.join(said)}: the model's inputs are "
        f"{', '.join(map(repr, wanted))}. Give data.inputs one entry per model input, "
        "`INPUT_NAME: FEATURE`."
    )


def _fits(per_record: Sequence[int], expected: Sequence[Any]) -> bool:
    """Keras' rule (``Functional._adjust_input_rank``): the same rank with the same sizes where the
    model fixes one, or a trailing axis of 1 added or dropped."""
    have, want = list(per_record), list(expected)
    if len(have) == len(want) + 1 and have[-1] == 1:
        have = have[:-1]
    elif len(have) + 1 == len(want) and want[-1] == 1:
        want = want[:-1]
    return len(have) == len(want) and all(
        w is None or w == h for h, w in zip(have, want, strict=True)
    )


def _mismatch(
    data: DataConfig, name: str, tensor: Any, slot: str, first_record: FirstRecord | None
) -> str | None:
    feature = data.features.get(name)
    shape = getattr(feature, "shape", None)
    if shape is None or not hasattr(feature, "type"):
        return None  # no such feature, or options not yet merged with the schema file's entry
    dtype, wants = decoded_dtype(feature), str(tensor.dtype)
    if dtype == "string":
        return None  # text into numbers: the text feature's own message says what to do
    if wants == "string":
        return (
            f"the model's input '{slot}' takes strings, and data.features.{name} is {dtype} "
            f"numbers. Feed it a text or bytes feature, or declare keras.Input(..., dtype='{dtype}')."
        )
    expected = tuple(tensor.shape[1:])
    if _fits(shape, expected):
        return None
    # A type whose shape follows from other keys (a category's vocabulary) is named as a whole.
    settable = "shape" in type(feature).model_fields
    given = (
        f"data.features.{name}.shape is {list(shape)}"
        if settable
        else f"data.features.{name} ({feature.type}) gives {list(shape)}"
    )
    head = f"{given}, and the model's input '{slot}' takes {_tuple(expected)} per record"
    held = _held(feature, name, first_record)
    if isinstance(feature, ImageFeature):
        fix = _image_fix(feature, name, expected)
    elif settable and None not in expected and math.prod(expected) == math.prod(shape):
        fix = f"Set data.features.{name}.shape: {list(expected)} (the same values, reshaped)."
    else:
        fix = (
            f"Build the model on keras.Input(shape={_tuple(shape)}), or feed this input a "
            "feature of its shape."
        )
    return f"{head}{held}. {fix}"


def _tuple(shape: Sequence[Any]) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else f"({', '.join(str(s) for s in shape)})"


def _image_fix(feature: ImageFeature, name: str, expected: tuple) -> str:
    if len(expected) == 3 and None not in expected and expected[2] in (1, 3, 4):
        return (
            f"Set data.features.{name}.shape: {list(expected)}, or build the model on "
            f"keras.Input(shape={_tuple(feature.shape)})."
        )
    return (
        f"Build the model on keras.Input(shape={_tuple(feature.shape)}) (height, width, channels)."
    )


def _held(feature: Any, name: str, first_record: FirstRecord | None) -> str:
    """``", and the records hold ..."``, from the first training record; empty when unknown."""
    if first_record is None:
        return ""
    try:
        return _describe_record(feature, name, first_record())
    except Exception:  # what the records hold only adds to the message: never replace it
        return ""


def _describe_record(feature: Any, name: str, record: bytes | None) -> str:
    from tpurun.data.native import example as examples  # lazy: defers protobuf to a mismatch

    if record is None:
        return ""
    stored = examples.parse(record).features.feature.get(record_key(name, feature))
    if stored is None:
        return ""
    kind = stored.WhichOneof("kind")
    values = getattr(stored, kind).value if kind else []
    if isinstance(feature, ImageFeature):
        from tpurun.data.native import images  # lazy: defers Pillow to a mismatch

        height, width, channels = images.shape_of(values[0])
        return (
            f"; the records hold {height}x{width} images with {channels} channel(s), resized to "
            f"data.features.{name}.shape as they are read"
        )
    if isinstance(feature, RawFeature):
        count = len(values[0]) // max(1, _itemsize(feature.dtype))
        return f"; the records hold {count} {feature.dtype} values each"
    if isinstance(feature, TextFeature):
        return ""
    return f"; the records hold {len(values)} values each"


def _itemsize(dtype: str) -> int:
    import numpy as np

    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
