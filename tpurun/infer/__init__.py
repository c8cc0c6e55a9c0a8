"""After training: opening a run again (:mod:`.trained_run`, a preset's task: :mod:`.preset_task`),
evaluate, predict and export; :mod:`.scripts` holds what runs without tpurun."""
