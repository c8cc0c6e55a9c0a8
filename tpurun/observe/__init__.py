"""Seeing the training: TensorBoard logs, input wait, profiles, curves and the runs listing."""
