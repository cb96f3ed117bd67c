"""The torchrun script is run by torchrun, never imported by pytest."""

collect_ignore = ["hf_ddp_script.py"]
