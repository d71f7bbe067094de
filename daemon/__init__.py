"""The ac-observe daemon and CLI."""

__version__ = "0.1.0"
