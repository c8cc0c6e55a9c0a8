"""Several processes training together: the cluster, each process's share of the data, the
agreed stop, the watchdog, and ``tpurun launch``."""
