"""The memory check: the estimate of :mod:`tpurun.runtime.memory` against one device's memory,
before anything compiles, and what would fit when it does not.

The device's memory, first found of: ``runtime.device_memory``; the runtime's own limit
(``device.memory_stats()["bytes_limit"]``, None on a CPU); tpurun's table by ``device_kind``
(:mod:`tpurun.runtime.devices`). A CPU has none: no check, the estimate is still shown.

Imports no framework: the model, its optimizer and the device are passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from tpurun.config import Config
from tpurun.errors import EnvironmentSetupError
from tpurun.runtime import devices as device_table
from tpurun.runtime import optimizer_split
from tpurun.runtime.activations import Activations, activations_of
from tpurun.runtime.layout import auto_axes
from tpurun.runtime.memory import (
    Entry,
    Estimate,
    counter_bytes,
    entries_of,
    estimate,
    slots_for,
    slots_of,
)
from tpurun.runtime.sizes import size

#: The LoRA rank the fix suggests (KerasHub's examples use 4 to 16).
LORA_RANK = 8


@dataclass(frozen=True)
class Limit:
    """One device's usable memory, and where the figure comes from."""

    bytes: int
    source: str  # "runtime.device_memory", "the runtime's memory_stats()", "tpurun's table (v5e)"

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "source": self.source}


def device_limit(
    config: Config, device: Any = None, kind: str | None = None, reported: int | None = None
) -> Limit | None:
    """The device's memory: the config's, the runtime's, the table's; None where none is known.

    Args:
        device: a JAX device (its ``memory_stats()`` and ``device_kind`` are read), or None.
        kind, reported: the device kind and ``bytes_limit`` found elsewhere (doctor's probe).
    """
    if config.runtime.device_memory is not None:
        return Limit(int(config.runtime.device_memory), "runtime.device_memory")
    if device is not None:
        kind = getattr(device, "device_kind", kind)
        try:
            stats = device.memory_stats() or {}
        except Exception:  # some plugins do not implement it
            stats = {}
        reported = stats.get("bytes_limit", reported)
    if reported:
        return Limit(int(reported), f"the runtime's memory_stats() on {kind or 'the device'}")
    spec = device_table.spec(kind or "")
    if spec is not None:
        return Limit(spec.memory_bytes, f"tpurun's table ({spec.name})")
    return None


# ----------------------------------------------------------------------------------- estimate
def config_slots(config: Config, model: Any) -> Any:
    """The optimizer's slots: the compiled model's optimizer, else the config's (a preset left
    without one: KerasHub compiles its tasks with Adam, tpurun's default name too)."""
    optimizer = getattr(model, "optimizer", None)
    given = "optimizer" in config.model.model_fields_set
    if optimizer is not None and not given:
        return slots_of(optimizer)
    spec = config.model.optimizer
    return slots_for(spec.name, spec.kwargs)


def run_mesh(config: Config, choice: Any, plan: Any) -> tuple[int, int] | None:
    """The run's ``(data, model)``: the choice's where the devices are counted, else as written
    (``data: auto`` filled from the replicas); None without ``runtime.mesh``."""
    if choice.mesh is not None or config.runtime.mesh is None:
        return choice.mesh
    model, data = config.runtime.mesh.model, config.runtime.mesh.data
    return (data if data != "auto" else max(1, plan.replicas // model)), model


def per_device_batch(plan: Any, mesh: tuple[int, int]) -> int:
    """Examples each device's activations hold: the global batch over the data axis."""
    return max(1, plan.global_batch_size // max(1, mesh[0]))


def estimate_for_model(
    model: Any,
    config: Config,
    plan: Any,
    mesh: tuple[int, int] | None,
    specs: dict[str, tuple] | None = None,
) -> Estimate:
    """Bytes per device of ``model`` as ``config`` trains it on ``mesh`` (``(data, model)``, None
    without one). A live model's shardings are read from its variables; a model built without
    the devices (a stateless scope) takes ``specs`` (path -> axes per dimension). Builds nothing:
    the optimizer may be compiled in but not built."""
    mesh = mesh or (plan.replicas, 1)  # data parallel: every device a replica, weights whole
    lr = config.train.learning_rate
    lr_variable = lr.schedule == "constant" and plan.warmup_steps == 0  # a float, not a schedule
    sequence = config.model.sequence_length
    return estimate(
        planned_entries(model, specs),
        mesh,
        config_slots(config, model),
        accumulation=config.train.gradient_accumulation_steps,
        counters=counter_bytes(plan.backend, lr_variable),
        activations=activations_of(
            model, per_device_batch(plan, mesh), sequence, remat=config.train.remat
        ),
        optimizer_devices=optimizer_split.devices_for(plan, config),
    )


#: The attribute a preset task built without its weights carries when ``model.quantize`` is to
#: come (:func:`tpurun.hub.quantize.plan`): quantizing reads every float value, which such a
#: model would draw on the host (34 GB for a 7B model in float32).
PLANNED_QUANTIZE = "_tpurun_quantize_planned"


def planned_entries(model: Any, specs: dict[str, tuple] | None = None) -> list[Entry]:
    """The model's entries; a model built without its weights for a ``model.quantize`` run has
    its kernels and embeddings counted as :func:`quantized` stores them."""
    entries = entries_of(model, specs)
    mode = getattr(model, PLANNED_QUANTIZE, None)
    return entries if mode is None else [q for e in entries for q in quantized(e, mode)]


# --------------------------------------------------------------------------------------- check
def check_fits(est: Estimate, limit: Limit | None, config: Config, plan: Any) -> str | None:
    """Stop a run that cannot fit, before anything compiles.

    Returns:
        One line for the run's output (the estimate against the limit), or None without a limit.

    Raises:
        EnvironmentSetupError: the estimate is over the limit; the terms, the limit, and what
            would fit (with its estimate).
    """
    if limit is None:
        return None
    if est.total <= limit.bytes:
        return f"memory: about {size(est.total)} per device of {size(limit.bytes)} ({limit.source})"
    raise EnvironmentSetupError(refusal(est, limit, config, plan))


def refusal(est: Estimate, limit: Limit, config: Config, plan: Any) -> str:
    """The paragraph a run too big for its devices stops with."""
    mesh = est.mesh
    where = f" on a {mesh['data']}x{mesh['model']} mesh" if mesh["model"] > 1 else ""
    head = (
        f"The model does not fit in one device's memory: about {size(est.total)} per device"
        f"{where} ({est.terms_text()}), and a device has {size(limit.bytes)} ({limit.source})."
    )
    options = fixes(est, limit, config, plan)
    fitting = [text for text, fits in options if fits]
    if fitting:
        return head + f" What would fit: {'; '.join(fitting)}. Nothing was compiled."
    tried = "; ".join(text for text, _ in options)
    others = f" Alone, none of these fits: {tried}; combine them, or" if tried else " Use"
    return head + f"{others} use a device with more memory. Nothing was compiled."


def fixes(est: Estimate, limit: Limit, config: Config, plan: Any) -> list[tuple[str, bool]]:
    """What the config could change, each as ``(text with its estimate, fits)``: those that
    lower the estimate (each fix answers ``(lowers, text, fits)`` or None). First those that
    leave the training's maths as it is (a larger model axis, remat: more devices or more
    compute), then those that change what trains, its precision (bfloat16, then a quantized
    base) or its batch."""
    out = []
    for fix in (_larger_model_axis, _remat, _lora, _bfloat16, _quantize, _smaller_batch):
        found = fix(est, limit, config, plan)
        if found is not None and found[0]:
            out.append(found[1:])
    return out


def _larger_model_axis(est: Estimate, limit: Limit, config: Config, plan: Any):
    if plan.backend != "jax":
        return None
    devices = est.mesh["data"] * est.mesh["model"]
    best = None
    for model in range(est.mesh["model"] + 1, devices + 1):
        if devices % model:
            continue
        data = devices // model
        entries = est.entries if _splits(est) else [_auto(e, model) for e in est.entries]
        if not all(_divides(e, {"data": data, "model": model}) for e in entries):
            continue
        acts = est.activations
        if acts is not None:  # the global batch stays: each data row takes more of it
            acts = replace(acts, batch=acts.batch * est.mesh["data"] // data)
        # A mesh's layout places the optimizer's variables too: not split over the data axis.
        trial = replace(est, entries=entries, mesh={"data": data, "model": model}, activations=acts,
                        optimizer_devices=1)  # fmt: skip
        best = (model, data, trial.total)
        if trial.total <= limit.bytes:
            return True, (f"runtime.mesh: {{data: {data}, model: {model}}} (about "
                          f"{size(trial.total)} per device)"), True  # fmt: skip
    if best is None:
        return None
    model, data, total = best
    text = f"runtime.mesh: {{data: {data}, model: {model}}} (about {size(total)} per device)"
    return total < est.total, text, False


def _splits(est: Estimate) -> bool:
    return any("model" in e.axes() for e in est.entries)


def _auto(entry: Entry, model: int) -> Entry:
    """A replicated run's variable as ``runtime.layout: auto`` would split it over ``model``
    (:func:`tpurun.runtime.layout.auto_axes`); LoRA's adapters stay whole."""
    axes = auto_axes(entry.shape, model)
    return entry if entry.lora or not any(axes) else replace(entry, spec=axes)


def _divides(entry: Entry, mesh: dict[str, int]) -> bool:
    for n, part in zip(entry.shape, entry.spec, strict=False):
        parts = math.prod(
            mesh.get(a, 1) for a in ((part,) if isinstance(part, str) else part or ())
        )
        if n % parts:
            return False
    return True


def _remat(est: Estimate, limit: Limit, config: Config, plan: Any):
    """``train.remat: true``: each block's activations recomputed in the backward pass, where
    the activation term can tell what that saves (a transformer's)."""
    acts = est.activations
    if config.train.remat or acts is None or acts.remat is None:
        return None
    trial = replace(est, activations=acts.rematerialised())
    text = f"train.remat: true (about {size(trial.total)} per device)"
    return trial.total < est.total, text, trial.total <= limit.bytes


def _lora(est: Estimate, limit: Limit, config: Config, plan: Any):
    """LoRA on a preset trained in full: the weights frozen, adapters of rank 8 on every
    attention query and value kernel (float32, replicated), trained alone."""
    if config.model.preset is None or config.model.lora is not None:
        return None
    trial = _with_lora(est)
    if trial is None:
        return None
    text = f"model.lora: {{rank: {LORA_RANK}}} (about {size(trial.total)} per device)"
    return trial.total < est.total, text, trial.total <= limit.bytes


def _with_lora(est: Estimate) -> Estimate | None:
    """``est`` with every weight frozen and adapters beside the attention query and value
    kernels; None where it has no such kernel."""
    adapters = []
    for e in est.entries:
        if e.path.endswith(("query/kernel", "value/kernel")) and len(e.shape) >= 2:
            adapters.append(
                Entry(e.path + "_lora_a", (e.shape[0], LORA_RANK), "float32", (None, None), True)
            )
            out = (LORA_RANK, *e.shape[1:])
            adapters.append(Entry(e.path + "_lora_b", out, "float32", (None,) * len(out), True))
    if not adapters:
        return None
    frozen = [replace(e, trainable=False) for e in est.entries]
    return replace(est, entries=frozen + adapters, slots=replace(est.slots, factored=False))


def _quantize(est: Estimate, limit: Limit, config: Config, plan: Any):
    """``model.quantize`` (QLoRA) on a preset: its frozen kernels and embeddings int8, else
    int4 (the first that fits), with LoRA where the run has none (a quantized kernel does not
    train). After bfloat16: the base's weights only approximate the float ones."""
    modes = {None: ("int8", "int4"), "int8": ("int4",)}.get(config.model.quantize, ())
    if config.model.preset is None or not modes:
        return None
    base, lora = est, ""
    if config.model.lora is None:
        base, lora = _with_lora(est), f"model.lora: {{rank: {LORA_RANK}}} with "
        if base is None:
            return None
    found = None
    for mode in modes:
        trial = replace(base, entries=[q for e in base.entries for q in quantized(e, mode)])
        layout = ""
        if mode == "int4" and est.mesh["model"] > 1 and config.runtime.layout != "auto":
            layout = " and runtime.layout: auto"  # the preset's per-head rules cannot split it
        text = f"{lora}model.quantize: {mode}{layout} (about {size(trial.total)} per device)"
        found = (trial.total < est.total, text, trial.total <= limit.bytes)
        if found[2]:
            break
    return found


#: Keras' int4 scales one block of this many inputs together (``Int4QuantizationConfig``).
INT4_BLOCK = 128


def quantized(entry: Entry, mode: str) -> list[Entry]:
    """``entry`` as ``model.quantize: mode`` would store it, for the memory check's fix (the
    live estimate reads the quantized variables themselves): a frozen kernel or embedding of 2
    or more dimensions becomes int8 (int4: two a byte) with float32 scales (int4: and int8 zero
    points, per block of 128 inputs), about as Keras lays them out; anything else is left."""
    if entry.trainable or entry.lora or len(entry.shape) < 2:
        return [entry]
    if not entry.path.endswith(("kernel", "embeddings")):
        return [entry]
    n = math.prod(entry.shape)
    if mode == "int8":
        scales = n // max(entry.shape[:-1] if entry.path.endswith("kernel") else entry.shape[1:])
        return [replace(entry, dtype="int8"),
                Entry(entry.path + "_scale", (scales,), "float32", (None,), False)]  # fmt: skip
    packed = (*entry.shape[:-1], -(-entry.shape[-1] // 2))
    blocks = max(1, -(-n // INT4_BLOCK))
    return [replace(entry, shape=packed, dtype="int8"),
            Entry(entry.path + "_scale", (blocks,), "float32", (None,), False),
            Entry(entry.path + "_zero", (blocks,), "int8", (None,), False)]  # fmt: skip


def _bfloat16(est: Estimate, limit: Limit, config: Config, plan: Any):
    """``runtime.precision: bfloat16``: float32 weights (not LoRA's) and their gradients and slots
    halve, and so do float32 activations."""
    if config.runtime.precision == "bfloat16":
        return None
    halved = [replace(e, dtype="bfloat16") if e.dtype == "float32" and not e.lora else e
              for e in est.entries]  # fmt: skip
    if halved == est.entries:
        return None
    acts = est.activations
    if acts is not None and plan.precision == "float32":
        acts = acts.scaled(0.5)
    trial = replace(est, entries=halved, activations=acts)
    text = f"runtime.precision: bfloat16 (about {size(trial.total)} per device)"
    return trial.total < est.total, text, trial.total <= limit.bytes


def _smaller_batch(est: Estimate, limit: Limit, config: Config, plan: Any):
    """The largest per-core batch whose activations fit beside the rest; with the gradient
    accumulation that keeps the effective batch, where its accumulators fit too."""
    acts: Activations | None = est.activations
    per_core = plan.per_core_batch_size
    if acts is None or not acts.batch or per_core <= 1:
        return None
    model = est.mesh["model"]
    per_example = acts.bytes(model, batch=1) or 1
    fixed = est.total - est.activation_bytes
    examples_per_core = acts.batch / per_core  # the device's slice grows with the per-core batch
    fitting = int((limit.bytes - fixed) // (per_example * examples_per_core))
    if fitting < 1:
        return None
    fitting = min(fitting, per_core - 1)
    if config.train.global_batch_size is not None:
        text = f"train.global_batch_size: {fitting * plan.global_batch_size // per_core}"
    else:
        text = f"train.per_core_batch_size: {fitting}"
    steps = -(-per_core * config.train.gradient_accumulation_steps // fitting)
    extra = est.gradients if config.train.gradient_accumulation_steps == 1 else 0
    with_accumulation = fixed + extra + per_example * examples_per_core * fitting
    if steps > 1 and with_accumulation <= limit.bytes:
        text += (
            f" with train.gradient_accumulation_steps: {steps} for about the same effective batch"
        )
    return True, text, True


# ------------------------------------------------------------------------------------ in words
def memory_lines(derived: dict[str, Any]) -> list[str]:
    """The mesh, the layout and the memory per device in words (``tpurun config``, doctor)."""
    memory = derived.get("memory_per_device")
    if not memory:
        return []
    mesh, layout = derived["mesh"], derived["layout"]
    split = layout["split"]["model"]
    whole = layout["replicated"]
    lines = [
        f"mesh {mesh['data']}x{mesh['model']}, layout {layout['source']}: {split['variables']} "
        f"variables ({size(split['bytes'])}) split over model, {layout['split']['data']['variables']}"
        f" over data, {whole['variables']} ({size(whole['bytes'])}) whole on every device"
    ]
    terms = ", ".join(f"{k} {size(v)}" for k, v in memory.items() if k != "total" and v is not None)
    line = f"memory per device: about {size(memory['total'])} ({terms})"
    limit = derived.get("device_memory")
    if limit:
        verdict = "fits" if limit["fits"] else "does NOT fit: train will stop before compiling"
        line += f", of {size(limit['bytes'])} ({limit['source']}): {verdict}"
    return [*lines, line]


def check_model(model: Any, config: Any, plan: Any, runtime: Any, reporter: Any) -> None:
    """Training's check: the bytes a device will hold for ``model`` against its memory, after the
    model is built and compiled and before the first step compiles. Refused (exit 2) with what
    would fit; a run that fits says its per-device memory in one line.

    Raises:
        EnvironmentSetupError: the estimate is over the device's memory.
    """
    estimate = estimate_for_model(model, config, plan, runtime.mesh)
    device = (runtime.devices or [None])[0]  # None on TensorFlow: the config or the table
    line = check_fits(estimate, device_limit(config, device), config, plan)
    if line:
        reporter.message(line, "note")
