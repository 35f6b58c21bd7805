"""Sweeps: many candidates, or every op a change touches, gated and measured against one base (run.py)."""
