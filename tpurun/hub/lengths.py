"""How long a preset's records are in tokens, and what ``model.sequence_length`` cuts off.

The preprocessor truncates every record longer than the sequence length, without a word; a
response cut off is a response the model never learns to finish. ``train`` and ``tpurun data
bench`` say what share of the records is cut and the length that would keep 95% of them whole;
``tpurun data inspect --preset`` shows the distribution.

Counted from a sample, not the dataset: the first records of up to :data:`FILES` files spread over
the list, :data:`SAMPLE` records at most, tokenised by the preset's own tokenizer. That costs a
fraction of a second at every start, where a pass over a large dataset would cost a pass over it
(and `data write` cannot count tokens: it does not know the tokenizer). Records tokenised once
(``data write --tokenize``) were packed at their length already: nothing is counted for them.

A record's length is what ``model.sequence_length`` has to be for it to be whole: a causal LM's
tokens (start and end tokens included) less one, since each position predicts the next; a
classifier's tokens with the special ones its packer adds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tpurun import frameworks
from tpurun.config import DataConfig
from tpurun.data import decode, schema_file
from tpurun.data.native import example, framing
from tpurun.data.resolve import preset_refs
from tpurun.errors import ConfigError, DataError, ModelError
from tpurun.hub import tokenize
from tpurun.hub.report import set_up_cpu
from tpurun.hub.task_model import longest_sequence

#: Records sampled at most, and files they are read from (the first records of each).
SAMPLE, FILES = 512, 8
#: The share of records a suggested sequence length keeps whole.
KEEP = 0.95


@dataclass(frozen=True)
class TokenLengths:
    """The sampled records' lengths in tokens (sorted), against a sequence length."""

    lengths: list[int]
    sequence_length: int
    records: int  # in the files sampled from (all of them: the sample is the whole set)
    maximum: int | None = None  # the preset's longest sequence

    @property
    def cut(self) -> int:
        return sum(1 for n in self.lengths if n > self.sequence_length)

    @property
    def share_cut(self) -> float:
        return self.cut / len(self.lengths)

    def keeping(self, share: float = KEEP) -> int:
        """The shortest sequence length that keeps ``share`` of the sampled records whole."""
        return self.lengths[max(0, math.ceil(share * len(self.lengths)) - 1)]

    def percentile(self, p: float) -> int:
        return self.keeping(p / 100)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sampled": len(self.lengths),
            "sequence_length": self.sequence_length,
            "cut": self.cut,
            "share_cut": round(self.share_cut, 4),
            "keep_95": self.keeping(),
            "min": self.lengths[0],
            "p50": self.percentile(50),
            "p90": self.percentile(90),
            "max": self.lengths[-1],
            "preset_maximum": self.maximum,
            "sentence": self.sentence(),
        }

    def sentence(self) -> str:
        """One line: the share cut at the sequence length, and the length that keeps 95%."""
        n = len(self.lengths)
        sampled = f"all {n} records" if n == self.records else f"{n} sampled records"
        head = f"model.sequence_length: {self.sequence_length} tokens"
        if not self.cut:
            return (
                f"{head} keeps every record whole ({sampled}; the longest needs {self.lengths[-1]})"
            )
        keep = self.keeping()
        advice = f"{KEEP:.0%} of them fit in {keep}: set model.sequence_length: {keep}"
        if self.maximum is not None and keep > self.maximum:
            advice = (
                f"{KEEP:.0%} of them need {keep}, over the preset's maximum of {self.maximum}: "
                "shorten the texts, or accept the cut"
            )
        return (
            f"{head} cuts {self.share_cut:.0%} of the records ({self.cut} of {sampled} are "
            f"longer; the longest needs {self.lengths[-1]}); {advice}"
        )


def measure(
    preprocessor: Any, data: DataConfig, files: Sequence[str], maximum: int | None = None
) -> TokenLengths | None:
    """The token lengths of a sample of ``files`` for a preset's text task (``data``: the
    effective data section, inputs and targets known); None for records tokenised once, an image
    task, or no records."""
    if schema_file.is_tokenized(data) or not hasattr(preprocessor, "tokenizer"):
        return None
    names = DataConfig.names(data.inputs)
    if tokenize.kind(preprocessor) == tokenize.CAUSAL_LM and data.targets != data.inputs:
        names = [*names, *DataConfig.names(data.targets)]
    if any(data.features[n].type != "text" for n in names):
        return None
    keys = [decode.record_key(n, data.features[n]) for n in names]
    return count(preprocessor, keys, files, data.compression, maximum)


def count(
    preprocessor: Any,
    keys: list[str],
    files: Sequence[str],
    compression: str,
    maximum: int | None = None,
    sample: int = SAMPLE,
) -> TokenLengths | None:
    """The token lengths of a sample of ``files``, whose text features under the record ``keys``
    (a causal LM's prompt then response, or a classifier's segments) make one sequence."""
    texts, records = _sample(files, compression, keys, sample)
    if not texts[keys[0]]:
        return None
    counted = [_token_counts(preprocessor, texts[k]) for k in keys]
    totals = [sum(parts) for parts in zip(*counted, strict=True)]
    if tokenize.kind(preprocessor) == tokenize.CAUSAL_LM:
        specials = int(preprocessor.add_start_token) + int(preprocessor.add_end_token) - 1
    else:
        specials = _classifier_specials(preprocessor, len(keys))
    lengths = sorted(t + specials for t in totals)
    return TokenLengths(lengths, int(preprocessor.sequence_length), records, maximum)


def _sample(
    files: Sequence[str], compression: str, keys: list[str], sample: int
) -> tuple[dict[str, list[str]], int]:
    """The text of the first records of up to :data:`FILES` files spread over ``files``, and how
    many records were read (a file's end reached is all of it)."""
    step = max(1, len(files) / FILES)
    chosen = [files[int(i * step)] for i in range(min(FILES, len(files)))]
    per_file = -(-sample // len(chosen))
    texts: dict[str, list[str]] = {key: [] for key in keys}
    for path in chosen:
        reader = framing.iter_records(path, compression)
        try:
            for _, record in zip(range(per_file), reader, strict=False):
                feature = example.parse(record).features.feature
                for key in keys:
                    texts[key].append(feature[key].bytes_list.value[0].decode("utf-8"))
        finally:
            reader.close()
    return texts, len(texts[keys[0]])


def _token_counts(preprocessor: Any, texts: list[str]) -> list[int]:
    tf = frameworks.tensorflow()
    ids = preprocessor.tokenizer(tf.constant(texts, tf.string))
    if hasattr(ids, "row_lengths"):  # a ragged tensor, inside tf.data or on the TF backend
        return [int(n) for n in ids.row_lengths().numpy()]
    return [len(row) for row in ids]  # KerasHub's lists, eager on JAX


def _classifier_specials(preprocessor: Any, segments: int) -> int:
    """The tokens a classifier's packer adds to ``segments`` texts ([CLS], [SEP]s): its padding
    mask over empty texts."""
    keras, tf = frameworks.keras(), frameworks.tensorflow()
    empty = tf.constant([""], tf.string)
    x, _, _ = keras.utils.unpack_x_y_sample_weight(
        preprocessor(empty if segments == 1 else tuple([empty] * segments))
    )
    return int(tf.reduce_sum(tf.cast(x["padding_mask"], tf.int32)))


def measurer(preprocessor: Any) -> Callable[[DataConfig, Sequence[str]], dict[str, Any] | None]:
    """For ``tpurun data bench``: ``(data, train files) ->`` :meth:`TokenLengths.to_dict`, or None
    where nothing is counted."""

    def measured(data: DataConfig, files: Sequence[str]) -> dict[str, Any] | None:
        found = measure(preprocessor, data, files)
        return found.to_dict() if found is not None else None

    return measured


def say_truncation(task: Any, preprocessor: Any, prepared: Any, say: Any) -> TokenLengths | None:
    """For ``train``: measure the training files' sample and say its one line, a warning when
    records are cut. ``prepared``: the run's (its effective data section and train files);
    ``say``: the reporter's ``message``."""
    if preprocessor is None:
        return None
    packed = (prepared.data.tokenized or {}).get("packing")
    if packed:
        say(packing_note(packed), "note")
    found = measure(
        preprocessor, prepared.config.data, prepared.data.train_files, longest_sequence(task)
    )
    if found is not None:
        say(found.sentence(), "warn" if found.cut else "note")
    return found


def packing_note(packed: dict[str, Any]) -> str:
    """The start line of a run on packed records (the schema file's ``packing`` entry)."""
    return (
        f"data.train: packed records ({packed['examples']:,} examples in {packed['records']:,} "
        f"records, padding {packed['padding']:.0%} where unpacked it was "
        f"{packed['padding_unpacked']:.0%}). KerasHub's causal LMs take no segment mask: an "
        "example attends to those before it in its record, and positions run on across them. "
        "Validation is not packed: each example is scored once, alone."
    )


def of_inspected(preset: str, sequence_length: int | None, report: Any) -> dict[str, Any] | None:
    """For ``tpurun data inspect --preset``: the token lengths of the inspected files' sample
    (:meth:`TokenLengths.to_dict`, with the preset), their text features taken as a run takes
    them; None where they hold no text for the preset (tokenised records, images).

    Raises:
        ModelError: a preset that is missing, incomplete or takes no text (as ``--tokenize``
            says it), a sequence length over its maximum.
        DataError: the features do not say which text is the prompt (as a run's config).
    """
    set_up_cpu("jax", why="tpurun data inspect --preset counts tokens on the CPU")
    try:
        preprocessor, _ = tokenize.load(preset, sequence_length)
    except ModelError as exc:
        raise ModelError(str(exc).replace("--tokenize", "--preset")) from None
    features = {f.name: f for f in report.features if f.spec is not None}
    try:
        inputs, targets = preset_refs({n: f.spec for n, f in features.items()}, None, None)
    except ConfigError as exc:
        raise DataError(f"--preset: {exc}") from None
    names = DataConfig.names(inputs)
    if tokenize.kind(preprocessor) == tokenize.CAUSAL_LM and targets != inputs:
        names = [*names, *DataConfig.names(targets)]
    if any(features[n].spec.get("type") != "text" for n in names):
        return None
    found = count(
        preprocessor,
        [features[n].key for n in names],
        [f.path for f in report.files],
        report.compression,
    )
    return None if found is None else {"preset": preset, **found.to_dict()}
