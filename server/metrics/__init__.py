"""Prometheus metrics: definitions (``definitions``) and the multiprocess registry (``registry``)."""
