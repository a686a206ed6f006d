"""Adapters shipped with the suite: the MLX reference (default IUT) and the float64 oracle."""
