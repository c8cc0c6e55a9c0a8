"""``tpurun predict``: a trained run's predictions for every record of a test set, in file order,
streamed to a CSV, ``.npy`` or ``.npz`` file.

Records are read in file order (sorted file names, then record order: a submission's rows follow its
test set), in batches of the run's global batch; the last batch is padded and its padding rows
dropped, so the rows are the same on any replica count. Each batch's rows are written as they come:
a multi-GB output never sits in memory (``.npy`` outputs are memory-mapped files of known size).
"""

from __future__ import annotations

import contextlib
import csv
import os
import time
import zipfile
from collections.abc import Iterator, Sequence
from typing import Any

from tpurun import frameworks
from tpurun.errors import DataError, TpurunError
from tpurun.infer import chat_prompts, prompts

KINDS = (".csv", ".npy", ".npz")
_KINDS_SAID = ("name a .csv file (an id column and one column per output, or class names and "
               "probabilities), or .npy / .npz for arrays")  # fmt: skip


def output_kind(path: str, generates: bool | None = False) -> str:
    """``.csv``, ``.npy`` or ``.npz`` from the output's name; a causal LM's (``generates``):
    ``.csv`` or ``.jsonl``; not known yet (None): any of them.

    Raises:
        TpurunError: another suffix.
    """
    from tpurun.infer import generate

    if generates:
        return generate.output_kind(path)
    if generates is None:
        return generate.suffix_of(path, (*KINDS, *generate.OUTPUTS), f"{_KINDS_SAID}; a causal "
                                  "LM's completions: .csv or .jsonl.")  # fmt: skip
    return generate.suffix_of(path, KINDS, f"{_KINDS_SAID}.")


def id_spec(data: Any, name: str, serialized: bytes, filename: str) -> Any:
    """How to read ``--id-feature NAME``: as data.features declares it, else as the first record
    holds it (one bytes, int64 or float value)."""
    from tpurun.config.features import BytesFeature, FloatFeature, Int64Feature
    from tpurun.data.native import example

    if name in data.features:
        feature = data.features[name]
        if getattr(feature, "shape", [1]) not in ([], [1]):
            raise DataError(f"--id-feature {name}: data.features declares {feature.shape} values "
                            "per record; an id is one value.")  # fmt: skip
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
        raise DataError(f"--id-feature {name}: {filename} holds {len(values)} values of it per "
                        "record; an id is one value.")  # fmt: skip
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


def _flat(array: Any) -> Any:
    return array.reshape(len(array), -1)


class _Columns:
    """How outputs become CSV columns: class name and probabilities for a classifier whose class
    names the run kept, else one column per output value."""

    def __init__(self, names: list[str], arrays: list[Any], class_names: Sequence[str] | None):
        self.classes = None
        width = _flat(arrays[0]).shape[1] if len(arrays) == 1 else 0
        if class_names and len(arrays) == 1 and width in (1, len(class_names)):
            if width == len(class_names) or len(class_names) == 2:
                self.classes = list(class_names)
        if self.classes is not None:
            self.header = ["class", *self.classes]
            return
        self.header = []
        for name, array in zip(names, arrays, strict=True):
            n = _flat(array).shape[1]
            self.header += [name] if n == 1 else [f"{name}_{i}" for i in range(n)]

    def rows(self, arrays: list[Any]) -> list[list[str]]:
        import numpy as np

        if self.classes is not None:
            scores = _flat(arrays[0]).astype(np.float32)
            if scores.shape[1] == 1:  # one sigmoid unit: P(second class)
                chosen = (scores[:, 0] >= 0.5).astype(int)
                scores = np.concatenate([1 - scores, scores], axis=1)
            else:
                chosen = scores.argmax(axis=1)
            labels = np.asarray(self.classes, dtype=object)[chosen]
            return [
                [label, *values] for label, values in zip(labels, scores.astype(str), strict=True)
            ]
        values = np.concatenate([_flat(a).astype(str) for a in arrays], axis=1)
        return values.tolist()


class _Writer:
    """Rows in, a complete file out: written beside the output and renamed over it at the end, so
    a failed run leaves no half-written file (and an older complete one stays)."""

    def __init__(self, path: str, records: int, id_name: str | None, class_names):
        self.path, self.records = path, records
        self.id_name, self.class_names = id_name, class_names
        folder, name = os.path.split(path)
        self.tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
        self.parts: list[str] = []
        self.written = 0
        self.header: list[str] = []

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if kind is None:
                self.close()
                os.replace(self.tmp, self.path)
        finally:
            for leftover in [self.tmp, *self.parts]:
                if os.path.exists(leftover):
                    os.remove(leftover)

    def write(self, names: list[str], arrays: list[Any], ids: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CsvWriter(_Writer):
    def write(self, names, arrays, ids) -> None:
        if not self.written:
            self.file = open(self.tmp, "w", newline="", encoding="utf-8")
            self.csv = csv.writer(self.file)
            self.columns = _Columns(names, arrays, self.class_names)
            self.header = [self.id_name or "row", *self.columns.header]
            self.csv.writerow(self.header)
        if ids is None:
            ids = range(self.written, self.written + len(arrays[0]))
        self.csv.writerows([i, *row] for i, row in zip(ids, self.columns.rows(arrays), strict=True))
        self.written += len(arrays[0])

    def close(self) -> None:
        if self.written:
            self.file.close()


class NpyWriter(_Writer):
    """``.npy``: one output's array, rows in record order (ids are not stored: use .npz)."""

    def write(self, names, arrays, ids) -> None:
        from numpy.lib.format import open_memmap

        if len(arrays) != 1:
            raise TpurunError(f"--output {self.path}: the model has {len(arrays)} outputs and a "
                              ".npy file holds one array; name a .npz file.")  # fmt: skip
        if not self.written:
            shape = (self.records, *arrays[0].shape[1:])
            self.array = open_memmap(self.tmp, mode="w+", dtype=arrays[0].dtype, shape=shape)
            self.header = names
        self.array[self.written : self.written + len(arrays[0])] = arrays[0]
        self.written += len(arrays[0])

    def close(self) -> None:
        if self.written:
            self.array.flush()
            del self.array


class NpzWriter(_Writer):
    """``.npz``: one array per output (and ``id``), each a memory-mapped ``.npy`` zipped at the end."""

    def write(self, names, arrays, ids) -> None:
        from numpy.lib.format import open_memmap

        if not self.written:
            self.header = list(names)
            self.arrays = []
            for array in arrays:
                part = f"{self.tmp}.{len(self.parts)}.npy"
                self.parts.append(part)
                shape = (self.records, *array.shape[1:])
                self.arrays.append(open_memmap(part, mode="w+", dtype=array.dtype, shape=shape))
            self.ids: list = []
        for target, array in zip(self.arrays, arrays, strict=True):
            target[self.written : self.written + len(array)] = array
        if ids is not None:
            self.ids.extend(ids)  # ids are small beside the predictions
        self.written += len(arrays[0])

    def close(self) -> None:
        import numpy as np

        if not self.written:
            return
        with zipfile.ZipFile(self.tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, part, array in zip(self.header, self.parts, self.arrays, strict=True):
                array.flush()
                archive.write(part, f"{name}.npy")
            if self.id_name:
                with archive.open(f"{self.id_name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.asarray(self.ids))
        self.arrays.clear()


_WRITERS = {".csv": CsvWriter, ".npy": NpyWriter, ".npz": NpzWriter}


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
    from tpurun.infer import generate, loading

    started = time.monotonic()
    sampling = generate.check_sampling(sampler, top_k, seed, max_length)
    output_kind(output, generates=None)  # before the run is opened: any kind will do here
    output = loading.writable_output(output)
    trained = loading.open_run(run_dir)
    found_checkpoint = loading.find_checkpoint(trained, checkpoint)
    prompt_files = prompts.find(data)
    form = chat_prompts.for_run(trained, prompt_files)  # None: the run did not train on chat
    runtime = loading.activate_for(trained, machine)
    try:
        causal = _generates(trained, sampling, output, prompt_files is not None)
        kind = output_kind(output, causal)
        if form is not None:
            result = chat_prompts.answer_run(trained, found_checkpoint, runtime, form,
                                             prompt_files, output, kind, id_feature,
                                             sampling)  # fmt: skip
        else:
            with _prompt_records(trained, prompt_files, data, id_feature) as (records, inputs):
                result = _predict(trained, found_checkpoint, runtime, records, output, kind,
                                  id_feature, sampling if causal else None, inputs)  # fmt: skip
    finally:
        runtime.release()
    if prompt_files is not None:
        result.update(data=data if isinstance(data, str) else " ".join(data),
                      files=len(prompt_files.files))  # fmt: skip
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


def _generates(trained: Any, sampling: Any, output: str, prompt_files: bool) -> bool:
    """Whether the run's model is a causal LM (it completes prompts); generation options and a
    ``.jsonl`` output are refused for any other.

    Raises:
        DataError: token-id records for a causal LM trained on them: it completes text prompts.
    """
    from tpurun.infer import preset

    if preset.is_causal_lm(trained.config):
        return True
    if preset.is_causal_tokens(trained.config):
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
        raise TpurunError(f"{', '.join(options)}: generation options, and {trained.run.path} "
                          "holds no causal LM (it predicts; it does not generate text). Leave "
                          "them out.")  # fmt: skip
    if str(output).lower().endswith(".jsonl"):
        raise TpurunError(f"--output {output}: .jsonl holds a causal LM's completions; this "
                          "run's predictions go to a .csv, .npy or .npz file.")  # fmt: skip
    return False


@contextlib.contextmanager
def _prompt_records(trained: Any, found: Any, data: Any, id_feature: str | None) -> Iterator[tuple]:
    """``(records, inputs)``: ``--data`` itself and the run's inputs (None); for prompt files
    (:mod:`tpurun.infer.prompts`) on a run that takes one text, or a causal LM trained on token
    ids, their prompts written as records, and the text feature that feeds it (None where it is
    the run's own)."""
    from tpurun.infer import loading, preset

    config = trained.config
    key, inputs = prompts.text_key(config.data.features, config.data.inputs), None
    if found is not None and key is None and preset.is_causal_tokens(config):
        tokenized = (loading.training_schema(config) or {}).get("tokenized") or {}
        key = inputs = (tokenized.get("source") or {}).get("inputs") or "prompt"
    if found is None or key is None:  # records, or a file that the records' check will name
        yield data, None
        return
    with prompts.as_records(found, key, id_feature) as path:
        yield path, inputs


def _predict(trained: Any, checkpoint: Any, runtime: Any, data: Any, output: str, kind: str,
             id_feature: str | None, sampling: Any, inputs: Any) -> dict[str, Any]:  # fmt: skip
    """Read the records, build the model, write the rows: the part of :func:`predict` that runs
    with the process set up. ``inputs``: the features that feed the model (``data.inputs``, or
    the text of a prompt file for a run on token ids)."""
    from tpurun.config import DataConfig, TextFeature
    from tpurun.data import reader as readers
    from tpurun.infer import generate, loading, preset

    config = trained.config
    known = {**config.data.features, inputs: TextFeature(type="text")} if inputs not in (
        config.data.inputs, None) else config.data.features  # fmt: skip
    inputs = config.data.inputs if inputs is None else inputs
    features = {n: known[n] for n in DataConfig.names(inputs)}
    # A causal LM's prompts are checked first, by a message that says how to write them.
    found = loading.find_records(data, {} if sampling else features, "--data", run_config=config)
    if sampling is not None:
        generate.check_prompts(loading.first_record(found), found.files[0], features)
    if id_feature:
        features[id_feature] = id_spec(config.data, id_feature, loading.first_record(found),
                                       found.files[0])  # fmt: skip
    batch = loading.global_batch(config, runtime.replicas)
    # A preset's preprocessor is mapped over the batches in tf.data (preset.preprocessed).
    reader = readers.for_config(config, runtime.choice, preset_maps=preset.is_preset(config))
    dataset = readers.make_ordered_dataset(
        reader, found.files, found.compression, batch, records=found.records, features=features,
        inputs=inputs, extra=[id_feature] if id_feature else [],
    )  # fmt: skip
    model = loading.build(trained, checkpoint, runtime)
    done = {"data": found.source, "files": len(found.files), "global_batch_size": batch}
    if sampling is not None:
        written = generate.complete(model, dataset, found.records, output, kind, sampling,
                                    id_feature, config.seed)  # fmt: skip
        return {**written, **done}
    scores = None
    if preset.is_preset(config) and model.preprocessor is not None:
        dataset, scores = preset.preprocessed(model, dataset), preset.probabilities(model)
    writer = _WRITERS[kind](output, found.records, id_feature, trained.class_names)
    with writer:
        _run(model, dataset, writer, found.records, config.data.targets, id_feature, scores)
    return {"rows": writer.written, "columns": writer.header, **done}


def _run(model: Any, dataset: Any, writer: _Writer, records: int, targets: Any,
         id_feature: str | None, scores: Any = None) -> None:  # fmt: skip
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
