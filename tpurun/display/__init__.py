"""What a person reads: plain lines, the live view, and the tables of the one-shot commands.

:mod:`.reporter` is the interface a run reports to; :mod:`.lines` writes it as plain lines,
:mod:`.live` as a Rich live view; :mod:`.reports` prints the one-shot commands' tables
(:mod:`.data_reports` the ``data`` commands'), :mod:`.placements` the variables' placement listing.
"""

from __future__ import annotations

from tpurun.display.lines import PlainReporter
from tpurun.display.live import LiveReporter
from tpurun.display.reporter import Reporter, want_plain


def make_reporter(plain: bool = False) -> Reporter:
    """Plain lines where a live view cannot redraw (:func:`want_plain`), else the live view."""
    if want_plain(plain):
        return PlainReporter()
    return LiveReporter()
