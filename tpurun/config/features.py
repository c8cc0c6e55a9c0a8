"""The feature types of ``data.features``: how one record key decodes (``type`` picks the kind)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
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


class CategoryFeature(_FeatureBase):
    type: Literal["category"] = Field(
        description="One string per record (a CSV's text column, as `tpurun data write` stores it: "
        "`island: Biscoe`), mapped by `vocabulary` to an integer id, 1 to K for its K values and 0 "
        "for a value not in it (out of vocabulary: a value the training records never had), as "
        "Keras' `StringLookup` numbers them. The model receives the id (`encode: index`, for an "
        "`Embedding` of `vocabulary_sizes[NAME]` rows: see [Your own CSV](csv.md#categories)) or "
        "its one-hot vector of K + 1 floats (`encode: one_hot`). The mapping runs in the input "
        "pipeline, on both readers: exported models take the ids or vectors, and the vocabulary "
        "is in the run's `config.yaml` and the export's spec."
    )
    encode: Literal["one_hot", "index"] = Field(
        "one_hot",
        description="`one_hot`: a float32 vector of K + 1 values, 1 at the value's id (position 0 "
        "for a value out of the vocabulary). `index`: the id itself, an int32 scalar "
        "(`keras.Input(shape=(), dtype='int32')`).",
    )
    vocabulary: list[Annotated[str, Field(max_length=1000)]] | None = Field(
        None,
        min_length=1,
        description="The values, id 1 first. Left out: the schema file's vocabulary of the column "
        "over the train split, most frequent first (`tpurun data write` records up to 1,000 values "
        "of a text column with at most 10,000 distinct values of up to 100 characters); the run's "
        "`config.yaml` keeps the list it trained with, for evaluate, predict and export.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_normalize(cls, value: Any) -> Any:
        # A clearer answer than "unknown key": normalize is a key of the numeric types.
        if isinstance(value, dict) and "normalize" in value:
            raise ValueError(
                "normalize standardizes numbers, and a category becomes an id or a one-hot "
                "vector (encode). Remove normalize here"
            )
        return value

    @field_validator("vocabulary")
    @classmethod
    def _distinct(cls, values: list[str] | None) -> list[str] | None:
        repeated = sorted({v for v in values or () if values.count(v) > 1})
        if repeated:
            raise ValueError(f"each value once; {repeated} appear more than once")
        return values

    @property
    def size(self) -> int | None:
        """The number of ids, 0 (out of vocabulary) included: K + 1; None before the vocabulary
        is known (a config not yet resolved against its data)."""
        return None if self.vocabulary is None else len(self.vocabulary) + 1

    @property
    def shape(self) -> list[int]:
        """``[]`` for an id, ``[K + 1]`` for a one-hot vector (``[]`` until the vocabulary is
        known)."""
        return [self.size] if self.encode == "one_hot" and self.size else []


class FeatureOptions(Section):
    """A feature entry without ``type``: options over the schema file's entry of the same name
    (``x: {normalize: true}``), merged when the data is resolved."""

    TAG: ClassVar[str] = "options"
    key: str | None = Field(None, description="As the feature type's `key`.")
    shape: list[Positive] | None = Field(None, description="As the feature type's `shape`.")
    dtype: RawDType | None = Field(None, description="As `raw`'s `dtype`.")
    cast: CastDType | None = Field(None, description="As the feature type's `cast`.")
    normalize: bool | None = Field(None, description="As the numeric types' `normalize`.")
    scale: bool | None = Field(None, description="As `image`'s `scale`.")
    encode: Literal["one_hot", "index"] | None = Field(None, description="As `category`'s.")
    vocabulary: list[str] | None = Field(None, description="As `category`'s.")

    @model_serializer(mode="wrap")
    def _given_only(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def _feature_tag(value: Any) -> str:
    """The feature type a ``data.features`` entry names, or ``options`` for one without."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind is not None else FeatureOptions.TAG


Feature = Annotated[
    Annotated[RawFeature, Tag("raw")]
    | Annotated[Int64Feature, Tag("int64")]
    | Annotated[FloatFeature, Tag("float")]
    | Annotated[BytesFeature, Tag("bytes")]
    | Annotated[TextFeature, Tag("text")]
    | Annotated[ImageFeature, Tag("image")]
    | Annotated[CategoryFeature, Tag("category")]
    | Annotated[FeatureOptions, Tag(FeatureOptions.TAG)],
    Discriminator(_feature_tag),
]
FeatureRef = str | list[str] | dict[str, str]
