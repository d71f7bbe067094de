"""Child processes the tests signal: started with SIGINT, SIGTERM and SIGHUP at their
default dispositions, and stopped with SIGTERM, then SIGKILL.

NOTE: a signal ignored in a parent stays ignored across fork and exec. A suite started in
the background (`cmd &` in a non-interactive shell) inherits SIGINT ignored, and so would
every child it starts: Python then installs no KeyboardInterrupt handler, and a test's
SIGINT (a user's Ctrl-C) is lost. So every child a test signals is started through
`start_process`, whatever the suite inherited.
"""
from __future__ import annotations

import signal
import subprocess

# The signals the tests send to a child (SIGKILL cannot be ignored).
SENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def default_signal_dispositions() -> None:
    """In the child, between fork and exec: the sent signals back at their defaults."""
    for sent in SENT_SIGNALS:
        signal.signal(sent, signal.SIG_DFL)


def start_process(args, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)`, the child's sent signals at their defaults."""
    return subprocess.Popen(args, preexec_fn=default_signal_dispositions, **kwargs)


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
