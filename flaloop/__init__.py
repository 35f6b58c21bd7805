"""flaloop: make GPU kernels faster without ever breaking or gaming correctness."""

__version__ = "0.1.0"
