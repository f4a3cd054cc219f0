"""Shape buckets: which bucket a batch takes, the filler that pads it, and that padding leaves every real token's
hidden states as they are."""

import numpy as np
import pytest
import torch

from service.modeling.backbone import Backbone
from service.modeling.buckets import (
    QUANTILES,
    Bucket,
    batches,
    choose_buckets,
    draw_lengths,
    length_sample,
    own_bucket,
    pad_batch,
    padding,
    smallest_fit,
)
from service.modeling.encoder import pack, pack_host, packing_of


def test_a_batch_fits_a_bucket_when_its_spare_tokens_fill_its_spare_rows() -> None:
    assert not Bucket(64, 4, 16).fits(40, 3, 16)  # 24 spare tokens, one spare row of 16
    assert Bucket(64, 5, 16).fits(40, 3, 16) and list(Bucket(64, 5, 16).filler(40, 3)) == [12, 12]
    assert not Bucket(64, 4, 16).fits(40, 3, 17)  # too long a sequence
    assert not Bucket(64, 4, 16).fits(65, 3, 16) and not Bucket(64, 4, 16).fits(40, 5, 16)
    assert Bucket(64, 4, 16).fits(60, 2, 16) and list(Bucket(64, 4, 16).filler(60, 2)) == [2, 2]
    assert Bucket(64, 4, 16).fits(64, 4, 16) and len(Bucket(64, 4, 16).filler(64, 4)) == 0
    assert list(Bucket(64, 6, 16).filler(63, 3)) == [1, 0, 0]  # empty fillers where tokens are short


@pytest.mark.parametrize("shape", [(1, 1, 1), (17, 1, 17), (300, 9, 60), (16000, 456, 70), (16384, 512, 128)])
def test_own_bucket_fits_the_batch_and_pads_at_most_a_rung(shape: tuple[int, int, int]) -> None:
    n_tokens, n_seqs, longest = shape
    b = own_bucket(n_tokens, n_seqs, longest, 512)
    assert b.fits(n_tokens, n_seqs, longest)
    assert b.tokens <= max(16, 1.2 * n_tokens + 16) and b.width < 2 * max(longest, 16)
    filler = b.filler(n_tokens, n_seqs)
    assert filler.sum() == b.tokens - n_tokens and (filler <= b.width).all() and len(filler) == b.rows - n_seqs


def test_the_smallest_fitting_bucket_is_chosen_and_none_outside_the_buckets() -> None:
    buckets = [Bucket(64, 4, 32), Bucket(128, 8, 32), Bucket(128, 4, 64)]
    assert smallest_fit(buckets, 50, 3, 20) == Bucket(64, 4, 32)
    assert smallest_fit(buckets, 100, 3, 40) == Bucket(128, 4, 64)
    assert smallest_fit(buckets, 100, 6, 20) == Bucket(128, 8, 32)
    assert smallest_fit(buckets, 200, 3, 20) is None and smallest_fit(buckets, 10, 1, 65) is None


def test_buckets_chosen_for_tweet_like_lengths_pad_little() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.normal(33, 12, 2000), 5, 90).astype(int).tolist()  # like the tweets: median 33, p95 54
    for budget, max_texts in [(16384, 1024), (8192, 32)]:
        buckets = choose_buckets(lengths, budget, max_texts, 512, count=24)
        assert len(buckets) <= 24
        cost = padding(buckets, batches(lengths, budget, max_texts, seed=1))  # other batches than chosen on
        assert cost["eager_share"] <= 0.02 and cost["padded_share"] <= 0.15, cost
        # fewer buckets pad more: the list's length is the trade
        assert padding(buckets[::4], batches(lengths, budget, max_texts, seed=1))["padded_share"] >= \
            cost["padded_share"]


def test_pad_batch_appends_filler_sequences_and_refuses_what_does_not_fit() -> None:
    ids, lengths = np.arange(1, 8), np.array([3, 4])
    padded, padded_lengths = pad_batch(ids, lengths, Bucket(16, 4, 8), pad_id=0)
    assert list(padded) == [1, 2, 3, 4, 5, 6, 7] + [0] * 9 and list(padded_lengths) == [3, 4, 5, 4]
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch(ids, lengths, Bucket(16, 3, 8), pad_id=0)


def test_padding_to_a_bucket_leaves_real_tokens_states_unchanged(tiny_backbone_dir: object) -> None:
    bb = Backbone(str(tiny_backbone_dir), max_length=32)
    assert bb.stream is not None
    lengths = np.array([5, 12, 3, 9])
    ids = np.concatenate([[101, *(2000 + k + np.arange(n - 2)), 102] for k, n in enumerate(lengths)])
    bucket = Bucket(tokens=48, rows=7, width=16)
    padded, padded_lengths = pad_batch(ids, lengths, bucket, pad_id=0)
    host, rows, width = pack_host(padded, padded_lengths, None, bucket.width)
    assert (rows, width) == (7, 16)  # the bucket's shape whatever the batch
    with torch.inference_mode():
        alone = bb.stream(pack(ids, lengths, bb.device))  # [T e d]
        in_bucket = bb.stream(packing_of(torch.from_numpy(host), bucket.tokens, rows, width))  # [tokens e d]
    assert in_bucket.shape[0] == 48
    torch.testing.assert_close(in_bucket[: len(ids)], alone, rtol=1e-5, atol=1e-5)


def test_a_length_sample_kept_with_a_model_draws_like_the_lengths_it_came_from() -> None:
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(3.4, 0.4, 20000), 3, 256).astype(int)  # a long right tail, like tweets
    kept = length_sample(lengths.tolist())
    assert len(kept) == len(QUANTILES) and kept[0] == lengths.min() and kept[-1] == lengths.max()
    drawn = np.array(draw_lengths(kept, 20000, seed=2))
    for q in (0.1, 0.5, 0.9, 0.99):  # the drawn quantiles are the lengths' own, within a token or two
        assert abs(np.quantile(drawn, q) - np.quantile(lengths, q)) <= 2 + 0.03 * np.quantile(lengths, q)
    with pytest.raises(ValueError, match="quantiles"):
        draw_lengths(kept[:-1])
