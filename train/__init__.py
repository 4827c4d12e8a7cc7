"""Training scripts (installed as medusa_lite.train): train.py (entry point), data.py, loss.py, export_vllm.py, distill_data.py."""
