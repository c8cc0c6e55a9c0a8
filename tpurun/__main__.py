"""``python -m tpurun``."""

from tpurun.cli.app import main

main()
