"""dapo-lightning: DAPO reinforcement learning for LLMs as a PyTorch Lightning library."""

__version__ = "0.1.0"
