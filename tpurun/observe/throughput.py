"""Throughput users compare: tokens (or examples) per second, TFLOP/s per device and MFU.

MFU (model FLOPs utilisation) is as MaxText reports it: the FLOPs one training step of the model
needs, spread evenly over the devices that run it, times the steps an epoch ran, over its seconds,
against one device's peak (``runtime.peak_tflops``, else :func:`tpurun.runtime.devices.spec`).
Where no peak is known (a CPU), MFU is absent (None): never a made-up figure.

**Where the FLOPs come from.** XLA's cost analysis of Keras' own ``train_step`` on the JAX backend,
``jax.jit(model.train_step)`` lowered on *abstract* arguments (a ``ShapeDtypeStruct`` per variable,
with its sharding, and one global batch of the data's element spec, laid out on the data axis): no
array is made, nothing is donated or run. Two cost analyses were measured (tiny Gemma, 8 query / 4
key-value heads, hidden 64, 2 layers, batch 16 x 32 tokens, on 8 simulated CPU devices):

* the *lowered* module's (before XLA's passes and SPMD partitioning): the global FLOPs, 3.42e8 under
  a hand-set 2x4 ``ModelParallel`` (4.28e7 a device once divided by 8), 1.05x ``6·N·T`` plus
  attention; lowering and analysis took 0.1 s;
* the *compiled* one's (per device under SPMD): 4.57e7, 1.07x the lowered figure a device: each
  device also counts the work it repeats on replicated values (norms, unsharded variables' updates),
  which is not model work; and it costs a second XLA compile of the step (3.4 s for this toy, minutes
  for a real Gemma), since Keras compiles its own jitted step separately, with donation.

A plain Dense model (no distribution) gave 840,024 lowered and 847,416 compiled.
tpurun takes the **lowered** analysis, divided by the devices the step runs on (the mesh's devices
under a Keras distribution, else one): model FLOPs evenly spread, MaxText's numerator, at no
compile's cost. Its one extra cost is tracing the step once more, after the first step has run so
that it never delays it (the NAIC-like MLP on 8 CPU devices: 0.16 s before the first step, 0.07 s
after it, once Keras' own trace has warmed JAX's caches); the state's shapes and shardings are
taken before, when nothing has been donated to the compiled step yet.

**What a step consumes.** Token inputs (a ``token_ids`` feature, as KerasHub's text models take):
global batch x sequence length, padding included, as MaxText counts tokens; anything else: examples,
the global batch.

The TensorFlow backend has no MFU: Keras compiles its step inside a ``tf.function`` whose XLA
program tpurun cannot analyse the same way, so its FLOPs are None and only tokens (or examples) per
second are shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpurun import frameworks
from tpurun.runtime.devices import spec as device_spec

TOKEN_FEATURE = "token_ids"  # KerasHub's text models' token input


@dataclass(frozen=True)
class StepCost:
    """What one training step consumes and costs, and the peak it is measured against."""

    unit: str  # "tokens" or "examples"
    per_step: int  # tokens (padding included) or examples, in one global step
    flops_per_device: float | None  # one step's FLOPs a device; None: not measured (TF backend)
    peak_tflops: float | None  # one device's; None: unknown (a CPU without runtime.peak_tflops)

    def epoch(self, steps: int, seconds: float) -> dict[str, Any]:
        """An epoch's figures from its steps and seconds (those the epoch's ex/s is from):
        ``<unit>_per_second``, ``tflops_per_device`` and ``mfu`` (None where unknown)."""
        if seconds <= 0:
            return {}
        tflops = None
        if self.flops_per_device is not None:
            tflops = self.flops_per_device * steps / seconds / 1e12
        mfu = tflops / self.peak_tflops if tflops is not None and self.peak_tflops else None
        return {
            f"{self.unit}_per_second": steps * self.per_step / seconds,
            "tflops_per_device": tflops,
            "mfu": mfu,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            f"{self.unit}_per_step": self.per_step,
            "flops_per_step_per_device": self.flops_per_device,
            "peak_tflops": self.peak_tflops,
        }


def steady(cost: StepCost | None, epochs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``summary.json``'s ``throughput``: the step's cost and the mean of each figure over the
    epochs past the first (which compiles), when there are others; None before an epoch ends."""
    if cost is None or not epochs:
        return None
    kept = list(epochs[1:] or epochs)
    out = cost.to_dict()
    for key in kept[0]:
        values = [e.get(key) for e in kept]
        out[key] = None if any(v is None for v in values) else sum(values) / len(values)
    return out


def consumed_per_step(element_spec: Any, global_batch: int) -> tuple[str, int]:
    """``("tokens", batch x sequence length)`` for token inputs, else ``("examples", batch)``."""
    inputs = element_spec[0] if isinstance(element_spec, tuple) else element_spec
    tokens = inputs.get(TOKEN_FEATURE) if isinstance(inputs, Mapping) else None
    shape = getattr(tokens, "shape", None)
    if shape is not None and len(shape) >= 2 and shape[-1] is not None:
        return "tokens", global_batch * int(shape[-1])
    return "examples", global_batch


def peak_tflops(configured: float | None, device_kind: str | None) -> float | None:
    """``runtime.peak_tflops`` when set, else the device table's; None for a CPU or an unknown
    device."""
    if configured:
        return float(configured)
    known = device_spec(device_kind or "")
    return known.peak_tflops if known else None


def flops_per_device(
    model: Any, element_spec: Any, global_batch: int, state: tuple | None = None
) -> float | None:
    """One training step's FLOPs a device, from the lowered step's cost analysis (see the module's
    docstring); None on the TensorFlow backend, or when XLA reports none. ``state``: the model's
    :func:`abstract_state`, taken earlier (else now)."""
    keras = frameworks.keras()
    if keras.backend.backend() != "jax":
        return None  # no MFU on TensorFlow: see the module's docstring
    lowered = lowered_train_step(model, element_spec, global_batch, state)
    flops = lowered_flops(lowered)
    if flops is None:
        return None
    dist = keras.distribution.distribution()
    devices = dist.device_mesh.devices.size if dist is not None else 1
    return flops / devices


def measure(model: Any, element_spec: Any, prepared: Any, state: tuple | None = None) -> StepCost:
    """The step's cost for a run: ``prepared`` (a :class:`~tpurun.plan.prepare.Prepared`) gives
    the global batch and ``runtime.peak_tflops``; ``state`` as :func:`flops_per_device` takes it."""
    plan = prepared.plan
    unit, per_step = consumed_per_step(element_spec, plan.global_batch_size)
    flops = flops_per_device(model, element_spec, plan.global_batch_size, state)
    kind = frameworks.jax().devices()[0].device_kind if flops is not None else None
    return StepCost(unit, per_step, flops, peak_tflops(prepared.config.runtime.peak_tflops, kind))


def measuring(model: Any, progress: Any, element_spec: Any, prepared: Any, reporter: Any) -> Any:
    """A callback that measures the step's cost once the first step has run and gives it to
    ``progress`` (:class:`~tpurun.training.callbacks.progress.Progress`), which reports each
    epoch's figures: place it after ``progress``, whose batch end times the first step. The state's
    shapes and shardings are taken at the first ``on_train_begin`` (everything is built by then,
    and nothing donated to the compiled step). A step that cannot be analysed costs the run its
    TFLOP/s, never the run."""
    keras = frameworks.keras()
    taken: list = []  # the abstract state, once

    def on_train_begin(logs=None) -> None:
        if progress.step_cost is None and not taken and keras.backend.backend() == "jax":
            taken.append(abstract_state(model))

    def on_train_batch_end(batch, logs=None) -> None:
        if progress.step_cost is not None:
            return  # measured (or a second fit of the session: a mid-epoch resume, a NaN restore)
        try:
            progress.step_cost = measure(model, element_spec, prepared, taken[0] if taken else None)
        except Exception as exc:
            unit, per_step = consumed_per_step(element_spec, prepared.plan.global_batch_size)
            progress.step_cost = StepCost(unit, per_step, None, None)
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            reporter.message(
                "TFLOP/s and MFU are not shown: XLA's cost analysis of the training step failed "
                f"({type(exc).__name__}: {first})",
                "note",
            )

    return keras.callbacks.LambdaCallback(
        on_train_begin=on_train_begin, on_train_batch_end=on_train_batch_end
    )


def lowered_train_step(
    model: Any, element_spec: Any, global_batch: int, state: tuple | None = None
) -> Any:
    """``jax.jit(model.train_step)`` lowered on abstract arguments (``state``: the model's
    :func:`abstract_state`, else taken now): no array is made, nothing is donated or run."""
    jax = frameworks.jax()
    data = _abstract_batch(element_spec, global_batch)
    return jax.jit(model.train_step).lower(state or abstract_state(model), data)


def abstract_state(model: Any) -> tuple:
    """The 4 lists Keras' JAX ``train_step`` takes (keras/src/backend/jax/trainer.py), as
    ShapeDtypeStructs carrying each variable's sharding."""
    jax = frameworks.jax()

    def one(variable: Any) -> Any:
        value = variable.value
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)

    groups = (model.trainable_variables, model.non_trainable_variables,
              model.optimizer.variables, model.metrics_variables)  # fmt: skip
    return tuple([one(v) for v in variables] for variables in groups)


def _abstract_batch(element_spec: Any, global_batch: int) -> Any:
    """ShapeDtypeStructs for one global batch of a tf.data element spec, laid out as Keras'
    distribution lays a batch out; the dtypes JAX would make of the arrays (int64 -> int32)."""
    jax = frameworks.jax()
    dist = frameworks.keras().distribution.distribution()

    def one(spec: Any) -> Any:
        shape = (global_batch, *spec.shape[1:])
        if any(d is None for d in shape):
            raise ValueError(f"a dimension is unknown before the first step: {spec}")
        # A tf.data TensorSpec's dtype is a tf.DType; the native reader's ArraySpec's is numpy's.
        dtype = jax.dtypes.canonicalize_dtype(getattr(spec.dtype, "as_numpy_dtype", spec.dtype))
        sharding = dist.get_data_layout(shape).backend_layout if dist is not None else None
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return jax.tree_util.tree_map(one, element_spec)


def lowered_flops(lowered: Any) -> float | None:
    """The FLOPs of a lowered step: JAX's own analysis, or on a PJRT plugin, where JAX has none
    (the CUDA plugin; very likely a TPU's libtpu too: ``Lowered.cost_analysis`` returns None
    there, see ``jax/_src/interpreters/pxla.py``), the CPU client's analysis of the same HLO
    module. That is XLA's ``HloCostAnalysis`` of the module before any backend's passes, as the
    lowered analysis is on the CPU; the GPU check found no FLOPs on an H100 without it. None where
    neither can be had (no CPU client, or JAX's internals moved)."""
    flops = _flops(lowered.cost_analysis())
    if flops is not None:
        return flops
    try:
        jax = frameworks.jax()
        analyse = jax._src.lib._jax.hlo_module_cost_analysis  # pxla's own route to it
        module = lowered.compiler_ir("hlo").as_hlo_module()
        return _flops(analyse(jax.devices("cpu")[0].client, module))
    except Exception:  # noqa: BLE001 (no figure is better than a failed run)
        return None


def _flops(analysis: Any) -> float | None:
    """The ``flops`` of a cost analysis: a dict in jax 0.10, a list of one dict before."""
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    if not isinstance(analysis, Mapping):
        return None
    flops = analysis.get("flops")
    return float(flops) if flops is not None and flops > 0 else None
