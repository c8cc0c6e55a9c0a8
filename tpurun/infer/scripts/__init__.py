"""Scripts that run without tpurun: ``tpurun export`` runs the first two by their path in a fresh
``python -I`` (no tpurun importable there), and copies the third beside a ``.keras`` export.

- :mod:`.run_artifact`: load an exported artifact as a user would, run inputs, save the outputs
  (the parent side: :mod:`tpurun.infer.artifact_check`).
- :mod:`.run_huggingface`: load a Hugging Face export with transformers and save its logits
  (the parent side: :mod:`tpurun.infer.hf_export`).
- :mod:`.keras_loader`: copied as ``<name>_loader.py``; loads the model with its own code.

Keep tpurun imports out of all three.
"""
