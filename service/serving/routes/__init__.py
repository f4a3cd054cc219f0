"""Thin HTTP handlers: validate, hand work to the batcher, map results and errors."""
