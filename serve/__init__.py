"""Serving scripts (installed as medusa_lite.serve): server.py, loadtest.py, bench.py, calibrate.py, demo.py."""
