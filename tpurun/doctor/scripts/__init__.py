"""The probes ``tpurun doctor`` runs in child processes, one module each, run as
``python -m tpurun.doctor.scripts.<name> '<JSON payload>'`` by :class:`tpurun.doctor.child.Child`.

Each has a ``main()`` that reads the payload, does its work and prints one answer line. Importing
one is light (the frameworks are imported inside the functions that use them, through
:mod:`tpurun.frameworks`), so tests import them and check their pure parts in-process; and this
package imports none of them, so ``-m`` runs each fresh.

- :mod:`.devices`: the devices JAX or TensorFlow sees.
- :mod:`.health`: a timed matmul and all-reduce over the chosen replicas (JAX or TensorFlow).
- :mod:`.gcs_probe`: reach storage; read the config's data, write where it writes.
- :mod:`.model_step`: build the model and run one training step on the CPU.
"""
