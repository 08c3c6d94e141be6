"""The exit codes of every ``mistc`` command and of the ranks it launches (one home; README lists them).

- ``OK`` (0): done.
- ``FAILED`` (1): a rank failed (its reason is the one error line), training diverged, a save failed,
  or ``--check`` found a difference.
- ``BAD_INPUT`` (2): refused before any rank started (the line names the option, field or file).
- ``PREEMPTED`` (75, ``EX_TEMPFAIL`` of sysexits.h): stopped by SIGTERM or SIGINT after finishing the
  step in flight and writing a checkpoint of it; run the same command with ``--resume SAVE_DIR`` to
  continue. Schedulers can requeue on it.
- ``INTERRUPTED`` (130): stopped at once (a second signal, or nothing to save to); what was saved
  before stays resumable, the steps since then are lost.
"""
from __future__ import annotations

OK = 0
FAILED = 1
BAD_INPUT = 2
PREEMPTED = 75
INTERRUPTED = 130
