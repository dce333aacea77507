"""Tuning the tree to this machine: the calibration harness and the cached choice."""
