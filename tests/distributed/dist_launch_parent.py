"""A parent process that launches ``dist_sleeper`` on 2 ranks and waits (``python dist_launch_parent.py LOG_DIR``).

The orphan tests kill this process (SIGKILL, SIGTERM) and check that torchrun and the ranks go too.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Imported here: run as a script, this folder is on sys.path; collected by pytest's doctest
    # scan as part of the tests.distributed package, the plain name would not resolve.
    from _dist_testlib import launch

    result = launch("dist_sleeper", [], Path(sys.argv[1]), timeout=300.0)
    print(result.describe(), flush=True)
