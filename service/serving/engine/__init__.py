"""Backbone groups and what computes them: the batcher (no torch, no HTTP), the planner (texts into chunks, no torch),
the engine (torch: the encoder and the heads of a batch), a backbone's own process and replicas, and the one interface
the pipeline submits to (:class:`~service.serving.engine.group.BackboneGroup`). Nothing here knows HTTP, the
registry or the fronts. Importing this package imports no torch: only :mod:`~service.serving.engine.engine` does."""
