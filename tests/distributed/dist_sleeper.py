"""A rank that never finishes: ``launch_torchrun``'s timeout must end it (``python -m dist_sleeper``)."""

import time

if __name__ == "__main__":
    print("started", flush=True)
    time.sleep(600)
