"""Text to token ids for a preset: packed once by ``tpurun data write --tokenize``, or in the pipeline.

Both paths pack text with the same functions, so records tokenised once train exactly as text
tokenised every epoch (:mod:`tpurun.hub.batches` reads either). What a record holds, by task:

- a causal LM: ``token_ids`` (int64 ``[N + 1]``: start token, the text or the prompt then the
  response, end token, padding, as the preset's packer lays them out), ``padding_mask`` (0/1
  ``[N + 1]``) and ``weights`` (``[N + 1]``, the weight of predicting token ``i``; 0 at the start
  token). One text: the padding mask again, stored 0/1 and read as the preprocessor's boolean
  sample weights. Prompt and response: float32 weights, 1 for the response and its end token
  only. A batch is ``x = {token_ids[:-1], padding_mask[:-1]}``, ``y = token_ids[1:]``,
  ``weights[1:]``, which is what ``CausalLMPreprocessor`` makes of ``N + 1`` tokens.
- a text classifier: the preprocessor's outputs (``token_ids``, ``padding_mask``, and
  ``segment_ids`` where the task takes them; ``[N]`` each) beside the source's label, as it was.

Each feature is stored as int64 (the weights too: 0 or 1) and declared with the ``cast`` back to
the dtype the preprocessor made (int32 ids, boolean masks, float32 weights). The schema file's
``tokenized`` entry records the
preset, its task, a fingerprint of its tokenizer and the sequence length; a run whose
preprocessor differs is refused (:func:`check`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tpurun import frameworks
from tpurun.data.packing import PackedSource
from tpurun.data.resolve import preset_refs
from tpurun.data.schema_file import TOKEN_INPUTS, TOKENIZED
from tpurun.data.sources.base import OVERHEAD_PER_FEATURE, MappedSource, Source
from tpurun.errors import ConfigError, DataError, EnvironmentSetupError, ModelError
from tpurun.hub import chat
from tpurun.hub.preset import check_sequence_length, is_handle, read_folder, read_handle
from tpurun.hub.report import set_up_cpu
from tpurun.hub.task import concrete, task_class
from tpurun.hub.task_model import preprocessor_from_preset

#: The features a tokenised causal LM record holds, in order.
CAUSAL_FEATURES = ("token_ids", "padding_mask", "weights")
CAUSAL_LM, CLASSIFIER = "causal_lm", "classifier"
#: Records tokenised per call of the preprocessor (a chunk is split into batches of this size).
BATCH = 256


# ------------------------------------------------------------------------ the packing both share
def pack_prompt_response(preprocessor: Any) -> Callable:
    """``(prompts, responses)`` -> ``(token_ids, padding_mask, weights)``, each ``[batch, N + 1]``:
    both texts tokenised, joined and packed as the preprocessor packs one text (start and end
    tokens, truncation, padding); only the response's tokens and the end token weighted."""
    tf = frameworks.tensorflow()
    if preprocessor.packer is None:
        preprocessor.build(None)  # KerasHub makes the packer at build, once assets are loaded
    tokenizer, packer = preprocessor.tokenizer, preprocessor.packer
    start = 1 if preprocessor.add_start_token else 0
    end = 1 if preprocessor.add_end_token else 0
    length = preprocessor.sequence_length + 1  # x and y: shifted by one

    def pack(prompts, responses):
        prompt_ids, response_ids = tokenizer(prompts), tokenizer(responses)
        joined = tf.concat([prompt_ids, response_ids], axis=1)
        # The packer's second output is a padding mask (StartEndPacker: Gemma, Llama, ...) or
        # segment ids (MultiSegmentPacker: Gemma 3); the mask comes from the lengths for both.
        token_ids, _ = packer(
            joined,
            sequence_length=length,
            add_start_value=preprocessor.add_start_token,
            add_end_value=preprocessor.add_end_token,
        )
        filled = tf.minimum(start + joined.row_lengths() + end, length)
        # Token i is a response token (or the end token) from i = start + len(prompt) on.
        first = start + prompt_ids.row_lengths()
        positions = tf.range(length, dtype=filled.dtype)[tf.newaxis, :]
        mask = positions < filled[:, tf.newaxis]
        answer = positions >= first[:, tf.newaxis]
        return token_ids, mask, tf.cast(tf.logical_and(mask, answer), tf.float32)

    return pack


def pack_whole_text(preprocessor: Any) -> Callable:
    """``texts`` -> ``(token_ids, padding_mask, weights)``, each ``[batch, N + 1]``: the
    preprocessor's own batch (its ``N`` inputs, targets shifted by one, padding weights) put back
    together, so that :func:`shifted` gives that batch again."""
    keras, tf = frameworks.keras(), frameworks.tensorflow()

    def pack(texts):
        x, y, weights = keras.utils.unpack_x_y_sample_weight(preprocessor(texts))
        token_ids = tf.concat([x["token_ids"], y[:, -1:]], axis=1)
        mask = tf.concat([x["padding_mask"], weights[:, -1:]], axis=1)
        return token_ids, mask, tf.concat([tf.zeros_like(weights[:, :1]), weights], axis=1)

    return pack


def shifted(
    token_ids: Any, mask: Any, weights: Any, positions: bool = False
) -> tuple[dict, Any, Any]:
    """``N + 1`` packed tokens -> a causal LM's ``(x, y, weights)``: predict each next token.
    ``positions``: the backbone also takes each token's position (:func:`takes_positions`), given
    as its preprocessor gives them: 0, 1, ... along the sequence (numpy arrays from the native
    reader, tensors inside tf.data)."""
    x = {"token_ids": token_ids[:, :-1], "padding_mask": mask[:, :-1]}
    if positions:
        x["position_ids"] = position_ids(x["token_ids"])
    return x, token_ids[:, 1:], weights[:, 1:]


def takes_positions(task: Any) -> bool:
    """Whether a task's model takes ``position_ids`` beside its tokens (Gemma 4's backbone does;
    KerasHub's Gemma4CausalLMPreprocessor makes them)."""
    return "position_ids" in {tensor.name for tensor in task.inputs}


def position_ids(ids: Any) -> Any:
    """Each token's position in ``ids`` (``[batch, length]``), 0, 1, ... as int32: a numpy array
    for numpy ids, a tensor for tensors."""
    import numpy as np

    if isinstance(ids, np.ndarray):
        return np.broadcast_to(np.arange(ids.shape[-1], dtype=np.int32), ids.shape).copy()
    tf = frameworks.tensorflow()
    return tf.broadcast_to(tf.range(tf.shape(ids)[-1], dtype=tf.int32), tf.shape(ids))


# ------------------------------------------------------------ what the records were made with
def kind(preprocessor: Any) -> str:
    """``causal_lm`` or ``classifier``: the record layout this preprocessor's task trains on."""
    keras_hub = frameworks.keras_hub()
    if isinstance(preprocessor, keras_hub.models.CausalLMPreprocessor):
        return CAUSAL_LM
    return CLASSIFIER


def fingerprint(tokenizer: Any) -> str:
    """A hash of what decides the ids a tokenizer gives: its class, its settings and its asset
    files (a SentencePiece model, a vocabulary, merges), as ``save_assets`` writes them. Two
    presets that share a tokenizer (sizes of one model family) have the same fingerprint."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    settings = {k: v for k, v in tokenizer.get_config().items()
                if k not in ("name", "trainable", "dtype")}  # fmt: skip
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_assets(folder)
        for name in sorted(os.listdir(folder)):
            digest.update(name.encode())
            digest.update(Path(folder, name).read_bytes())
    return "sha256:" + digest.hexdigest()


def check(preprocessor: Any, data: Any, tokenized: dict | None) -> None:
    """Refuse tokenised records this run's preprocessor would not have made.

    Args:
        preprocessor: the run's (its tokenizer and sequence length).
        data: the effective data section, reading tokenised records
            (:func:`tpurun.data.schema_file.is_tokenized`).
        tokenized: the schema file's ``tokenized`` entry (with ``schema``, its path); None for
            records without one (only their layout and length are checked then).

    Raises:
        DataError: records for another kind of task, another sequence length or another
            tokenizer, naming what to change.
    """
    want, where = kind(preprocessor), "the records"
    if tokenized:
        where = f"the records of {tokenized.get('schema', 'data.train')}"
        have = tokenized.get("kind")
    else:
        have = CAUSAL_LM if "weights" in data.features else CLASSIFIER
    rewrite = "write the records again with `tpurun data write SOURCE OUT_PREFIX --tokenize PRESET"
    if have != want:
        made = f" for {tokenized.get('task')}" if tokenized else ""
        raise DataError(
            f"data.train: {where} were tokenised{made} as {have.replace('_', ' ')} records, and "
            f"model.preset builds a {want.replace('_', ' ')} ({type(preprocessor).__name__}): "
            f"train the preset they were written for, or {rewrite}` with this one."
        )
    positions = data.features[data.inputs["token_ids"]].shape[-1]
    length = positions - 1 if want == CAUSAL_LM else positions
    if length != preprocessor.sequence_length:
        raise DataError(
            f"model.sequence_length: {where} hold sequences of {length} tokens, and this run's "
            f"preprocessor packs {preprocessor.sequence_length}: set model.sequence_length: "
            f"{length}, or {rewrite} --sequence-length {preprocessor.sequence_length}`."
        )
    if tokenized and tokenized.get("fingerprint") != fingerprint(preprocessor.tokenizer):
        raise DataError(
            f"model.preset: {where} were tokenised by the tokenizer of {tokenized.get('preset')} "
            f"({tokenized.get('tokenizer')}), and this preset's tokenizer "
            f"({type(preprocessor.tokenizer).__name__}) gives other ids: the model would read "
            f"other words. Train the preset they were written for, or {rewrite} "
            f"--sequence-length {preprocessor.sequence_length}` with this one."
        )


# --------------------------------------------------------------------- tpurun data write --tokenize
def load(preset: str, sequence_length: int | None) -> tuple[Any, dict[str, Any]]:
    """The preset task's preprocessor for ``--tokenize PRESET --sequence-length N``, and the
    ``tokenized`` entry that describes it (without the source's part).

    Raises:
        ModelError: no such preset or an incomplete one (naming the file), a sequence length over
            the backbone's maximum, a task that takes no text.
    """
    where = preset if is_handle(preset) else str(Path(preset).resolve())
    try:
        found = read_handle(where) if is_handle(where) else read_folder(Path(where), preset)
        check_sequence_length(found.backbone, found.backbone_config, sequence_length)
        task = concrete(task_class(found, None), found)
    except ModelError as exc:
        message = str(exc).replace("model.preset:", "--tokenize:", 1)
        raise ModelError(
            message.replace("model.sequence_length:", "--sequence-length:", 1)
        ) from None
    preprocessor_cls = getattr(task, "preprocessor_cls", None)
    keras_hub = frameworks.keras_hub()
    text = (keras_hub.models.CausalLMPreprocessor, keras_hub.models.TextClassifierPreprocessor)
    if preprocessor_cls is None or not issubclass(preprocessor_cls, text):
        raise ModelError(
            f"--tokenize: {preset} is a {task.__name__}; tokenising writes records for causal LMs "
            "and text classifiers. Write the records without --tokenize: the preset's "
            "preprocessor reads them in the pipeline."
        )
    preprocessor = preprocessor_from_preset(preprocessor_cls, found.location, "--tokenize")
    if sequence_length is not None:
        preprocessor.sequence_length = sequence_length
    entry = {
        "preset": found.location,
        "task": task.__name__,
        "kind": kind(preprocessor),
        "preprocessor": type(preprocessor).__name__,
        "tokenizer": type(preprocessor.tokenizer).__name__,
        "fingerprint": fingerprint(preprocessor.tokenizer),
        "sequence_length": preprocessor.sequence_length,
    }
    return preprocessor, entry


def mapper(
    preset: str, sequence_length: int | None, chat_template: Any = None, packing: bool = False
) -> Callable[[Source], Source]:
    """What ``tpurun data write --tokenize`` does to the source it opened: its text replaced by
    token ids, a chunk at a time (a chat source's conversations by the preset's chat format,
    :mod:`tpurun.hub.chat`, or ``chat_template``), then with ``packing`` the train split's
    examples packed into full sequences (:mod:`tpurun.data.packing`). Sets this process up on the
    CPU and loads the preprocessor at once, so a bad preset fails before the source is read.

    Raises:
        ModelError: as :func:`load`; packing for a classifier.
    """
    if importlib.util.find_spec("tensorflow") is None:
        raise EnvironmentSetupError(
            f"--tokenize {preset}: KerasHub's tokenizers run on tensorflow-text (keras-hub 0.32), "
            "and TensorFlow is not installed here. Install the extra (pip install "
            "'tpurun[hub]'), or tokenise where it is (a Kaggle or Colab CPU session, a laptop) "
            "and copy the records here: training on token ids needs no TensorFlow."
        )
    set_up_cpu("jax", why="tpurun data write tokenises text on the CPU")
    preprocessor, entry = load(preset, sequence_length)
    if packing and entry["kind"] != CAUSAL_LM:
        raise ModelError(
            f"--packing: packs a causal LM's examples into full sequences, and {preset} is a "
            f"{entry['task']}, whose records are one example each. Leave --packing out."
        )

    def mapped(source: Source) -> Source:
        if source.layout.get("chat"):
            made = chat.mapped(source, preprocessor, entry, chat_template)
        elif chat_template is not None:
            raise DataError(
                f"{source.path}: --chat-template applies to chat data (lines of 'messages'); "
                "this source holds other records. Leave it out."
            )
        else:
            made = _Tokenizing(source, preprocessor, entry).mapped()
        return PackedSource(made) if packing else made

    return mapped


class _Tokenizing:
    """One source's tokenising: which features are text, the step that packs them, the features
    and layout of the records it makes."""

    def __init__(self, source: Source, preprocessor: Any, entry: dict[str, Any]):
        self.source, self.preprocessor, self.entry = source, preprocessor, dict(entry)
        self.inputs, self.targets = _refs(source, entry)
        self.causal = entry["kind"] == CAUSAL_LM
        if self.causal and self.inputs == self.targets:
            self.step = pack_whole_text(preprocessor)
        elif self.causal:
            self.step = pack_prompt_response(preprocessor)
        else:
            self.step = self._classify
        texts = _names(self.inputs) + (_names(self.targets) if self.causal else [])
        self.used = list(dict.fromkeys(texts))  # one text is both inputs and targets

    def _classify(self, *texts):
        keras = frameworks.keras()
        x, _, _ = keras.utils.unpack_x_y_sample_weight(
            self.preprocessor(texts[0] if len(texts) == 1 else tuple(texts))
        )
        return x

    def mapped(self) -> Source:
        source = self.source
        spec = self._run({name: [b""] for name in self.used}, spec_only=True)
        features = {}
        for name, tensor in spec.items():
            # Ids, masks and 0/1 weights alike: int64 (a varint of a byte or two each, where a
            # float takes four), read back as the dtype the preprocessor made.
            features[name] = {"type": "int64", "shape": tensor.shape.as_list()[1:]}
            if tensor.dtype.name != "int64":
                features[name]["cast"] = tensor.dtype.name
        if not self.causal:
            features[self.targets] = dict(source.features[self.targets])
        positions = spec["token_ids"].shape[-1]
        vocabulary = self.preprocessor.tokenizer.vocabulary_size()
        id_bytes = max(1, -(-max(1, vocabulary - 1).bit_length() // 7))  # a varint's length
        per_record = positions * (id_bytes + len(spec) - 1) + OVERHEAD_PER_FEATURE * len(features)
        if not self.causal:
            per_record += source.nbytes // max(1, source.records) // len(source.features)
        self.entry.update(
            source={"inputs": self.inputs, "targets": self.targets},
            features=[name for name in features if name in (*CAUSAL_FEATURES, *TOKEN_INPUTS)],
            mask="padding_mask",
        )
        return MappedSource(
            source,
            self._tokenized,
            features,
            per_record * source.records,
            layout={TOKENIZED: self.entry},
        )

    def _tokenized(self, chunk: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        out = {}
        for name, column in self._run({name: chunk[name] for name in self.used}).items():
            out[name] = column.astype(np.int64)  # the weights too: 0 or 1, exactly
        if not self.causal:
            out[self.targets] = chunk[self.targets]
        return out

    def _run(self, columns: dict[str, Any], spec_only: bool = False) -> dict[str, Any]:
        """The packed features of a chunk's text columns, through ``tf.data`` as the training
        pipeline runs the preprocessor (its TensorFlow graph, not its Python path)."""
        import numpy as np

        tf = frameworks.tensorflow()
        tensors = {name: tf.constant(list(column), tf.string) for name, column in columns.items()}

        def step(batch):
            if self.causal:
                args = (
                    [batch[self.inputs]]
                    if self.inputs == self.targets
                    else [batch[self.inputs], batch[self.targets]]
                )
                return dict(zip(CAUSAL_FEATURES, self.step(*args), strict=True))
            return {k: v for k, v in self.step(*[batch[n] for n in _names(self.inputs)]).items()
                    if k in TOKEN_INPUTS}  # fmt: skip

        ds = tf.data.Dataset.from_tensor_slices(tensors).batch(BATCH)
        ds = ds.map(step, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if spec_only:
            return ds.element_spec
        parts = list(ds.as_numpy_iterator())
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def _names(ref: Any) -> list[str]:
    return [ref] if isinstance(ref, str) else list(ref)


def _refs(source: Source, entry: dict[str, Any]) -> tuple[Any, Any]:
    """The source's text (and label) features, as a run would take them (``preset_refs``).

    Raises:
        DataError: features that are not what the task learns from, naming them.
    """
    kinds = {name: spec.get("type") for name, spec in source.features.items()}
    described = ", ".join(f"{name} ({kind})" for name, kind in kinds.items())
    wanted = (
        "prompt and response text keys, or one text key"
        if entry["kind"] == CAUSAL_LM
        else "text features and one label (--label)"
    )
    problem = DataError(
        f"{source.path}: --tokenize for {entry['task']} takes {wanted}; the source has "
        f"{described}. Give the source only those columns (keys)."
    )
    try:
        inputs, targets = preset_refs(source.features, None, None)
    except ConfigError:
        raise problem from None
    texts = all(kinds[name] == "text" for name in _names(inputs))
    if entry["kind"] == CAUSAL_LM:
        if not (texts and isinstance(inputs, str) and kinds[targets] == "text"):
            raise problem
    elif not (texts and isinstance(targets, str) and kinds[targets] != "text"):
        raise problem
    return inputs, targets
