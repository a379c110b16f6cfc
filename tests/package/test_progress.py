"""Progress bars are drawn on a terminal only: into a log or a pipe they were carriage-return
frames between the lines a reader wants."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

from hobbitpy.system.progress import progress_bar
from serving import MODEL


def test_a_bar_is_drawn_on_a_terminal_and_not_into_a_file():
    controller, terminal = pty.openpty()
    try:
        with os.fdopen(terminal, "w", closefd=False) as tty:
            assert progress_bar(range(3), file=tty).disable is False
            assert progress_bar(range(3), file=tty, disable=True).disable is True
        log = io.StringIO()
        for _ in progress_bar(range(3), file=log, desc="work"):
            pass
        assert log.getvalue() == ""
    finally:
        os.close(controller)
        os.close(terminal)


def test_a_command_writing_to_a_log_writes_no_bar(tmp_path):
    # `inflate` draws a bar per tensor: with stderr a file, only its lines remain
    out = tmp_path / "wide.gguf"
    proc = subprocess.run([sys.executable, "-m", "hobbitpy", "inflate", str(MODEL), str(out), "--n-ff", "1024"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "%|" not in proc.stderr, proc.stderr[-500:]

