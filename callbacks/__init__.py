"""Callbacks for DAPO runs, importable as ``dapo_lightning.callbacks``."""
