"""The plan: what a config means on this machine and this data, derived without taking a device.

- :mod:`.plan`: the derived values (:class:`~tpurun.plan.plan.Plan`): replicas, the batch sizes,
  the learning rate scaled for the batch (:func:`~tpurun.plan.plan.lr_factor`), steps per epoch
  and per execution, warmup and total steps.
- :mod:`.prepare`: a config, the machine's facts and the data -> the effective config and the
  plan (:class:`~tpurun.plan.prepare.Prepared`), with each process's share of the records.
- :mod:`.bench`: ``tpurun data bench``: the prepared training input timed on its own.
"""
