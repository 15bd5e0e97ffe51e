"""Speculative-decoding build-and-serve pipeline."""

__version__ = "0.1.0"
