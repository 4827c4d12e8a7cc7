"""Training scripts: train.py (entry point), data.py, loss.py, export_vllm.py."""
