"""An epoch's line says the input wait as a share of its time, after its rate, not as a metric;
and a run measured on its compiling epoch alone gets no verdict."""

from __future__ import annotations

import io

from tpurun.display.lines import PlainReporter, flop_rate, metric_parts
from tpurun.observe.input_wait import verdict


def test_the_input_wait_is_a_share_after_the_rate():
    out = io.StringIO()
    reporter = PlainReporter(out)
    reporter.epochs = 2
    reporter.epoch_end(1, {"loss": 0.5, "input_wait": 0.0612, "val_loss": 0.6}, 4.4, 317.0)
    assert out.getvalue() == (
        "[tpurun] epoch 1/2  loss 0.5000  val_loss 0.6000  4.4s  317 ex/s  input wait 6%\n"
    )
    assert metric_parts({"loss": 1.0, "input_wait": 0.3}) == ["loss 1.0000"]


def test_no_verdict_from_the_compiling_epoch_alone():
    assert verdict([(0.5, 9.0)], "c.yaml") is None  # one epoch: compile time dilutes the share
    assert verdict([(0.5, 9.0), (3.0, 5.0)], "c.yaml")[0].startswith("input-bound: 60%")


def test_the_flop_rate_is_said_in_the_unit_that_reads():
    assert flop_rate(78.1) == "78.1 TFLOP/s"  # a TPU core
    assert flop_rate(1234.0) == "1.23 PFLOP/s"
    assert flop_rate(0.5) == "500 GFLOP/s"
    assert flop_rate(2.91e-06) == "2.91 MFLOP/s"  # a toy model on a CPU, not 2.91e-06 TFLOP/s
    assert flop_rate(4e-10) == "0.4 kFLOP/s"
    out = io.StringIO()
    reporter = PlainReporter(out)
    reporter.epochs = 1
    figures = {"tokens_per_second": 41870.0, "tflops_per_device": 78.1, "mfu": 0.396}
    reporter.epoch_end(1, {"loss": 0.5, "throughput": figures, "input_wait": 0.02}, 62.0, 9.0)
    assert out.getvalue().endswith("41,870 tok/s  78.1 TFLOP/s/device  MFU 39.6%  input wait 2%\n")


def test_an_epochs_rates_leave_its_validation_out(monkeypatch):
    """ex/s (and tok/s, TFLOP/s, MFU) are over the training steps' time, as MaxText counts a step:
    an epoch of 10 s, 2 of them validating, trained 16 steps x 32 examples in 8 s."""
    from types import SimpleNamespace

    from tpurun.display.reporter import Reporter
    from tpurun.observe.throughput import StepCost
    from tpurun.training.callbacks import progress as callbacks

    clock = iter([0.0, 0.0, 8.0, 10.0, 10.0])  # init, epoch begin, validation begin/end, epoch end
    monkeypatch.setattr(callbacks.time, "monotonic", lambda: next(clock))
    plan = SimpleNamespace(steps_per_epoch=16, global_batch_size=32, steps_per_execution=16,
                           validation_steps=4)  # fmt: skip
    progress = callbacks.Progress(Reporter(), plan)
    progress.step_cost = StepCost("examples", 32, 1e12, None)
    progress.on_epoch_begin(0)
    progress.on_test_begin()
    progress.on_test_end()
    progress.on_epoch_end(0, {"loss": 0.5})
    assert progress.epoch_seconds == [10.0]  # the epoch's time is still the whole epoch's
    assert progress.epoch_rates == [16 * 32 / 8.0]
    assert progress.epoch_throughput[0]["tflops_per_device"] == 16 * 1e12 / 8.0 / 1e12
