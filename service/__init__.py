"""routing-service: serving routing classification heads (Heinsen 2022) with end-to-end credit."""

__version__ = "0.1.0"
