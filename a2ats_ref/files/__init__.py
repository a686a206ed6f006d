"""File formats read and written by the package: atomic checksummed saves, cache files and GGUF models."""
