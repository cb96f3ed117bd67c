"""The step doctor: trace one forward + backward op by op, compare it with an FP32 shadow, and
bisect the smallest set of modules to keep in fp32 (``diagnose_step``)."""
