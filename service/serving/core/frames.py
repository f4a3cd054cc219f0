"""Messages in length-prefixed frames, read from a stream's bytes as they arrive (a protocol's ``data_received``):
the fronts' messages to and from the engine host (:mod:`service.serving.remote.wire`) and the pipe to a backbone's
process (:mod:`service.serving.engine.process`) are read alike, with no coroutine a message."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Generic, TypeVar

M = TypeVar("M")


class Frames(Generic[M]):
    """Each frame's body, decoded by ``decode``, behind its size packed by ``size``; with ``long``, a size of -1 says
    that the size follows packed by ``long`` (as :class:`multiprocessing.connection.Connection` writes a frame of 2
    GiB or more)."""

    def __init__(self, decode: Callable[[memoryview], M], size: struct.Struct, long: struct.Struct | None = None
                 ) -> None:
        self.decode, self.size, self.long = decode, size, long
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[M]:
        """Every message whose frame is whole now, in order (what is left of a frame waits for the next bytes)."""
        buffer = self._buffer
        buffer += data
        messages, start, end = [], 0, len(buffer)
        size, long = self.size, self.long
        with memoryview(buffer) as view:
            while end - start >= size.size:
                (n,) = size.unpack_from(view, start)
                head = size.size
                if long is not None and n == -1:
                    if end - start < head + long.size:
                        break
                    (n,) = long.unpack_from(view, start + head)
                    head += long.size
                if end - start - head < n:
                    break
                start += head
                messages.append(self.decode(view[start:start + n]))
                start += n
        del buffer[:start]
        return messages
