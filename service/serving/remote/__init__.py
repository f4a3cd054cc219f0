"""A front's side of the engine host (``ROUTING_WORKERS`` > 1): the remote engine client, each backbone group as a
front reaches it, the link (a Unix socket) and the wire's typed messages. The host itself is a process entry
(:mod:`service.serving.host`) serving through the local engine client."""
