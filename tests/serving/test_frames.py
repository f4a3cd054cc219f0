"""Length-prefixed frames read as their bytes arrive, as the pipe to a backbone's process reads them: a frame split
over several reads, several in one, and the long form multiprocessing's Connection writes (-1, then 8 bytes)."""

from __future__ import annotations

import pickle
import struct

from service.serving.core.frames import Frames

SIZE, LONG = struct.Struct("!i"), struct.Struct("!Q")


def test_frames_split_joined_and_long_are_read_in_order() -> None:
    short = pickle.dumps({"a": 1})
    long = pickle.dumps(list(range(50)))
    stream = (SIZE.pack(len(short)) + short + SIZE.pack(-1) + LONG.pack(len(long)) + long
              + SIZE.pack(len(short)) + short)
    frames = Frames(pickle.loads, SIZE, LONG)
    got = []
    for k in range(0, len(stream), 3):  # three bytes a read: every frame split, the long size too
        got += frames.feed(stream[k:k + 3])
    assert got == [{"a": 1}, list(range(50)), {"a": 1}]
    assert Frames(pickle.loads, SIZE, LONG).feed(stream) == got  # and all in one read
