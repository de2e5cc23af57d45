"""corral's version, importable without the SDK (the daemon reports it)."""

__version__ = "0.1.0"
