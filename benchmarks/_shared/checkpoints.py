"""The cached random checkpoints the update benchmarks time (tiny, or SmolLM2-135M's shape)."""

from __future__ import annotations

from typing import Any

from benchmarks._common import out_dir

#: SmolLM2-135M's shape, randomly initialised (the brief's "real size").
SMOL_SHAPE: dict[str, Any] = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=2048,
)


def checkpoint_for(model: str) -> str:
    """Cached checkpoint folder under ``benchmarks/out/`` (written once)."""
    from dapo_lightning.testing import make_tiny_checkpoint

    path = out_dir() / f"ckpt_{model}"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, **(SMOL_SHAPE if model == "smol" else {}))
    return str(path)
