"""corral: self-hosted sandboxes for reinforcement learning."""

__version__ = "0.1.0"
