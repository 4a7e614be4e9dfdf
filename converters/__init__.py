"""Converters: weights to per-hardware artifacts."""
