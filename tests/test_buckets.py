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


def test_fit_resizes_only_the_cropped_region_with_the_same_pixels():
    """fit resized the whole image to cover the bucket, then cropped: a 20000x20 strip bound for a 1024 bucket was a
    5 GB intermediate image. It resizes the crop's source region now, which PIL's filter reads with its surroundings:
    the pixels are those of resize-then-crop, bit for bit."""
    import numpy as np
    from PIL import Image

    from difftune.data.buckets import cover_resize, crop_box
    from difftune.data.images import fit

    rng = np.random.default_rng(0)
    for (w, h), bucket, style, uv in [((300, 200), (64, 64), "center", (0.5, 0.5)),
                                      ((97, 61), (48, 80), "random", (0.2, 0.9)),
                                      ((2000, 20), (64, 64), "random", (0.3, 0.5)),
                                      ((64, 48), (64, 48), "center", (0.5, 0.5))]:
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        size = cover_resize(w, h, bucket)
        whole = img.resize(size, Image.Resampling.LANCZOS) if size != img.size else img
        expected = whole.crop(crop_box(size[0], size[1], bucket, style, *uv))
        got = fit(img, bucket, style, uv)
        assert got.size == bucket and np.array_equal(np.asarray(got), np.asarray(expected)), (w, h, bucket)
