"""The addresses a server listens on: checked before the models load, and shared by several fronts."""

from __future__ import annotations

import errno
import logging
import socket
import sys

from service.config import Settings

log = logging.getLogger("service.http")
CANNOT_LISTEN = 3  # exit code when the address cannot be bound (uvicorn's own for a failed start)


def check_address(host: str, port: int) -> None:
    """Bind every address ``host:port`` resolves to, as uvicorn binds them (address reuse on; IPv6 only on IPv6
    sockets), and let them go: a port in use, or a host that is not this machine's, fails at once with a message
    that says what to change, instead of after the models have loaded. (uvicorn binds them again when it starts.)

    Raises:
        OSError: an address cannot be bound, or the host cannot be resolved (its ``strerror`` says why).
    """
    for family, kind, proto, _, address in set(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE)):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)


def check_ports(settings: Settings) -> None:
    """Exit with :data:`CANNOT_LISTEN` and a message that says what to change when the HTTP or the gRPC address
    cannot be listened on (before the models load)."""
    try:
        check_address(settings.host, settings.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s (%sROUTING_PORT or --port sets the port, ROUTING_HOST or --host the "
                  "address)", settings.host, settings.port, e.strerror or e,
                  "another server listens there; " if e.errno == errno.EADDRINUSE else "")
        sys.exit(CANNOT_LISTEN)
    if settings.grpc_port:
        try:
            check_address(settings.host, settings.grpc_port)
        except OSError as e:
            log.error("cannot listen for gRPC on %s:%d: %s (%sROUTING_GRPC_PORT sets the port, 0 turns gRPC off)",
                      settings.host, settings.grpc_port, e.strerror or e,
                      "another server listens there; " if e.errno == errno.EADDRINUSE else "")
            sys.exit(CANNOT_LISTEN)


def shared_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` that several fronts accept from (made by the supervisor, inherited by each
    front): one queue of connections, so a front that dies takes none of the others' with it, and a front started
    again accepts only once it serves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
