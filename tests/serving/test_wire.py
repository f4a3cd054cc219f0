"""The wire between fronts and the engine host: what a text's job carries, and one write a turn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from service.modeling.tokenizer import ChunkTokenizer
from service.serving.core.work import Ask, CreditSpec, TextJob
from service.serving.remote import wire


def test_a_job_carries_the_token_ids_and_the_asks_only(tiny_backbone_dir: Path) -> None:
    chunker = ChunkTokenizer.load(str(tiny_backbone_dir))
    (enc,) = chunker.encode(["a text long enough to be cut into several chunks of eight tokens " * 3], 8)
    job = TextJob.of(enc, [Ask("tiny", CreditSpec()), Ask("tiny-b")])
    sent = wire.Job(job.encoding.chunks, job.asks)
    got = msgspec.msgpack.Decoder(wire.ToHost).decode(msgspec.msgpack.encode(wire.Run(1, "b", [sent], 9.0)))
    host = got.jobs[0].text_job()
    assert len(enc.chunks) > 1 and host.encoding.chunks == enc.chunks and host.asks == job.asks
    assert host.encoding.n_tokens == enc.n_tokens == len(enc.special)  # what the engine reads of it
    assert host.encoding.offsets == () and host.encoding.word_ids == ()  # the spans and words stay with the front
    assert len(host.states) == len(enc.chunks) and host.left == len(enc.chunks)


class Recorder:
    """A stream writer that records its writes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)


async def test_the_frames_of_one_turn_go_in_one_write() -> None:
    writer = Recorder()
    out = wire.Outbox(writer)
    for k in range(3):
        out.put(wire.Cancel(k))
    assert writer.writes == []  # at the end of the turn
    await asyncio.sleep(0)
    out.put(wire.Cancel(3))
    await asyncio.sleep(0)
    assert writer.writes == [b"".join(wire.frame(wire.Cancel(k)) for k in range(3)), wire.frame(wire.Cancel(3))]
    assert [m.id for m in wire.Frames(wire.TO_HOST).feed(b"".join(writer.writes))] == [0, 1, 2, 3]


def test_messages_are_cut_from_the_bytes_as_they_arrive_in_pieces_of_any_size() -> None:
    sent = [wire.Hello(1), wire.Run(7, "b", [wire.Job(((1, 2, 3),), ())], 9.5), wire.Cancel(7), wire.Applied(2),
            wire.Run(8, "b" * 300, [], 1.0)]
    data = b"".join(wire.frame(m) for m in sent)
    for size in (1, 2, 3, 5, 64, len(data)):
        frames = wire.Frames(wire.TO_HOST)
        got = [m for at in range(0, len(data), size) for m in frames.feed(data[at:at + size])]
        assert got == sent, size
    frames = wire.Frames(wire.TO_HOST)
    assert frames.feed(data[:-1]) == sent[:-1] and frames.feed(data[-1:]) == sent[-1:]  # the last frame once whole
