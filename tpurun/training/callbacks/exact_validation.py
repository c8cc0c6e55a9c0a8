"""ExactValidation: the padded validation's loss means made means over the records scored."""

from __future__ import annotations

from tpurun import frameworks
from tpurun.display.reporter import Reporter
from tpurun.training.validation import correctable, exact_logs

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


class ExactValidation(keras.callbacks.Callback):
    """First in the list: turns the padded validation's loss means into means over the records
    scored, before any other callback reads the epoch's logs (see :mod:`tpurun.infer.evaluate`)."""

    def __init__(self, scored: int, fed: int, reporter: Reporter):
        super().__init__()
        self.scored, self.fed, self.reporter = scored, fed, reporter
        self.exact = True

    def on_train_begin(self, logs=None):
        self.exact = correctable(self._model)
        if not self.exact and self.fed != self.scored:
            self.reporter.message(
                f"val_loss: a loss with a reduction other than Keras' default is averaged over "
                f"{self.fed} validation records, {self.fed - self.scored} of them padding weighted "
                "0; the val_ metrics are exact",
                "warn",
            )

    def on_epoch_end(self, epoch, logs=None):
        if self.exact and logs is not None and "val_loss" in logs:
            exact_logs(logs, self.model, self.scored, self.fed)
