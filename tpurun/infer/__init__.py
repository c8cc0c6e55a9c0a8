"""After training: opening a run again, evaluate, predict and export."""
