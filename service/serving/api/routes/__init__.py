"""Thin HTTP handlers: validate the envelope, call the pipeline (:mod:`service.serving.pipeline.inference`), map its
answers and errors into the protocol's shape."""
