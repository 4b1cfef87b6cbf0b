"""The package version, in a module of its own so that any tellkit module can read it without
importing the package's ``__init__`` (no import cycle through the top-level package)."""

__version__ = "0.1.0"
