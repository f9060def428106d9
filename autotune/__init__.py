"""Triton kernel autotuning cache (graft-autotune). Built in its own issue."""
