"""One training run: the session, the fit loop, the model, callbacks, checkpoints and resume,
signals, the monitored metrics and exact validation."""
