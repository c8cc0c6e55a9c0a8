"""Pretrained KerasHub presets: KerasHub lives behind this door (``pip install 'tpurun[hub]'``).

- :mod:`.preset`: a preset folder read without Keras: where it is, whether it is complete (naming
  the file that is missing), the task and backbone it was saved with, its longest sequence.
- :mod:`.handles`: ``kaggle://`` and ``hf://`` handles, tried only where the hub can be reached.
- :mod:`.task`: the KerasHub task class ``model.task`` names, checked against the preset.
- :mod:`.model`: the task model built from the preset (sequence length, LoRA) and its parameter
  counts; :func:`tpurun.training.model.build_model` comes here for a ``model.preset``.
- :mod:`.report`: what ``tpurun config`` shows about a preset.

Only :mod:`.preset` and :mod:`.handles` may be used before the process is set up; the rest reach
KerasHub through :func:`tpurun.frameworks.keras_hub`.
"""
