"""A preset's preprocessing inside the ``tf.data`` pipeline: text (or images) to the task's batches.

Records are tokenised on the host, in the pipeline's parallel parse map, while the accelerator
trains: the preprocessor never runs inside ``fit`` (the session takes it off the task for the
fit, :func:`detach`, since ``Task.fit`` would map it again over batches already tokenised).

What a batch becomes, by task:

- a causal LM on one text feature (``inputs`` and ``targets`` the same): the preset's own
  preprocessor, ``(token_ids, padding_mask)`` to predict the next token, padding weighted 0;
- a causal LM on ``prompt`` and ``response``: both tokenised by the preset's tokenizer, joined
  and packed by its packer (start and end tokens as the preprocessor adds them), and only the
  response's tokens (and the end token) weighted: the model learns to answer, not to ask;
- anything else (a text or image classifier): ``preprocessor(inputs, targets)``.

Exact validation weighs the padding records of the last batch 0 (:mod:`tpurun.data.pipeline`):
that weight multiplies the tokens' own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tpurun import frameworks
from tpurun.config import DataConfig
from tpurun.errors import ConfigError


def detach(task: Any) -> Any:
    """Take the preprocessor off ``task`` for the fit (``Task.fit`` would apply it again) and
    return it; :func:`attach` puts it back before the model is saved for inference."""
    preprocessor = task.preprocessor
    task.preprocessor = None
    return preprocessor


def attach(task: Any, preprocessor: Any) -> None:
    task.preprocessor = preprocessor


def transform(preprocessor: Any, data: DataConfig) -> Callable[..., tuple]:
    """``(inputs, targets[, weights])`` of decoded features -> the task's ``(x, y[, weights])``.

    Raises:
        ConfigError: a causal LM fed something other than text features.
    """
    keras_hub = frameworks.keras_hub()
    if isinstance(preprocessor, keras_hub.models.CausalLMPreprocessor):
        _check_text(data)
        if data.inputs == data.targets:
            step = _whole_text(preprocessor)
        else:
            step = _prompt_response(preprocessor)
    else:
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


def _whole_text(preprocessor: Any) -> Callable:
    keras = frameworks.keras()

    def step(texts, _):
        return keras.utils.unpack_x_y_sample_weight(preprocessor(texts))

    return step


def _prompt_response(preprocessor: Any) -> Callable:
    """The prompt's and the response's tokens, packed as the preprocessor packs one text; only
    the response (and the end token) weighted."""
    tf = frameworks.tensorflow()
    if preprocessor.packer is None:
        preprocessor.build(None)  # KerasHub makes the packer at build, once assets are loaded
    tokenizer, packer = preprocessor.tokenizer, preprocessor.packer
    start = 1 if preprocessor.add_start_token else 0

    def step(prompts, responses):
        length = preprocessor.sequence_length
        prompt_ids, response_ids = tokenizer(prompts), tokenizer(responses)
        joined = tf.concat([prompt_ids, response_ids], axis=1)
        token_ids, mask = packer(
            joined,
            sequence_length=length + 1,  # one more: x and y are the sequence shifted by one
            add_start_value=preprocessor.add_start_token,
            add_end_value=preprocessor.add_end_token,
        )
        # y[i] is token i + 1: a response token from i = start + len(prompt) - 1 on.
        first = tf.cast(start + prompt_ids.row_lengths() - 1, tf.int32)
        answer = tf.range(length)[tf.newaxis, :] >= first[:, tf.newaxis]
        x = {"token_ids": token_ids[:, :-1], "padding_mask": mask[:, :-1]}
        weights = tf.cast(tf.logical_and(mask[:, 1:], answer), tf.float32)
        return x, token_ids[:, 1:], weights

    return step


def _labelled(preprocessor: Any) -> Callable:
    keras = frameworks.keras()

    def step(inputs, targets):
        return keras.utils.unpack_x_y_sample_weight(preprocessor(inputs, targets))

    return step


def _times(token_weights: Any, weights: Any) -> Any:
    """Each record's weight times its tokens' (or alone, for one weight per record)."""
    tf = frameworks.tensorflow()
    weights = tf.cast(weights, tf.float32)
    if token_weights is None:
        return weights
    token_weights = tf.cast(token_weights, tf.float32)
    extra = len(token_weights.shape) - 1
    return token_weights * tf.reshape(weights, [-1] + [1] * extra)
