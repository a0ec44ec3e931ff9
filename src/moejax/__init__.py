"""moejax: an open training system for large Mixture-of-Experts language models on JAX."""

__version__ = "0.1.0"
