"""The library version (a leaf: saved configs and the hardware-fit cache record it)."""

__version__ = "0.1.0"
