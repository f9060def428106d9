"""Optuna calibration of tau / N / K / D per model and device (graft-calibrate). Built in its own issue."""
