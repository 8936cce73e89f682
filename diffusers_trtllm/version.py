"""The package version (one place: the package root and the checkpoints it writes read it)."""

__version__ = "0.1.0"
