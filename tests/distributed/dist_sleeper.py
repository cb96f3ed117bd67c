"""A rank that never finishes: ``launch_torchrun``'s timeout must end it (``python -m dist_sleeper``).

On SIGTERM it says so on stdout before it dies by that signal, so a test can tell a launch that
was stopped in order (SIGTERM passed on) from one whose processes were killed.
"""

import os
import signal
import time


def _stopped(signum, frame):
    print("stopped by SIGTERM", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stopped)
    print("started", flush=True)
    time.sleep(600)
