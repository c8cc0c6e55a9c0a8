"""An epoch's line says the input wait as a share of its time, after its rate, not as a metric;
and a run measured on its compiling epoch alone gets no verdict."""

from __future__ import annotations

import io

from tpurun.display.lines import PlainReporter, metric_parts
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
