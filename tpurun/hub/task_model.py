"""The task model of a ``model.preset``: loaded, its sequence length set, LoRA on, parameters counted.

:func:`build_task` is what :func:`tpurun.training.model.build_model` calls for a preset, inside the
distribution scope: ``from_preset`` builds the task under the global dtype policy the runtime set
(``runtime.precision``; KerasHub casts float weights saved in another dtype as it loads them,
``KerasPresetLoader._resolve_dtype``). The task comes back compiled with KerasHub's own defaults
(``Task.__init__`` compiles it), which :func:`tpurun.training.model.compile_model` keeps for what
the config leaves out.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass
from typing import Any

from tpurun.config import Config
from tpurun.errors import ModelError, TpurunError, describe
from tpurun.hub import handles
from tpurun.hub.preset import Preset, check_sequence_length, max_sequence_length, read
from tpurun.hub.quantize import plan, quantize, stored_over_parameters
from tpurun.hub.task import concrete, task_class
from tpurun.multihost.collectives import lost_peer

#: What ``from_preset`` takes beside the task's own arguments; ``dtype`` is runtime.precision's.
FROM_PRESET_KWARGS = ("name",)


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    trainable: int

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "trainable": self.trainable}


def build_task(config: Config, load_weights: bool = True, compile: bool = True) -> Any:
    """The KerasHub task model ``config.model`` describes, with its preprocessor attached.

    Call it in the distribution scope, as a factory is. ``load_weights=False, compile=False``
    builds the same architecture without reading the weights (for counting, under a stateless
    scope).

    Raises:
        ModelError: a missing or incomplete preset, a task that does not fit it, kwargs
            ``from_preset`` refuses, a sequence length over the backbone's maximum, LoRA on a
            backbone without attention layers to adapt, a handle that cannot be downloaded here,
            a ``model.quantize`` the backbone's layers cannot take.
        EnvironmentSetupError: keras-hub is not installed.
    """
    preset = read(config)
    cls = task_class(preset, config.model.task)
    check_kwargs(concrete(cls, preset), config.model.kwargs)
    task = load(cls, preset, config.model.kwargs, load_weights=load_weights, compile=compile)
    set_sequence_length(task, config.model.sequence_length)
    if config.model.quantize is not None:  # after loading the float weights, before LoRA
        if load_weights:
            quantize(task, config.model.quantize)
        else:  # no values to quantize: counted as quantized (tpurun.runtime.memory_check)
            plan(task, config.model.quantize)
    if config.model.lora is not None:
        enable_lora(task, config.model.lora.rank, config.model.lora.alpha)
    return task


def check_kwargs(cls: type, kwargs: dict) -> None:
    """Refuse a ``model.kwargs`` key the task does not take: KerasHub passes every one into the
    task's config, and the task silently ignores those it has no argument for.

    Raises:
        ModelError: naming the keys and what the task takes.
    """
    if "dtype" in kwargs:
        raise ModelError(
            "model.kwargs.dtype: set runtime.precision instead (bfloat16, mixed_bfloat16, "
            "float32): the run's dtype policy, which from_preset follows."
        )
    skip = ("self", "backbone", "preprocessor")
    own = [
        name
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    allowed = [*own, *FROM_PRESET_KWARGS]
    unknown = [key for key in kwargs if key not in allowed]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], allowed, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ModelError(
        f"model.kwargs: {cls.__name__}.from_preset takes no {', '.join(map(repr, unknown))}; what "
        f"it takes: {', '.join(allowed)}.{hint}"
    )


def build_preprocessor(config: Config) -> Any:
    """The preset task's preprocessor alone (its tokenizer and sequence length), without the
    model's weights: what a ``tf.data`` pipeline maps over the records.

    Raises:
        ModelError: as :func:`build_task`, or the task has no preprocessor.
    """
    preset = read(config)
    cls = concrete(task_class(preset, config.model.task), preset)
    preprocessor_cls = getattr(cls, "preprocessor_cls", None)
    if preprocessor_cls is None:
        raise ModelError(f"model.preset: {cls.__name__} has no preprocessor class in KerasHub.")
    preprocessor = preprocessor_from_preset(preprocessor_cls, preset.location, "model.preset")
    if config.model.sequence_length is not None:
        if not hasattr(preprocessor, "sequence_length"):
            raise ModelError(
                f"model.sequence_length: {preprocessor_cls.__name__} takes no sequence length "
                "(it is not a text model): remove model.sequence_length."
            )
        preprocessor.sequence_length = config.model.sequence_length
    return preprocessor


def preprocessor_from_preset(cls: type, location: str, key: str) -> Any:
    """``cls.from_preset(location)``; its failure a ModelError naming ``key``."""
    try:
        return cls.from_preset(location)
    except Exception as exc:
        raise ModelError(
            f"{key}: {cls.__name__}.from_preset({location}) failed: {describe(exc)}"
        ) from None


def load(
    cls: type, preset: Preset, kwargs: dict, load_weights: bool = True, compile: bool = True
) -> Any:
    """``cls.from_preset(preset.location, **kwargs)``, its failures as messages."""
    extra = {} if compile else {"compile": False}
    try:
        return cls.from_preset(preset.location, load_weights=load_weights, **kwargs, **extra)
    except TpurunError:  # the mesh's layout refused a variable as it was created
        raise
    except FileNotFoundError as exc:
        raise ModelError(
            f"model.preset: {describe(exc)}. Copy the whole preset folder again, or attach the "
            "model again on Kaggle."
        ) from None
    except TypeError as exc:
        raise ModelError(
            f"model.kwargs: {cls.__name__}.from_preset({preset.location}) refused them: "
            f"{describe(exc)}. Give only arguments the task takes (num_classes for a classifier)."
        ) from None
    except Exception as exc:
        if lost_peer(exc):  # building the variables is a collective: another process is gone
            raise
        if preset.remote and (isinstance(exc, OSError) or "Connection" in type(exc).__name__):
            raise handles.offline_error(
                preset.location, f"the download failed ({describe(exc)})"
            ) from None
        raise ModelError(
            f"model.preset: {cls.__name__}.from_preset({preset.location}) failed: {describe(exc)}"
        ) from None


def longest_sequence(task: Any) -> int | None:
    """The longest sequence the task's backbone takes, or None where nothing bounds it."""
    return max_sequence_length(task.backbone.get_config())


def set_sequence_length(task: Any, length: int | None) -> None:
    """Set the preprocessor's sequence length (None: keep the preset's).

    Raises:
        ModelError: the task has no preprocessor with a sequence length, or ``length`` is over
            the backbone's maximum.
    """
    if length is None:
        return
    preprocessor = task.preprocessor
    if preprocessor is None or not hasattr(preprocessor, "sequence_length"):
        kind = type(preprocessor).__name__ if preprocessor is not None else "no preprocessor"
        raise ModelError(
            f"model.sequence_length: {type(task).__name__} has {kind}, which takes no sequence "
            "length (it is not a text model): remove model.sequence_length."
        )
    backbone = task.backbone
    check_sequence_length(type(backbone).__name__, backbone.get_config(), length)
    preprocessor.sequence_length = length


def lora_layers(backbone: Any) -> list[Any]:
    """The backbone's layers with LoRA on."""
    return [
        layer
        for layer in backbone._flatten_layers(include_self=False)
        if getattr(layer, "lora_enabled", False)
    ]


def enable_lora(task: Any, rank: int, alpha: float | None = None) -> None:
    """``backbone.enable_lora(rank)``: every backbone weight frozen but the new adapters on the
    attention query and value kernels (and those layers' biases; the task's own head, outside the
    backbone, stays trainable). ``alpha`` scales the adapters' update by ``alpha / rank``.

    Raises:
        ModelError: the backbone has no ``enable_lora``, or no layer it could adapt.
    """
    backbone = task.backbone
    name = type(backbone).__name__
    if not callable(getattr(backbone, "enable_lora", None)):
        raise ModelError(
            f"model.lora: {type(task).__name__}'s backbone {name} has no enable_lora: remove "
            "model.lora to fine-tune all its weights."
        )
    backbone.enable_lora(rank)
    adapted = lora_layers(backbone)
    if not adapted:
        targets = ", ".join(backbone.default_lora_layer_names())
        raise ModelError(
            f"model.lora: {name} has no layer LoRA can adapt (enable_lora adapts attention "
            f"layers named {targets}; {type(task).__name__} has none), so nothing but the task's "
            "head would train. Remove model.lora to fine-tune all its weights."
        )
    if alpha is not None:
        for layer in adapted:
            layer.lora_alpha = alpha  # read at every call (keras EinsumDense/Dense.kernel)


def parameter_counts(model: Any) -> ParameterCounts:
    """Parameters in all the model's weights and in its trainable ones (each variable once); a
    quantized base counts its float parameters, not the elements it stores."""

    def count(variables: list[Any]) -> int:
        unique = {id(v): v for v in variables}
        return sum(math.prod(v.shape) for v in unique.values())

    total = count(model.weights) - stored_over_parameters(model)
    return ParameterCounts(total, count(model.trainable_weights))
