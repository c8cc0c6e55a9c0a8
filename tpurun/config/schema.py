"""The experiment file's typed schema: every key, its type, default and one-line description.

Strict (unknown keys are errors) and framework-free; loading, line numbers and ``--set`` live in
:mod:`tpurun.config.loader`, the feature types in :mod:`tpurun.config.features`, the ``train`` and
``callbacks`` sections in :mod:`.train_config` and :mod:`.callbacks_config`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from tpurun.config.base import NamedObject, Section
from tpurun.config.callbacks_config import CallbacksConfig
from tpurun.config.chat_config import ChatTemplate
from tpurun.config.features import Feature, FeatureRef
from tpurun.config.mesh_config import (
    DEVICE_MEMORY_DESCRIPTION,
    LAYOUT_DESCRIPTION,
    PEAK_TFLOPS_DESCRIPTION,
    DeviceMemory,
    Layout,
    MeshConfig,
)
from tpurun.config.observe_config import ObserveConfig
from tpurun.config.train_config import TrainConfig

#: Keys tpurun writes into a run directory's config.yaml; ignored when that file is loaded again.
WRITTEN_KEYS = ("derived",)


# --------------------------------------------------------------------------------------- runtime
class RuntimeConfig(Section):
    backend: Literal["auto", "jax", "tensorflow"] = Field(
        "auto",
        description="The Keras backend. `auto`: the fastest installed backend that can run this config "
        "as written on the chosen accelerator: JAX wherever both could.",
    )
    accelerator: Literal["auto", "tpu", "gpu", "cpu"] = Field(
        "auto",
        description="`auto`: a TPU, else GPUs, else the CPU (one line says what was chosen and why). "
        "An accelerator named here but absent is an error; `cpu` trains on the CPU on purpose.",
    )
    tpu: str = Field(
        "auto",
        min_length=1,
        description="TensorFlow backend only: `auto` (`local` on a TPU VM, else `TPU_NAME`), `local`, "
        "a TPU name, or `grpc://host:port`.",
    )
    cpu_devices: int = Field(
        1,
        ge=1,
        le=512,
        description="On the CPU, split it into N devices (replicas), for either backend: an N-core TPU "
        "config then runs with the same replicas, global batch and scaled learning rate.",
    )
    precision: Literal["auto", "float32", "mixed_bfloat16", "mixed_float16", "bfloat16"] = Field(
        "auto",
        description="Keras' dtype policy. `auto`: `mixed_bfloat16` on TPUs, `float32` elsewhere. "
        "`mixed_bfloat16` computes in bfloat16 on float32 weights (right for training from "
        "scratch); `bfloat16` keeps the weights and optimizer state in bfloat16 too, half the "
        "memory: for fine-tuning a large pretrained model whose float32 weights do not fit (LoRA "
        "adapters stay float32: Keras' `enable_lora` makes them so). `mixed_float16` is warned "
        "against on TPUs.",
    )
    coordinator: str | None = Field(
        None,
        min_length=1,
        description="Several hosts: process 0's `host:port`, the same on every process. Unset: "
        "`KERAS_DISTRIBUTION_JOB_ADDRESSES`; JAX finds it by itself on a Cloud TPU pod and under SLURM.",
    )
    num_processes: int | None = Field(
        None,
        ge=1,
        description="Several hosts: how many processes (one per host) train together. Unset: "
        "`KERAS_DISTRIBUTION_NUM_PROCESSES`, else a Cloud TPU pod's or SLURM's own variables.",
    )
    process_id: int | None = Field(
        None,
        ge=0,
        description="Several hosts: this process's number, 0 to `num_processes - 1` (0 on the "
        "coordinator). Unset: `KERAS_DISTRIBUTION_PROCESS_ID`, `TPU_WORKER_ID` or `SLURM_PROCID`.",
    )
    mesh: MeshConfig | None = Field(
        None,
        description="A device mesh `{data, model}` for a model bigger than one device (JAX "
        "only): `data x model` must be the devices of all processes. Unset: data parallel.",
    )
    layout: Layout | None = Field(None, description=LAYOUT_DESCRIPTION)
    device_memory: DeviceMemory | None = Field(None, description=DEVICE_MEMORY_DESCRIPTION)
    peak_tflops: float | None = Field(None, gt=0, description=PEAK_TFLOPS_DESCRIPTION)
    shard_optimizer_state: bool = Field(
        True,
        description="JAX backend, data parallel over several devices of one process: each device "
        "keeps and updates its share of the optimizer's state (Adam's moments; ZeRO stage 1) "
        "instead of a whole copy, the weights staying whole on each. The same updates (bit for "
        "bit on 8 CPU devices), with less memory per device, and faster steps where the update "
        "is bound by memory (simulated CPU devices). `false`: a whole copy on each device, as "
        "Keras' `DataParallel` keeps it.",
    )
    compilation_cache: bool | str = Field(
        "auto",
        description="JAX backend: a local folder where compiled programs are kept, so that a rerun, "
        "a resume or an evaluate of the same model loads them instead of compiling again. `auto`: "
        "`JAX_COMPILATION_CACHE_DIR` where set, else `~/.cache/tpurun/jax` (`$TPURUN_CACHE_DIR/jax`); "
        "`false`: compile afresh each time.",
    )

    @field_validator("compilation_cache", mode="before")
    @classmethod
    def _cache_folder(cls, value: Any) -> bool | str:
        if value is True:
            return "auto"
        if value is False or (isinstance(value, str) and value.strip()):
            return value
        raise ValueError("expected a local folder, auto or false")


# ----------------------------------------------------------------------------------------- model
class LoraConfig(Section):
    rank: int = Field(
        ge=1,
        description="The rank of the adapter's two matrices on each attention query and value "
        "kernel (4 to 16 is usual): the adapter's size grows with it.",
    )
    alpha: float | None = Field(
        None,
        gt=0,
        description="The adapter's update is scaled by `alpha / rank`. Unset: the rank (a scale of "
        "1), as KerasHub's `enable_lora` does.",
    )


#: Remote preset handles, tried through KerasHub (kagglehub, huggingface_hub) where online.
PRESET_HANDLES = ("kaggle://", "hf://")
#: What only a preset takes, each with what it does (for the message a factory config gets).
PRESET_ONLY = {
    "task": "the KerasHub task class",
    "lora": "LoRA on the backbone",
    "sequence_length": "the preprocessor's length",
    "quantize": "the pretrained base quantized under LoRA (a quantized kernel does not train)",
}


class ModelConfig(Section):
    factory: str | None = Field(
        None,
        description="`path/to/file.py:function` or `package.module:function`: called with `kwargs` "
        "inside the distribution scope, it returns a Keras model. Set this or `preset`.",
    )
    preset: str | None = Field(
        None,
        min_length=1,
        description="A pretrained KerasHub model instead of a factory: the folder a preset was "
        "saved to (relative to the config file's folder; on Kaggle, an attached model such as "
        "`/kaggle/input/gemma/keras/gemma_2b_en/2`), or a `kaggle://` or `hf://` handle where there "
        "is a network. Needs `pip install 'tpurun[hub]'`.",
    )
    task: str | None = Field(
        None,
        min_length=1,
        description="Preset only: the KerasHub task class to build (`GemmaCausalLM`, `CausalLM`, "
        "`BertTextClassifier`, ...). Unset: the task the preset was saved with.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the factory; with a preset, for the task's "
        "`from_preset` (`num_classes: 3` for a classifier, ...).",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Preset only: LoRA on the backbone (`enable_lora`): the pretrained weights "
        "are frozen and only the adapter trains. `{rank: 4}`.",
    )
    quantize: Literal["int8", "int4"] | None = Field(
        None,
        description="Preset with `lora` only (QLoRA): the frozen base quantized after loading and "
        "before LoRA (Keras' `quantize`): `int8` (a quarter of float32's bytes) or `int4` (an "
        "eighth, in blocks of 128). The adapters stay float32; checkpoints hold only them.",
    )
    sequence_length: int | None = Field(
        None,
        ge=1,
        description="Preset only: the preprocessor's sequence length (tokens per example), at "
        "most the backbone's maximum. Unset: the preset's own.",
    )
    optimizer: NamedObject = Field(
        default_factory=lambda: NamedObject(name="adam"),
        description="A Keras optimizer name or `module:Class`, or `{name: ..., kwarg: ...}`: the other "
        "keys are its kwargs. The learning rate always comes from `train.learning_rate`. Left out "
        "with a preset: the task's own (KerasHub compiles its tasks with Adam).",
    )
    loss: NamedObject | list[NamedObject] | dict[str, NamedObject] | None = Field(
        None,
        description="A Keras loss name, `module:function`, `{name: ..., kwarg: ...}`, or a list / "
        "`{output: loss}` map for several outputs. Left out: the loss the factory compiled its model "
        "with (an error if it did not compile), or a preset task's own (sparse categorical "
        "cross-entropy on logits for a causal LM or a classifier). Checked against the labels "
        "before training.",
    )
    metrics: list[NamedObject] = Field(
        default_factory=list,
        description="Keras metric names, `module:function`, or `{name: ..., kwarg: ...}`.",
    )

    @field_validator("factory")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        # A plain sentence instead of pydantic's regex.
        if value is not None and not re.match(r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$", value):
            raise ValueError(
                'expected "path/to/file.py:function" or "package.module:function", the function '
                "that returns the model after the colon"
            )
        return value

    @field_validator("preset")
    @classmethod
    def _folder_or_handle(cls, value: str | None) -> str | None:
        if value is not None and "://" in value and not value.startswith(PRESET_HANDLES):
            raise ValueError(
                f"'{value}': a local preset folder, or a kaggle://org/model/keras/variant[/version] "
                "or hf://org/model handle; "
                f"'{value.split('://')[0]}://' is not supported"
            )
        return value

    @model_validator(mode="after")
    def _factory_or_preset(self) -> ModelConfig:
        if (self.factory is None) == (self.preset is None):
            which = "both are set" if self.factory else "neither is set"
            raise ValueError(
                "set one of model.factory (your function that builds a Keras model) and "
                f"model.preset (a pretrained KerasHub model's folder or handle); {which}"
            )
        if self.factory is not None:
            for key, what in PRESET_ONLY.items():
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"model.{key} ({what}) applies to a model.preset; model.factory builds "
                        f"its own model: remove model.{key}, or use a preset"
                    )
        if self.quantize is not None and self.lora is None:
            raise ValueError(
                f"model.quantize: {self.quantize} needs model.lora: Keras' quantized layers hold "
                "their kernels as integers that do not train, so only the norms and biases "
                "would; add model.lora: {rank: 4} (QLoRA), or remove model.quantize"
            )
        return self


# ------------------------------------------------------------------------------------------ data
class DataConfig(Section):
    train: str | list[str] = Field(
        description="A TFRecord glob or a list of globs: local (relative to the config file's folder), "
        "`gs://` or `ram://`."
    )
    validation: str | list[str] | None = Field(
        None,
        description="The same, for validation: read in order, never shuffled, every record scored "
        "exactly once per epoch.",
    )
    kaggle_dataset: str | None = Field(
        None,
        min_length=1,
        description="A Kaggle dataset name: relative globs are read from "
        "`KaggleDatasets().get_gcs_path(name)` (`gs://` on TPU nodes, `/kaggle/input/...` on TPU "
        "VMs). An error outside Kaggle.",
    )
    features: dict[str, Feature] = Field(
        default_factory=dict,
        description="How each record key decodes (see Feature types below). Left out, or for the keys "
        "it leaves out: from the `*.schema.json` that `tpurun data write` puts beside the shards.",
    )
    inputs: FeatureRef | None = Field(
        None,
        description="A feature name (the one model input), a list (the model's inputs in order), or a "
        "`{model_input: feature}` map (inputs by their `keras.Input` name). Required with a "
        "factory; with a preset, see `targets`.",
    )
    targets: FeatureRef | None = Field(
        None,
        description="The same, for the targets: a feature name, a list, or a "
        "`{model_output: feature}` map. Required with a factory. With a preset both may be left "
        "out: `prompt` and `response` text features are a causal LM's prompt (input) and what it "
        "learns to answer (target); one text feature and nothing else is text a causal LM learns "
        "whole (input and target); otherwise the text and image features are the inputs and the "
        "one feature left is the target (a classifier's label).",
    )
    shuffle_buffer: int = Field(
        10000, ge=0, description="Training records held for shuffling (0: no record shuffle)."
    )
    compression: Literal["auto", "none", "gzip"] = Field(
        "auto",
        description="TFRecord compression. `auto`: the schema file's, else detected from the first "
        "file.",
    )
    cache: str | None = Field(
        None,
        min_length=1,
        description="`memory`, or a file path prefix: keep the records read after the first pass, for "
        "datasets that fit (decoding still runs). A file cache belongs to one run at a time; one left "
        "half-written by a killed run is cleared. The native reader writes one TFRecord file per "
        "split, `PREFIX-train.tfrecord`, afresh in each run (a local copy of `gs://` data).",
    )
    skip_corrupt: bool = Field(
        False,
        description="A corrupt or truncated shard is skipped, counted, warned about and recorded in "
        "`summary.json`, instead of stopping with exit 2 (which names the file and the record "
        "offset).",
    )
    packing: bool | None = Field(
        None,
        description="For a causal LM's token records: `true`, several short train examples are "
        "packed one after another in each record, so a batch is not mostly padding. Packing is "
        "done when the records are written (`tpurun data write SOURCE OUT_PREFIX --config "
        "CONFIG` packs as this says), so steps per epoch and a resume stay exact; train refuses "
        "records written otherwise than this says. Validation is never packed. Left out: the "
        "records as written.",
    )
    chat_template: str | ChatTemplate | None = Field(
        None,
        description="For chat data of a preset whose family has no chat format in tpurun (Gemma, "
        "Llama 3 and Qwen have theirs): a YAML file (relative to the config file's folder) or a "
        "mapping of `user`, `assistant` and optionally `system` turn templates, each with one "
        "`{content}`. `tpurun data write SOURCE OUT_PREFIX --config CONFIG` writes with it; "
        "train refuses records written in another format.",
    )
    reader: Literal["auto", "native", "tf_data"] = Field(
        "auto",
        description="What reads the records. `native`: tpurun's own reader (numpy batches, no "
        "TensorFlow), for the JAX backend. `tf_data`: `tf.data` (needs TensorFlow). `auto`: "
        "`native` where TensorFlow is not installed, and where it is for images, raw bytes, floats "
        "and short int64 lists (no TensorFlow import, and faster there; see Benchmarks); "
        "`tf_data` on the TensorFlow backend, for a preset whose preprocessor tokenises text in "
        "the pipeline (records not written with `--tokenize`), and for token ids and strings "
        "where TensorFlow is installed "
        "(it parses them on every core). Unshuffled, both make the same batches; "
        "the start line and `tpurun doctor` say which one runs and why.",
    )

    @staticmethod
    def names(ref: FeatureRef | None) -> list[str]:
        """The feature names an ``inputs`` / ``targets`` value refers to (none for None)."""
        if ref is None:
            return []
        if isinstance(ref, str):
            return [ref]
        return list(ref.values()) if isinstance(ref, dict) else list(ref)


class OutputConfig(Section):
    dir: str = Field(
        "runs",
        description="The parent of the run directory `<dir>/<name>`: a local folder "
        "(relative to the working directory, as `--output` is) or `gs://bucket/path`. Several hosts "
        "need one they all see.",
    )

    @field_validator("dir")
    @classmethod
    def _local_or_gcs(cls, value: str) -> str:
        # TensorFlow's file system reads and writes gs:// itself; other schemes need plugins
        # (tensorflow-io) that tpurun does not test.
        if "://" in value and not value.startswith("gs://"):
            raise ValueError(
                f"'{value}': a local folder or a Google Cloud Storage path (gs://bucket/runs); "
                f"'{value.split('://')[0]}://' is not supported"
            )
        if value.startswith("gs://") and not value[5:].split("/")[0]:
            raise ValueError(f"'{value}': name the bucket, e.g. gs://my-bucket/runs")
        return value


# ---------------------------------------------------------------------------------------- config
class Config(Section):
    name: str = Field(
        "run",
        description="The run's name: its directory is `<output.dir>/<name>`. Loaded from a file, it "
        "defaults to the file's stem.",
    )
    seed: int = Field(42, description="Seed for the weights, the shuffling and dropout.")
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig,
        description="Where and how to train: the backend, the accelerator, the precision, and several "
        "hosts.",
    )
    model: ModelConfig = Field(
        description="The model: its factory or pretrained preset, and how it is compiled."
    )
    data: DataConfig = Field(
        description="The TFRecord files, how their records decode, and which features feed the model."
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="The batch size, epochs, steps, learning rate, time limit and profiling.",
    )
    callbacks: CallbacksConfig = Field(
        default_factory=CallbacksConfig,
        description="Checkpoints, logs, the learning-rate and stopping rules, and what a NaN does.",
    )
    output: OutputConfig = Field(
        default_factory=OutputConfig, description="Where the run directories go."
    )
    observe: ObserveConfig = Field(
        default_factory=ObserveConfig, description="Experiment trackers (MLflow, W&B) to log to."
    )

    @field_validator("name")
    @classmethod
    def _folder_name(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", value):
            raise ValueError(
                "use letters, digits, '.', '_' and '-' (it becomes the run directory's name), "
                "starting with a letter or digit"
            )
        return value

    # Where relative paths (factory file, data globs) are resolved from: the config file's folder.
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    def resolve_path(self, path: str) -> str:
        """A local path relative to the config file's folder; remote URLs are left alone."""
        if "://" in path or Path(path).is_absolute():
            return path
        return str(self._base_dir / path)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, in the form a user writes it."""
        return self.model_dump(mode="json")
