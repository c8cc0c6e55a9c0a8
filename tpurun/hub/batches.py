"""A preset's preprocessing inside the input pipeline: text (or images) to the task's batches.

Records are tokenised on the host, in the pipeline's parallel parse map, while the accelerator
trains: the preprocessor never runs inside ``fit`` (the session takes it off the task for the
fit, :func:`detach`, since ``Task.fit`` would map it again over batches already tokenised).

What a batch becomes, by task:

- a causal LM on one text feature (``inputs`` and ``targets`` the same): the preset's own
  preprocessor, ``(token_ids, padding_mask)`` to predict the next token, padding weighted 0;
- a causal LM on ``prompt`` and ``response``: both tokenised by the preset's tokenizer, joined
  and packed by its packer (start and end tokens as the preprocessor adds them), and only the
  response's tokens (and the end token) weighted: the model learns to answer, not to ask;
- anything else (a text or image classifier): ``preprocessor(inputs, targets)``;
- records tokenised once (``tpurun data write --tokenize``, :mod:`tpurun.hub.tokenize`): no
  tokenising; the batch comes straight from their features, after :func:`tokenize.check` has
  made sure this run's preprocessor would have made the same ones. Only this case runs on the
  native reader (numpy batches, no TensorFlow in the pipeline); a tokenizer needs tf.data
  (tensorflow-text), so ``data.reader: auto`` picks it (:func:`tpurun.data.reader.choose`).

The two causal LM paths share their packing (:mod:`tpurun.hub.tokenize`), so a run on tokenised
records sees exactly the batches a run on the text would.

Exact validation weighs the padding records of the last batch 0 (:mod:`tpurun.data.pipeline`):
that weight multiplies the tokens' own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tpurun import frameworks
from tpurun.config import Config, DataConfig
from tpurun.data import schema_file
from tpurun.errors import ConfigError
from tpurun.hub import tokenize
from tpurun.hub.report import set_up_cpu
from tpurun.hub.task_model import build_preprocessor

#: The task's methods that take batches: plain Keras' while the preprocessor is detached.
_BATCH_METHODS = ("fit", "evaluate", "predict")


def detach(task: Any) -> Any:
    """Take the preprocessor off ``task`` for the fit (``Task.fit`` would apply it again) and
    return it; :func:`attach` puts it back before the model is saved for inference.

    Until then the task's ``fit``, ``evaluate`` and ``predict`` are plain Keras' (``keras.Model``'s):
    KerasHub 0.32's turn any input that is not a ``tf.data`` or Grain dataset (the native reader's
    ``PyDataset``) into one of their own, which needs TensorFlow or Grain and fails on an endless
    stream. With no preprocessor they have nothing else to add.
    """
    keras = frameworks.keras()
    preprocessor = task.preprocessor
    task.preprocessor = None
    for name in _BATCH_METHODS:
        object.__setattr__(task, name, getattr(keras.Model, name).__get__(task))
    return preprocessor


def attach(task: Any, preprocessor: Any) -> None:
    task.preprocessor = preprocessor
    for name in _BATCH_METHODS:
        task.__dict__.pop(name, None)


def transform(
    preprocessor: Any, data: DataConfig, tokenized: dict | None = None, positions: bool = False
) -> Callable[..., tuple]:
    """``(inputs, targets[, weights])`` of decoded features -> the task's ``(x, y[, weights])``.

    Args:
        preprocessor: the task's, with the run's sequence length.
        data: the effective data section (features filled in, inputs and targets known).
        tokenized: for records written with ``--tokenize``, the schema file's entry
            (``ResolvedData.tokenized``), checked against ``preprocessor``.
        positions: a causal LM's model takes ``position_ids`` too
            (:func:`tpurun.hub.tokenize.takes_positions`).

    Raises:
        ConfigError: a causal LM fed something other than text features.
        DataError: tokenised records this preprocessor would not have made.
    """
    causal = tokenize.kind(preprocessor) == tokenize.CAUSAL_LM
    if schema_file.is_tokenized(data):
        tokenize.check(preprocessor, data, tokenized)
        step = _causal_tokens(positions) if causal else _classifier_tokens
    elif causal:
        _check_text(data)
        if data.inputs == data.targets:
            step = _whole_text(preprocessor)
        else:
            step = _prompt_response(preprocessor, positions)
    else:
        _check_kind(preprocessor, data)
        step = _labelled(preprocessor)

    def apply(inputs, targets, weights=None):
        x, y, token_weights = step(inputs, targets)
        if weights is not None:
            token_weights = _times(token_weights, weights)
        return (x, y) if token_weights is None else (x, y, token_weights)

    return apply


def _check_text(data: DataConfig) -> None:
    for key in ("inputs", "targets"):
        ref = getattr(data, key)
        names = DataConfig.names(ref)
        if not isinstance(ref, str) or data.features[names[0]].type != "text":
            raise ConfigError(
                [
                    f"data.{key}: a causal LM takes one text feature as its {key} (the prompt "
                    "and the response, or one text for both); found "
                    f"{ref!r}. Write the data with `tpurun data write FILE.jsonl OUT_PREFIX` "
                    "(prompt/response or text keys)."
                ]
            )


def _check_kind(preprocessor: Any, data: DataConfig) -> None:
    """A text classifier's inputs are text features, an image classifier's images: anything
    else would fail inside the pipeline at the first batch, in TensorFlow's words."""
    keras_hub = frameworks.keras_hub()
    takes = [(keras_hub.models.TextClassifierPreprocessor, "text", "a JSONL or CSV file"),
             (keras_hub.models.ImageClassifierPreprocessor, "image", "an image folder")]  # fmt: skip
    for cls, wanted, source in takes:
        if not isinstance(preprocessor, cls):
            continue
        for name in DataConfig.names(data.inputs):
            found = data.features[name].type
            if found != wanted:
                raise ConfigError(
                    [
                        f"data.inputs: {type(preprocessor).__name__} takes {wanted} features, and "
                        f"'{name}' is a {found} feature. Feed it {wanted} (`tpurun data write` "
                        f"from {source}), or choose another preset."
                    ]
                )


def _whole_text(preprocessor: Any) -> Callable:
    keras = frameworks.keras()

    def step(texts, _):
        return keras.utils.unpack_x_y_sample_weight(preprocessor(texts))

    return step


def _prompt_response(preprocessor: Any, positions: bool) -> Callable:
    """The prompt's and the response's tokens, packed as the preprocessor packs one text; only
    the response (and the end token) weighted."""
    pack = tokenize.pack_prompt_response(preprocessor)

    def step(prompts, responses):
        return tokenize.shifted(*pack(prompts, responses), positions)

    return step


def _causal_tokens(positions: bool) -> Callable:
    """Tokenised causal LM records (``N + 1`` tokens each) -> ``(x, y, weights)``."""

    def step(inputs, targets):
        ids, mask = inputs["token_ids"], inputs["padding_mask"]
        return tokenize.shifted(ids, mask, targets["weights"], positions)

    return step


def _classifier_tokens(inputs, targets):
    """Tokenised classifier records: the preprocessor's outputs as they were, and the label."""
    return inputs, targets, None


def token_inputs(preprocessor: Any, inputs: dict, positions: bool = False) -> dict:
    """Tokenised records' input features alone -> the task's inputs, as :func:`transform` makes
    them (a causal LM's ``N + 1`` tokens less the last): what ``export`` checks an artifact on,
    read without the targets."""
    if tokenize.kind(preprocessor) == tokenize.CAUSAL_LM:
        return _causal_tokens(positions)(inputs, {"weights": inputs["padding_mask"]})[0]
    return _classifier_tokens(inputs, None)[0]


def take_preprocessing(model: Any, config: Config, tokenized: dict | None) -> tuple[Any, Any]:
    """A preset task's preprocessor, taken off the task (:func:`detach`), and the pipeline's
    transform that does its work on the host instead, as train, evaluate and doctor feed the
    task; ``(None, None)`` for a factory's model.

    Raises:
        as :func:`transform`.
    """
    if config.model.preset is None or getattr(model, "preprocessor", None) is None:
        return None, None
    preprocessor = detach(model)
    positions = tokenize.takes_positions(model)
    return preprocessor, transform(preprocessor, config.data, tokenized, positions)


def pipeline_preprocessing(config: Config) -> Callable[[DataConfig, dict | None], Callable]:
    """For ``tpurun data bench`` on a preset config: ``(data, tokenized) ->`` the transform a
    run maps over its records; its ``preprocessor`` attribute is the preprocessor it uses. Sets
    this process up on the CPU and loads the preset's preprocessor (its tokenizer, not its
    weights).

    Raises:
        ModelError: as :func:`tpurun.hub.task_model.build_preprocessor`.
    """
    import functools

    set_up_cpu("jax", why="tpurun data bench runs the preset's preprocessor on the CPU")
    preprocessor = build_preprocessor(config)
    made = functools.partial(transform, preprocessor)
    made.preprocessor = preprocessor  # the token lengths bench reports are counted with it
    return made


def _labelled(preprocessor: Any) -> Callable:
    keras = frameworks.keras()

    def step(inputs, targets):
        return keras.utils.unpack_x_y_sample_weight(preprocessor(inputs, targets))

    return step


def _times(token_weights: Any, weights: Any) -> Any:
    """Each record's weight times its tokens' (or alone, for one weight per record): numpy arrays
    from the native reader, tensors inside tf.data."""
    import numpy as np

    if isinstance(weights, np.ndarray):
        weights = weights.astype(np.float32)
        if token_weights is None:
            return weights
        token_weights = np.asarray(token_weights, np.float32)
        return token_weights * weights.reshape([-1] + [1] * (token_weights.ndim - 1))
    tf = frameworks.tensorflow()
    weights = tf.cast(weights, tf.float32)
    if token_weights is None:
        return weights
    token_weights = tf.cast(token_weights, tf.float32)
    extra = len(token_weights.shape) - 1
    return token_weights * tf.reshape(weights, [-1] + [1] * extra)
