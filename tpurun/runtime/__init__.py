"""The machine and the process: what the machine has, the one choice of backend and
accelerator, the derived plan, and activating the choice in this process."""
