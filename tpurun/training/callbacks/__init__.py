"""The run's Keras callbacks, one class per module, as Keras lays out its own: progress reporting
(:mod:`.progress`), exact validation (:mod:`.exact_validation`), the one stop path and each
epoch's commit (:mod:`.run_control`), resumable early stopping and LR plateau
(:mod:`.early_stopping`, :mod:`.reduce_lr_on_plateau`, on :mod:`.resumable`), and the list
``fit`` gets (:mod:`.build`).

:class:`~.run_control.RunControl` owns everything that ends or commits an epoch: a stop request
(signal, time limit, NaN) is saved at the step it lands on and ends ``fit`` there; a finished
epoch writes its CSV row, then its checkpoint. :class:`~.progress.Progress` only reports. Keras
calls callbacks in list order and ``RunControl`` is last, so the stateful callbacks have updated
their counters for the epoch before it saves them.
"""
