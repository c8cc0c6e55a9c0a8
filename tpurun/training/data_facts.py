"""What the factory's model learns of the data: the keywords a factory may declare to receive facts
of it (``vocabulary_sizes``), and the check that no text feature reaches a model that takes numbers.
"""

from __future__ import annotations

import inspect
from typing import Any

from tpurun.config import CategoryFeature, Config, DataConfig
from tpurun.data import categories
from tpurun.errors import ModelError
from tpurun.training.input_check import slots
from tpurun.training.normalize import _model_input

#: Keywords a factory may declare to receive facts of the data (``model.kwargs`` wins).
VOCABULARY_SIZES = "vocabulary_sizes"


def factory_keywords(signature: inspect.Signature | None, config: Config) -> dict[str, Any]:
    """``vocabulary_sizes`` (``{feature: ids}`` of each ``type: category`` model input, the
    out-of-vocabulary id 0 included: an ``Embedding``'s ``input_dim``) when the factory declares
    that keyword."""
    if signature is None or VOCABULARY_SIZES not in signature.parameters:
        return {}
    data = config.data
    sizes = {name: data.features[name].size for name in DataConfig.names(data.inputs)
             if isinstance(data.features.get(name), CategoryFeature)}  # fmt: skip
    return {VOCABULARY_SIZES: sizes}


def check_string_features(model: Any, config: Config, backend: str) -> None:
    """A text feature fed to a model input of numbers (or any input on JAX, which has no
    strings), or learnt as a target, fails here, before compiling, saying what to do.

    Raises:
        ModelError: naming the feature and the option that turns it into numbers.
    """
    data = config.data
    for slot, name in slots(data.inputs):
        problem = categories.string_feature_problem(data, name, "inputs")
        own = _model_input(model, data.inputs, slot)
        takes_strings = own is not None and "string" in str(own.dtype)
        if problem and (backend == "jax" or (own is not None and not takes_strings)):
            raise ModelError(problem)
    for name in DataConfig.names(data.targets):
        problem = categories.string_feature_problem(data, name, "targets")
        if problem:
            raise ModelError(problem)
