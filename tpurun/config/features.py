"""The feature types of ``data.features``: how one record key decodes (``type`` picks the kind)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from tpurun.config.base import Positive, Section

RawDType = Literal[
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
]
CastDType = Literal["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "bool"]


class _FeatureBase(Section):
    key: str | None = Field(
        None,
        description="The record key, when it differs from the feature's name "
        "(`{type: int64, key: image/class}`).",
    )


def _normalize() -> Any:
    return Field(
        False,
        description="Standardize this model input: a `keras.layers.Normalization` in front of the "
        "factory's model, with each value's mean and variance over the training records, as "
        "`tpurun data write` recorded them in the schema file. The numbers go into the run's "
        "`config.yaml` (`derived.normalization`) and inside the model, so evaluate, predict and "
        "every export use them. A constant value (variance 0) is centred, not scaled. See "
        "[Your own CSV](csv.md#normalize).",
    )


class _Normalizable(_FeatureBase):
    """A numeric feature, which a model input may take standardized (``normalize``)."""

    @model_serializer(mode="wrap")
    def _without_default_normalize(self, handler: SerializerFunctionWrapHandler) -> dict:
        # Written only when on: configs, run directories and export sidecars of features that do
        # not normalize stay as they were.
        data = handler(self)
        if isinstance(data, dict) and not data.get("normalize"):
            data.pop("normalize", None)
        return data


class RawFeature(_Normalizable):
    type: Literal["raw"] = Field(
        description="One bytes value (an array's `tobytes()`), decoded with `tf.io.decode_raw` and "
        "reshaped to `shape`."
    )
    dtype: RawDType = Field("float32", description="The dtype the bytes were written as.")
    shape: list[Positive] = Field(
        description="The shape of one record's tensor after decoding; its byte length must fit."
    )
    cast: CastDType | None = Field(None, description="A dtype to cast to after decoding.")
    normalize: bool = _normalize()


class Int64Feature(_Normalizable):
    type: Literal["int64"] = Field(
        description="An int64 list, decoded to a fixed-length tensor (class indices, ids)."
    )
    shape: list[Positive] = Field(
        default_factory=list, description="`[]` for a scalar, which arrives batched as `(batch,)`."
    )
    cast: CastDType | None = Field(None, description="A dtype to cast to after decoding.")
    normalize: bool = _normalize()


class FloatFeature(_Normalizable):
    type: Literal["float"] = Field(
        description="A float list, decoded to a fixed-length tensor (a CSV column, or columns packed "
        "into one vector)."
    )
    shape: list[Positive] = Field(
        default_factory=list, description="`[]` for a scalar, `[n]` for a vector of n values."
    )
    cast: CastDType | None = Field(None, description="A dtype to cast to after decoding.")
    normalize: bool = _normalize()


class BytesFeature(_FeatureBase):
    type: Literal["bytes"] = Field(
        description="A bytes list, decoded to strings (ids, text columns)."
    )
    shape: list[Positive] = Field(default_factory=list, description="`[]` for a scalar string.")


class TextFeature(_FeatureBase):
    type: Literal["text"] = Field(
        description="One UTF-8 string per record (a bytes list of one value), decoded to a scalar "
        "`tf.string` that arrives batched as `(batch,)`: a prompt, a response, a document, for the "
        "model's preprocessor to tokenize. `tpurun data write` stores a JSONL file's strings and a "
        "CSV's text columns this way."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_normalize(cls, value: Any) -> Any:
        # A clearer answer than "unknown key": normalize is a key of the numeric types.
        if isinstance(value, dict) and "normalize" in value:
            raise ValueError(
                "normalize standardizes numbers, and a text feature is a string: the model's "
                "preprocessor (a tokenizer) turns it into numbers. Remove normalize here"
            )
        return value

    @property
    def shape(self) -> list[int]:
        """``[]``: one string per record (code that handles every feature reads ``shape``)."""
        return []


class ImageFeature(_FeatureBase):
    type: Literal["image"] = Field(
        description="JPEG, PNG, GIF or BMP bytes, decoded and resized to `shape`: floats in [0, 1] "
        "(0..255 with `scale: false`)."
    )
    shape: Annotated[list[Positive], Field(min_length=3, max_length=3)] = Field(
        description="`[height, width, channels]` (channels 1, 3 or 4); images are resized to it."
    )
    scale: bool = Field(
        True,
        description="Scale pixels to [0, 1] floats; `false` keeps 0..255. A preset's images are "
        "always fed 0..255: its image converter scales them as the model was pretrained.",
    )
    cast: CastDType | None = Field(None, description="A dtype to cast to after decoding.")

    @field_validator("shape")
    @classmethod
    def _channels(cls, shape: list[int]) -> list[int]:
        if shape[2] not in (1, 3, 4):
            raise ValueError(f"channels (the last value) must be 1, 3 or 4, got {shape[2]}")
        return shape


Feature = Annotated[
    RawFeature | Int64Feature | FloatFeature | BytesFeature | TextFeature | ImageFeature,
    Field(discriminator="type"),
]
FeatureRef = str | list[str] | dict[str, str]
