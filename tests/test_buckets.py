"""Bucket and crop geometry: pure functions."""

import pytest

from difftune.data.buckets import SizeRule, bucket_for, cover_resize, crop_box, downsample_first, too_small


def rule(**kw):
    base = dict(resolution=1024, resolution_type="pixel_area", crop=False, crop_aspect="square", multiple=16)
    base.update(kw)
    return SizeRule(**base)


@pytest.mark.parametrize("w,h", [(1024, 1024), (3000, 2000), (800, 1600), (517, 333), (4000, 64)])
def test_pixel_area_keeps_area_and_aspect(w, h):
    bw, bh = bucket_for(w, h, rule())
    assert bw % 16 == 0 and bh % 16 == 0
    if max(w, h) / min(w, h) < 10:
        assert abs(bw * bh - 1024 * 1024) / (1024 * 1024) < 0.1
        assert abs(bw / bh - w / h) / (w / h) < 0.1


def test_pixel_short_edge():
    assert bucket_for(3000, 2000, rule(resolution=512, resolution_type="pixel")) == (768, 512)
    assert bucket_for(2000, 3000, rule(resolution=512, resolution_type="pixel")) == (512, 768)


def test_square_crop():
    assert bucket_for(3000, 2000, rule(crop=True, crop_aspect="square")) == (1024, 1024)
    assert bucket_for(3000, 2000, rule(crop=True, crop_aspect="preserve")) != (1024, 1024)


def test_cover_and_crop_fit_the_bucket():
    for w, h, bucket in [(3000, 2000, (1248, 832)), (333, 517, (256, 400)), (64, 64, (64, 64))]:
        cw, ch = cover_resize(w, h, bucket)
        assert cw >= bucket[0] and ch >= bucket[1]
        left, top, right, bottom = crop_box(cw, ch, bucket, "center")
        assert (right - left, bottom - top) == bucket
        left, top, right, bottom = crop_box(cw, ch, bucket, "random", 1.0, 0.0)
        assert right <= cw and top == 0


def test_size_limits():
    r = rule(minimum_image_size=512, maximum_image_size=2048, target_downsample_size=1024)
    assert too_small(300, 300, r) and not too_small(600, 600, r)
    assert downsample_first(1000, 1000, r) is None
    assert downsample_first(4096, 4096, r) == (1024, 1024)
