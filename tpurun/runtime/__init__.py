"""The machine and the process: what the machine has, the one choice of backend and
accelerator, the device mesh and its layout, the memory estimate, and activating the choice in
this process. What a config means on this machine and its data is :mod:`tpurun.plan`."""
