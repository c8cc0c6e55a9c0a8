"""A config, the machine's facts and the data -> the effective config and the plan.

:func:`prepare` has no side effects: it takes no device, sets no environment variable and writes
nothing, so ``tpurun config``, ``tpurun data bench`` and ``tpurun doctor`` can use it on a machine
whose TPU another process holds. Setting the process up (devices, distribution, precision) is
:func:`tpurun.runtime.activate.activate`, a separate step that only the commands that run a model take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpurun.config import Config
from tpurun.config.chat_config import config_template
from tpurun.data import reader as readers
from tpurun.data.resolve import ResolvedData, resolve
from tpurun.data.statistics import normalization
from tpurun.multihost.shares import Share, share_warning, shares
from tpurun.plan import records_check
from tpurun.plan.plan import Plan, make_plan
from tpurun.runtime.choice import Choice, choose
from tpurun.runtime.machine import Machine, probe

# Per host, the JAX devices of one TPU chip: two TensorCores on v2 and v3; one (megacore, or a
# single-core chip) from v4 on. Used only to estimate a plan without taking the TPU.
_CORES_PER_CHIP = {"v2": 2, "v3": 2}
_TPU_NODE_CORES = 8  # a legacy TPU node (v2-8, v3-8)


@dataclass
class Prepared:
    """A config resolved against a machine and its data: everything a run needs but devices."""

    config: Config  # the effective config: features filled in from the schema, compression known
    choice: Choice
    plan: Plan
    data: ResolvedData  # the files, their record counts, the shards data.skip_corrupt left out
    train_share: Share  # what this process reads (all of it on one process)
    validation_share: Share | None
    # normalize: true's numbers, {feature: {mean, variance, ...}}, from the schema's statistics
    normalization: dict | None = None
    reader: readers.Reader | None = None  # the input pipeline (tpurun.data.reader.choose)

    def derived(self) -> dict[str, Any]:
        """The values derived on this machine, as ``config.yaml`` and ``tpurun config`` show them."""
        data = self.data
        return {
            **self.plan.to_dict(),
            "train_files": len(data.train_files),
            "validation_files": len(data.validation_files),
            "train_records": data.train_records,
            "validation_records": data.validation_records,
            "record_counts_from": data.counts_from,
            "compression": self.config.data.compression,
            # Where predict and export find them: the label's class names, from the schema file.
            "class_names": data.class_names,
            **({"normalization": self.normalization} if self.normalization else {}),
            # The chat format the records were written in (predict renders prompts in it), kept
            # with the run: its data folder may be moved or deleted after training.
            **({"chat": chat} if (chat := (data.tokenized or {}).get("chat")) else {}),
        }

    def effective(self) -> dict[str, Any]:
        """The config as run, defaults and data filled in, plus ``derived``; loads back as a config.

        Its relative input paths (data globs, ``file.py:name`` imports, a preset folder) are made
        absolute: the file is written into the run directory, where relative paths would no longer
        lead to the data and code they named.
        """
        config = self.config.to_dict()
        data = config["data"]
        if not data.get("kaggle_dataset"):  # those globs are relative to the dataset's root
            for key in ("train", "validation"):
                if isinstance(data.get(key), list):
                    data[key] = [self.config.resolve_path(g) for g in data[key]]
                elif data.get(key):
                    data[key] = self.config.resolve_path(data[key])
        for key in ("model", "callbacks"):
            config[key] = _absolute_imports(config[key], self.config)
        if config["model"].get("preset"):  # a folder, as the factory's file (a handle stays)
            config["model"]["preset"] = self.config.resolve_path(config["model"]["preset"])
        if isinstance(data.get("chat_template"), str):  # kept whole: the file may move
            data["chat_template"] = config_template(self.config).model_dump()
        return {**config, "derived": self.derived()}


def _absolute_imports(value: Any, config: Config) -> Any:
    """``path/to/file.py:name`` strings made absolute, anywhere in a section."""
    if isinstance(value, dict):
        return {k: _absolute_imports(v, config) for k, v in value.items()}
    if isinstance(value, list):
        return [_absolute_imports(v, config) for v in value]
    if isinstance(value, str) and ".py:" in value:
        path, _, name = value.rpartition(":")
        return f"{config.resolve_path(path)}:{name}"
    return value


def choose_for(config: Config, machine: Machine | None = None) -> Choice:
    """The runtime :func:`tpurun.runtime.choice.choose` picks for this config on this machine."""
    return choose(config.runtime, config.train.steps_per_execution, machine or probe())


def estimated_replicas(choice: Choice, machine: Machine) -> int:
    """The replica count without initialising a TPU: its core count from the device files (and
    ``TPU_ACCELERATOR_TYPE`` for the chip generation). ``train`` uses the real count."""
    if choice.replicas is not None:
        return choice.replicas
    chips = len(machine.tpu_device_files)
    if not chips:
        return _TPU_NODE_CORES
    generation = machine.env.get("TPU_ACCELERATOR_TYPE", "").split("-")[0]
    return chips * _CORES_PER_CHIP.get(generation, 1)


def prepare(config: Config, choice: Choice, replicas: int) -> Prepared:
    """Resolve the data (files, features, counts, damage) and derive the plan. No side effects.

    Args:
        config: a validated config.
        choice: the runtime it will run on (:func:`choose_for`).
        replicas: the replica count: the activated runtime's, or :func:`estimated_replicas`.

    Raises:
        TpurunError: missing, damaged or mismatched data; a batch that does not fit; a
            ``data.reader`` that cannot run here.
    """
    resolved = resolve(config)
    effective = config.model_copy(update={"data": resolved.data})
    records_check.check(effective, resolved.tokenized)
    reader = readers.for_config(effective, choice)
    numbers, constant = normalization(effective.data, resolved.train_files)
    n = choice.cluster.num_processes
    train = shares(resolved.train_files, resolved.train_counts, n)
    validation = shares(resolved.validation_files, resolved.validation_counts, n)
    plan = make_plan(
        effective,
        choice,
        replicas,
        [s.records for s in train],
        [s.records for s in validation] if resolved.validation_files else None,
    )
    plan.reader, plan.reader_reason = reader.name, reader.reason
    plan.warnings.extend([*(s.describe() for s in resolved.skipped), *constant, *resolved.warnings])
    for split, files in (
        ("train", resolved.train_files),
        ("validation", resolved.validation_files),
    ):
        warning = share_warning(split, files, n) if files else None
        if warning:
            plan.warnings.append(warning)
    i = choice.cluster.process_id
    return Prepared(
        effective,
        choice,
        plan,
        resolved,
        train[i],
        validation[i] if resolved.validation_files else None,
        numbers,
        reader,
    )


def prepare_here(config: Config, machine: Machine | None = None) -> Prepared:
    """:func:`prepare` with this machine's choice and estimated replicas (``tpurun config``,
    ``data bench``): nothing is activated."""
    machine = machine or probe()
    choice = choose_for(config, machine)
    return prepare(config, choice, estimated_replicas(choice, machine))
