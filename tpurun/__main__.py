"""``python -m tpurun``."""

from tpurun.cli import main

main()
