"""``tpurun predict``: a trained run's predictions for every record of a test set, in file order,
streamed to a CSV, ``.npy`` or ``.npz`` file.

Records are read in file order (sorted file names, then record order: a submission's rows follow its
test set), in batches of the run's global batch; the last batch is padded and its padding rows
dropped, so the rows are the same on any replica count. Each batch's rows are written as they come
(:mod:`tpurun.infer.prediction_writers`): a multi-GB output never sits in memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tpurun import frameworks
from tpurun.config import DataConfig, TextFeature
from tpurun.config.features import BytesFeature, FloatFeature, Int64Feature
from tpurun.data import reader as readers
from tpurun.data.native import example
from tpurun.errors import DataError, TpurunError
from tpurun.infer import (
    chat_prompts,
    generate,
    prediction_writers,
    preset_task,
    prompts,
    trained_run,
)

KINDS = (".csv", ".npy", ".npz")
_KINDS_SAID = (
    "name a .csv file (an id column and one column per output, or class names and "
    "probabilities), or .npy / .npz for arrays"
)


def output_kind(path: str, generates: bool | None = False) -> str:
    """``.csv``, ``.npy`` or ``.npz`` from the output's name; a causal LM's (``generates``):
    ``.csv`` or ``.jsonl``; not known yet (None): any of them.

    Raises:
        TpurunError: another suffix.
    """
    if generates:
        return generate.output_kind(path)
    if generates is None:
        return generate.suffix_of(
            path,
            (*KINDS, *generate.OUTPUTS),
            f"{_KINDS_SAID}; a causal LM's completions: .csv or .jsonl.",
        )
    return generate.suffix_of(path, KINDS, f"{_KINDS_SAID}.")


def id_spec(data: Any, name: str, serialized: bytes, filename: str) -> Any:
    """How to read ``--id-feature NAME``: as data.features declares it, else as the first record
    holds it (one bytes, int64 or float value)."""
    if name in data.features:
        feature = data.features[name]
        if getattr(feature, "shape", [1]) not in ([], [1]):
            raise DataError(
                f"--id-feature {name}: data.features declares {feature.shape} values "
                "per record; an id is one value."
            )
        return feature
    stored = example.parse(serialized).features.feature
    if name not in stored:
        raise DataError(
            f"--id-feature {name}: {filename} holds no feature '{name}'; its records hold: "
            f"{', '.join(sorted(stored)) or 'nothing'}."
        )
    kind = stored[name].WhichOneof("kind")
    values = getattr(stored[name], kind).value if kind else []
    if len(values) != 1:
        raise DataError(
            f"--id-feature {name}: {filename} holds {len(values)} values of it per "
            "record; an id is one value."
        )
    if kind == "bytes_list":
        return BytesFeature(type="bytes")
    return Int64Feature(type="int64") if kind == "int64_list" else FloatFeature(type="float")


# ---------------------------------------------------------------------------------------- outputs
def output_names(outputs: Any, model: Any, targets: Any) -> list[str]:
    """A name for each of the model's outputs, in ``keras.tree.flatten`` order: the target it was
    trained on where the config says, else Keras' output names."""
    if isinstance(outputs, dict):
        return sorted(outputs)
    if not isinstance(outputs, (list, tuple)):
        return [targets if isinstance(targets, str) else "prediction"]
    if isinstance(targets, (list, tuple)) and len(targets) == len(outputs):
        return list(targets)
    names = list(getattr(model, "output_names", None) or [])
    return names if len(names) == len(outputs) else [f"output_{i}" for i in range(len(outputs))]


def _ids(values: Any) -> list:
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v.item()
            for v in values.reshape(-1)]  # fmt: skip


# ---------------------------------------------------------------------------------------- predict
def predict(
    run_dir: str,
    data: str | Sequence[str],
    output: str,
    *,
    id_feature: str | None = None,
    checkpoint: str = "best",
    max_length: int | None = None,
    sampler: str = "greedy",
    top_k: int | None = None,
    seed: int | None = None,
    machine: Any = None,
) -> dict[str, Any]:
    """Predict every record of ``data`` once, in file order, and stream the rows to ``output``;
    on a causal LM, the completion of every prompt (:mod:`tpurun.infer.generate`).

    Args:
        run_dir: the run directory ``train`` made.
        data: a glob (or globs) of records with the model's input features; targets may be absent.
        output: a ``.csv``, ``.npy`` or ``.npz`` file; a causal LM's: ``.csv`` or ``.jsonl``.
        id_feature: a feature written as the first column (``.csv``) or array (``.npz``); it need
            not be one of data.features.
        checkpoint: best, latest, or a checkpoint file.
        max_length, sampler, top_k, seed: a causal LM's generation (see
            :func:`tpurun.infer.generate.check_sampling`); the seed defaults to the run's.
        machine: facts about the machine (tests inject them); probed when None.

    Raises:
        TpurunError: no such run or checkpoint, no records, records that do not match the inputs,
            an output that cannot be written, generation options for a model that does not
            generate.
    """
    started = time.monotonic()
    sampling = generate.check_sampling(sampler, top_k, seed, max_length)
    output_kind(output, generates=None)  # before the run is opened: any kind will do here
    output = trained_run.writable_output(output)
    trained = trained_run.open_run(run_dir)
    found_checkpoint = trained_run.find_checkpoint(trained, checkpoint)
    prompt_files = prompts.find(data)
    form = chat_prompts.for_run(trained, prompt_files)  # None: the run did not train on chat
    runtime = trained_run.activate_for(trained, machine)
    try:
        result, kind, causal = _rows(
            trained,
            found_checkpoint,
            runtime,
            form,
            prompt_files,
            data,
            output,
            id_feature,
            sampling,
        )
    finally:
        runtime.release()
    if prompt_files is not None:
        result.update(
            data=data if isinstance(data, str) else " ".join(data), files=len(prompt_files.files)
        )
    return {
        "output": output,
        "format": kind.lstrip("."),
        **result,
        "id_feature": id_feature,
        "class_names": None if causal else trained.class_names,
        "checkpoint": found_checkpoint.path,
        "checkpoint_label": found_checkpoint.label,
        "run_dir": trained.run.path,
        "replicas": runtime.replicas,
        "seconds": round(time.monotonic() - started, 3),
    }


def _rows(
    trained: Any,
    checkpoint: Any,
    runtime: Any,
    form: Any,
    prompt_files: Any,
    data: Any,
    output: str,
    id_feature: str | None,
    sampling: Any,
) -> tuple[dict, str, bool]:
    """Write the rows, with the process set up: a chat run's answers
    (:mod:`tpurun.infer.chat_prompts`), a causal LM's completions, or the model's predictions.
    Returns what was written, the output's kind, and whether the model generates."""
    causal = _generates(trained, sampling, output, prompt_files is not None)
    kind = output_kind(output, causal)
    if form is not None:
        result = chat_prompts.answer_run(
            trained, checkpoint, runtime, form, prompt_files, output, kind, id_feature, sampling
        )
    else:
        with _prompt_records(trained, prompt_files, data, id_feature) as (records, inputs):
            result = _predict(
                trained,
                checkpoint,
                runtime,
                records,
                output,
                kind,
                id_feature,
                sampling if causal else None,
                inputs,
            )
    return result, kind, causal


def _generates(trained: Any, sampling: Any, output: str, prompt_files: bool) -> bool:
    """Whether the run's model is a causal LM (it completes prompts); generation options and a
    ``.jsonl`` output are refused for any other.

    Raises:
        DataError: token-id records for a causal LM trained on them: it completes text prompts.
    """
    if preset_task.is_causal_lm(trained.config):
        return True
    if preset_task.is_causal_tokens(trained.config):
        if not prompt_files:
            raise DataError(
                f"--data: {trained.run.path} fine-tuned a causal LM on token ids (data write "
                "--tokenize), and it completes prompts given as text: give a text file of one "
                'prompt a line, or a JSONL file of {"prompt": "..."} objects.'
            )
        return True
    options = [f"--{k.replace('_', '-')}" for k, v in (("sampler", sampling.sampler != "greedy"),
               ("top_k", sampling.top_k is not None), ("seed", sampling.seed is not None),
               ("max_length", sampling.max_length is not None)) if v]  # fmt: skip
    if options:
        raise TpurunError(
            f"{', '.join(options)}: generation options, and {trained.run.path} "
            "holds no causal LM (it predicts; it does not generate text). Leave "
            "them out."
        )
    if str(output).lower().endswith(".jsonl"):
        raise TpurunError(
            f"--output {output}: .jsonl holds a causal LM's completions; this "
            "run's predictions go to a .csv, .npy or .npz file."
        )
    return False


@contextlib.contextmanager
def _prompt_records(trained: Any, found: Any, data: Any, id_feature: str | None) -> Iterator[tuple]:
    """``(records, inputs)``: ``--data`` itself and the run's inputs (None); for prompt files
    (:mod:`tpurun.infer.prompts`) on a run that takes one text, or a causal LM trained on token
    ids, their prompts written as records, and the text feature that feeds it (None where it is
    the run's own)."""
    config = trained.config
    key, inputs = prompts.text_key(config.data.features, config.data.inputs), None
    if found is not None and key is None and preset_task.is_causal_tokens(config):
        tokenized = (trained_run.training_schema(config) or {}).get("tokenized") or {}
        key = inputs = (tokenized.get("source") or {}).get("inputs") or "prompt"
    if found is None or key is None:  # records, or a file that the records' check will name
        yield data, None
        return
    with prompts.as_records(found, key, id_feature) as path:
        yield path, inputs


def _predict(
    trained: Any,
    checkpoint: Any,
    runtime: Any,
    data: Any,
    output: str,
    kind: str,
    id_feature: str | None,
    sampling: Any,
    inputs: Any,
) -> dict[str, Any]:
    """Read the records, build the model, write the rows: the part of :func:`predict` that runs
    with the process set up. ``inputs``: the features that feed the model (``data.inputs``, or
    the text of a prompt file for a run on token ids)."""
    config = trained.config
    known = (
        {**config.data.features, inputs: TextFeature(type="text")}
        if inputs not in (config.data.inputs, None)
        else config.data.features
    )
    inputs = config.data.inputs if inputs is None else inputs
    features = {n: known[n] for n in DataConfig.names(inputs)}
    # A causal LM's prompts are checked first, by a message that says how to write them.
    found = trained_run.find_records(
        data, {} if sampling else features, "--data", run_config=config
    )
    if sampling is not None:
        generate.check_prompts(trained_run.first_record(found), found.files[0], features)
    if id_feature:
        features[id_feature] = id_spec(
            config.data, id_feature, trained_run.first_record(found), found.files[0]
        )
    batch = trained_run.global_batch(config, runtime.replicas)
    # A preset's preprocessor is mapped over the batches in tf.data (preset.preprocessed).
    reader = readers.for_config(config, runtime.choice, preset_maps=preset_task.is_preset(config))
    dataset = readers.make_ordered_dataset(
        reader,
        found.files,
        found.compression,
        batch,
        records=found.records,
        features=features,
        inputs=inputs,
        extra=[id_feature] if id_feature else [],
    )
    model = trained_run.build(trained, checkpoint, runtime)
    done = {"data": found.source, "files": len(found.files), "global_batch_size": batch}
    if sampling is not None:
        written = generate.complete(
            model, dataset, found.records, output, kind, sampling, id_feature, config.seed
        )
        return {**written, **done}
    scores = None
    if preset_task.is_preset(config) and model.preprocessor is not None:
        dataset, scores = preset_task.preprocessed(model, dataset), preset_task.probabilities(model)
    writer = prediction_writers.WRITERS[kind](
        output, found.records, id_feature, trained.class_names
    )
    with writer:
        _run(model, dataset, writer, found.records, config.data.targets, id_feature, scores)
    return {"rows": writer.written, "columns": writer.header, **done}


def _run(
    model: Any,
    dataset: Any,
    writer: prediction_writers.Writer,
    records: int,
    targets: Any,
    id_feature: str | None,
    scores: Any = None,
) -> None:
    """``scores``: what turns the model's outputs into probabilities (a KerasHub classifier's
    logits), or None."""
    keras = frameworks.keras()
    import numpy as np

    remaining, names = records, None
    for inputs, extra in dataset.as_numpy_iterator():
        outputs = model.predict_on_batch(inputs)
        if scores is not None:
            outputs = scores(outputs)
        keep = min(remaining, len(keras.tree.flatten(inputs)[0]))
        if names is None:
            names = output_names(outputs, model, targets)
        arrays = [np.asarray(a)[:keep] for a in keras.tree.flatten(outputs)]
        ids = _ids(extra[id_feature][:keep]) if id_feature else None
        writer.write(names, arrays, ids)
        remaining -= keep
