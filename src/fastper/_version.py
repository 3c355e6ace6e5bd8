"""The package version, in one place (the checkpoint header records it)."""

__version__ = "0.9.22"
