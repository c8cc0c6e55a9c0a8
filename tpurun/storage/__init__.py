"""Where things are kept: local and ``gs://`` file operations, the run directory, its lock."""
