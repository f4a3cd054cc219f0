from pathlib import Path

import pytest
import torch

from service.modeling import views
from service.modeling.backbone import Backbone
from service.modeling.classifier import CreditRequest
from service.modeling.repository import load_model

LONG = ("The routing head reads every layer. " * 12 + "It ends here. Final words!").strip()
TEXTS = ["short text", LONG, "a medium sized sentence, with a comma; and more words than the first", "x"]


@pytest.fixture(scope="module")
def classifier(tiny_repo: Path):
    return load_model(tiny_repo / "tiny")[1]


def test_chunking_keeps_special_tokens_in_every_chunk_and_no_padding(tiny_backbone_dir: Path) -> None:
    bb = Backbone(str(tiny_backbone_dir), max_length=16)
    ids = bb.tokenizer(LONG, add_special_tokens=False)["input_ids"]
    enc = bb([LONG, "hi"])
    n_chunks = -(-len(ids) // 14)
    assert n_chunks > 3
    assert enc.lengths[0] == len(ids) + 2 * n_chunks == bb.encode([LONG])[0].n_tokens
    tok = enc.token_ids[0].tolist()
    cls, sep = bb.chunker.prefix[0], bb.chunker.suffix[0]
    assert tok.count(cls) == n_chunks and tok.count(sep) == n_chunks
    assert [t for t, s in zip(tok, enc.special[0].tolist(), strict=True) if not s] == ids
    # real positions only: the short text is padded in the batch, its own length is 3
    assert enc.lengths[1] == 3 and enc.pad[1, 3:].all() and not enc.pad[1, :3].any()
    assert enc.hidden.shape == (2, enc.lengths[0], 3, 32)
    # each chunk equals running that chunk alone through the encoder
    chunk = torch.tensor([tok[16:32]])
    alone = torch.stack(bb.encoder(input_ids=chunk, output_hidden_states=True).hidden_states, dim=-2)[0]
    torch.testing.assert_close(enc.hidden[0, 16:32], alone, atol=1e-5, rtol=1e-5)
    # offsets point into the text
    for pos in range(enc.lengths[0]):
        if not enc.special[0][pos]:
            s, e = enc.offsets[0][pos].tolist()
            piece = bb.tokenizer.convert_ids_to_tokens(tok[pos]).removeprefix("##")
            assert LONG[s:e].lower() == piece


ALL = CreditRequest(targets=(0, 1, 2))
SHARES = CreditRequest(targets=(0, 1, 2), method="shares")


@pytest.mark.parametrize("request_", [ALL, CreditRequest(targets=(2, 0), contrast=False), SHARES])
def test_batch_invariance_of_scores_and_credit(classifier, request_: CreditRequest) -> None:
    batched = classifier.predict(TEXTS, explain=[request_] * len(TEXTS))
    for b, text in enumerate(TEXTS):
        alone = classifier.predict([text], explain=[request_])
        assert (batched.logits[b].softmax(-1) - alone.logits[0].softmax(-1)).abs().max() <= 1e-5
        mine, ref = batched.explained[b], alone.explained[0]
        assert mine.credit.shape == ref.credit.shape == (batched.encoded.lengths[b], 3, len(request_.targets))
        assert (mine.credit - ref.credit).abs().max() <= 1e-5
        if request_.method == "contribution":
            assert (mine.baseline - ref.baseline).abs().max() <= 1e-5


def test_credit_only_for_the_texts_that_ask_with_their_own_targets(classifier) -> None:
    pred = classifier.predict(TEXTS, explain=[None, CreditRequest(), None, CreditRequest(targets=(1, 2, 0))])
    assert pred.explained[0] is None and pred.explained[2] is None
    predicted = int(pred.logits[1].argmax())
    assert pred.explained[1].targets == [predicted] and pred.explained[3].targets == [1, 2, 0]
    for b in (1, 3):
        ex = pred.explained[b]
        assert ex.credit.shape == (pred.encoded.lengths[b], 3, len(ex.targets))
        # completeness: the credit of every position and depth plus the baseline is the contrast logit
        torch.testing.assert_close(ex.credit.sum((0, 1)) + ex.baseline, ex.logit, atol=1e-5, rtol=1e-5)
    scores = pred.logits[3].log_softmax(-1)  # log-softmax: the contrast logits up to a constant per text
    torch.testing.assert_close(pred.explained[3].logit, (scores - scores.mean())[[1, 2, 0]], atol=1e-5, rtol=1e-5)


def test_shares_shapes_unit_variance_and_views(classifier) -> None:
    pred = classifier.predict(TEXTS, explain=[SHARES] * len(TEXTS), return_phi=True)
    n_max = pred.encoded.hidden.shape[1]
    phi1, phi2, phi3 = pred.phi
    assert phi1.shape == (len(TEXTS), n_max * 3, 8) and phi2.shape == (len(TEXTS), 8, 8)
    assert phi3.shape == (len(TEXTS), 8, 3)
    b = 1
    c = pred.explained[b].credit
    assert c.shape == (pred.encoded.lengths[b], 3, 3)
    assert abs(c.std().item() - 1) < 1e-3
    per_token = c.sum(1)[:, 0]  # [n] the first class, summed over depth
    enc = pred.encoded
    offsets, word_ids, special = enc.offsets[b].tolist(), enc.word_ids[b].tolist(), enc.special[b].tolist()
    ws = views.words(TEXTS[b], offsets, word_ids, special)
    assert [w.text for w in ws[:4]] == ["The", "routing", "head", "reads"]
    assert views.words(TEXTS[b], enc.offsets[b], enc.word_ids[b], enc.special[b]) == ws  # tensors work too
    ss = views.sentences(TEXTS[b], offsets, special)
    assert len(ss) == 14 and ss[-1].text == "Final words!"
    non_special = float(per_token[~enc.special[b]].sum())
    assert abs(sum(views.span_credit(per_token.tolist(), ws)) - non_special) < 1e-4
    assert abs(sum(views.span_credit(per_token.tolist(), ss)) - non_special) < 1e-4


def test_shares_are_the_chain_of_the_three_phis(classifier) -> None:
    """phi1 @ phi2 @ phi3 before scaling equals the product of the head's three matrices."""
    pred = classifier.predict(TEXTS[:1], explain=[SHARES], return_phi=True)
    phi1, phi2, phi3 = pred.phi
    raw = phi1[0] @ phi2[0] @ phi3[0]
    scaled = pred.explained[0].credit.reshape(-1, 3)
    ratio = scaled / raw
    torch.testing.assert_close(ratio, torch.full_like(ratio, ratio[0, 0].item()), atol=1e-3, rtol=1e-3)



CHUNKS = [[101] + [2000 + k] * n + [102] for k, n in enumerate([1, 12, 2, 13, 3, 14])]


def record_calls(bb: Backbone) -> list[tuple[int, ...]]:
    """The ``input_ids`` shape of every call of ``bb``'s encoder, from now on."""
    shapes: list[tuple[int, ...]] = []
    bb.encoder.register_forward_hook(lambda m, a, kw, out: shapes.append(tuple(kw["input_ids"].shape)),
                                     with_kwargs=True)
    return shapes


def test_length_groups_change_the_calls_not_the_hidden_states(tiny_backbone_dir: Path) -> None:
    states, calls = {}, {}
    for overhead in (0, 10_000):  # every length alone; all padded together
        bb = Backbone(str(tiny_backbone_dir), max_length=16, call_overhead=overhead)
        bb.stream, bb.packs = None, False  # the Hugging Face module, padded: an encoder neither path knows
        calls[overhead] = record_calls(bb)
        states[overhead] = bb.run_chunks(CHUNKS)
    assert calls[0] == [(1, 3), (1, 4), (1, 5), (1, 14), (1, 15), (1, 16)]
    assert calls[10_000] == [(6, 16)]
    for alone, padded, ids in zip(states[0], states[10_000], CHUNKS, strict=True):
        assert alone.shape == padded.shape == (len(ids), 3, 32)
        torch.testing.assert_close(alone, padded, atol=1e-5, rtol=1e-5)
    assert Backbone(str(tiny_backbone_dir)).call_overhead == 64  # the CPU default


def test_packed_chunks_give_what_each_gives_alone(tiny_backbone_dir: Path) -> None:
    bb = Backbone(str(tiny_backbone_dir), max_length=16)
    assert bb.packs  # a BERT takes position ids and a 4D mask
    bb.stream = None  # the Hugging Face module's packed rows: an encoder the stream does not know
    calls = record_calls(bb)
    packed = bb.run_chunks(CHUNKS)
    rows, L = calls[0]
    assert len(calls) == 1 and L >= 16 and rows * L < 6 * 16  # fewer positions than padding to the longest
    for ids, got in zip(CHUNKS, packed, strict=True):
        (alone,) = bb.run_chunks([ids])
        assert got.shape == alone.shape == (len(ids), 3, 32)
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    assert calls[1:] == [(1, len(ids)) for ids in CHUNKS]  # one chunk alone: one row, no padding


def test_an_encoder_that_cannot_pack_is_run_padded(tiny_backbone_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bb = Backbone(str(tiny_backbone_dir), max_length=16)
    forward = bb.encoder.forward

    def positions_ignored(*args: object, position_ids: object = None, **kwargs: object) -> object:
        return forward(*args, **kwargs)

    def positions_refused(*args: object, position_ids: object = None, **kwargs: object) -> object:
        if position_ids is not None:
            raise TypeError("forward() got an unexpected keyword argument 'position_ids'")
        return forward(*args, **kwargs)

    for fake in (positions_ignored, positions_refused):
        monkeypatch.setattr(bb.encoder, "forward", fake)
        assert not bb._packing_agrees()
    monkeypatch.setattr(bb.encoder, "forward", forward)
    assert bb._packing_agrees()


def test_the_stream_gives_the_hugging_face_modules_hidden_states_without_calling_it(tiny_backbone_dir: Path) -> None:
    bb = Backbone(str(tiny_backbone_dir), max_length=16)
    assert bb.stream is not None  # a BERT: its layers are known, and it agreed at load
    calls = record_calls(bb)
    streamed = bb.run_chunks(CHUNKS)
    assert calls == []  # the Hugging Face module was not called
    bb.stream = None
    for ids, got, ref in zip(CHUNKS, streamed, bb.run_chunks(CHUNKS), strict=True):
        assert got.shape == ref.shape == (len(ids), 3, 32)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [16, 40, 16384])
def test_the_stream_is_batch_invariant_and_cut_within_the_token_budget(tiny_backbone_dir: Path, budget: int) -> None:
    """Each chunk's states do not depend on its neighbours, their lengths, or how the stream was cut into calls (a
    chunk longer than the budget goes alone)."""
    import numpy as np

    from service.modeling import encoder

    bb = Backbone(str(tiny_backbone_dir), max_length=16, chunk_batch_tokens=budget)
    sizes: list[int] = []
    real = bb.stream.forward
    bb.stream.forward = lambda p, out=None: (sizes.append(len(p.ids)), real(p, out))[1]
    lengths = np.array([len(c) for c in CHUNKS])
    flat = bb.run_stream(np.concatenate(CHUNKS), lengths)  # [T e d]
    assert flat.shape == (lengths.sum(), 3, 32) and sum(sizes) == lengths.sum()
    assert all(n <= budget or n in lengths for n in sizes)  # within the budget, or one chunk longer than it
    assert (len(sizes) == 1) == (budget >= lengths.sum())
    for ids, got in zip(CHUNKS, flat.split(lengths.tolist()), strict=True):
        alone = bb.stream(encoder.pack(np.array(ids), np.array([len(ids)]), bb.device))  # [L e d]
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    # rows shared by chunks of different lengths (the CPU's layout) and one chunk a row (the GPU's) agree
    shared = bb.stream(encoder.pack(np.concatenate(CHUNKS), lengths, bb.device, [[0, 2, 4], [1], [3], [5]], 16))
    one_a_row = bb.stream(encoder.pack(np.concatenate(CHUNKS), lengths, bb.device))
    torch.testing.assert_close(shared, one_a_row, atol=1e-5, rtol=1e-5)
    # written to rows of another layout as computed: each token's states in its row, the same values
    dest = np.random.default_rng(0).permutation(int(lengths.sum()) + 5)[: lengths.sum()]  # [T] rows of 5 more
    rows = bb.run_stream(np.concatenate(CHUNKS), lengths, dest, int(lengths.sum()) + 5)  # [T+5 e d]
    assert rows.shape == (lengths.sum() + 5, 3, 32)
    torch.testing.assert_close(rows[torch.from_numpy(dest)], flat, atol=0, rtol=0)


def test_an_encoder_the_stream_does_not_know_keeps_the_hugging_face_module(tiny_backbone_dir: Path) -> None:
    from service.modeling.encoder import PackedEncoder

    bb = Backbone(str(tiny_backbone_dir), max_length=16)
    bb.encoder.config.position_embedding_type = "relative_key"  # relative positions: layers it does not know
    assert PackedEncoder.of(bb.encoder) is None
    bb.encoder.config.position_embedding_type = "absolute"
    assert PackedEncoder.of(bb.encoder) is not None
