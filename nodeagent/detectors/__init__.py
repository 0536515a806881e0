"""Detectors turn collector samples into events, with thresholds and hysteresis."""
