"""specserve: distributed, lossless speculative decoding."""

__version__ = "0.1.0"
