"""The feature types of ``data.features``: how one record key decodes (``type`` picks the kind)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

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
        None, description="The key in the record, when it differs from the name."
    )


class RawFeature(_FeatureBase):
    type: Literal["raw"]
    dtype: RawDType = Field("float32", description="The dtype the bytes were written as.")
    shape: list[Positive] = Field(description="Shape of one record's tensor after decoding.")
    cast: CastDType | None = Field(None, description="Cast after decoding.")


class Int64Feature(_FeatureBase):
    type: Literal["int64"]
    shape: list[Positive] = Field(default_factory=list, description="[] for a scalar.")
    cast: CastDType | None = None


class FloatFeature(_FeatureBase):
    type: Literal["float"]
    shape: list[Positive] = Field(default_factory=list, description="[] for a scalar.")
    cast: CastDType | None = None


class BytesFeature(_FeatureBase):
    type: Literal["bytes"]
    shape: list[Positive] = Field(default_factory=list, description="[] for a scalar string.")


class ImageFeature(_FeatureBase):
    type: Literal["image"]
    shape: Annotated[list[Positive], Field(min_length=3, max_length=3)] = Field(
        description="[height, width, channels]; images are resized to it."
    )
    scale: bool = Field(True, description="Scale pixels to [0, 1] floats; false keeps 0..255.")
    cast: CastDType | None = None

    @field_validator("shape")
    @classmethod
    def _channels(cls, shape: list[int]) -> list[int]:
        if shape[2] not in (1, 3, 4):
            raise ValueError(f"channels (the last value) must be 1, 3 or 4, got {shape[2]}")
        return shape


Feature = Annotated[
    RawFeature | Int64Feature | FloatFeature | BytesFeature | ImageFeature,
    Field(discriminator="type"),
]
FeatureRef = str | list[str] | dict[str, str]
