"""The one-shot GPU check (``make gpu-check``); see gpu_check/main.py."""
