"""The ac-observe daemon and CLI (torch-free)."""
