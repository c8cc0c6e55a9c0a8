"""Checkpoints, in one home: writing them while training (:mod:`.checkpointer`: the resume point,
the best and pattern-named models, their commit order) and reading them back (:mod:`.resume`:
finding a resume point, and refusing one that no longer fits the config)."""
