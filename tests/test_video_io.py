"""Video I/O on tiny generated clips: probing, frame-hold resampling (constant and variable rate), rotation,
bad files, MP4 writing and contact sheets."""

from __future__ import annotations

import bisect
import struct
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from difftune.data import video
from difftune.data.video import (
    BadVideo,
    audio_only_file,
    contact_sheet,
    decode_frames,
    probe_video,
    synthetic_clip,
    write_mp4,
)

# 27 flat colours at least 128 apart in some channel: lossy coding moves a flat frame by a few units, so
# the nearest palette entry names the frame unambiguously.
PALETTE = [(r, g, b) for r in (0, 128, 255) for g in (0, 128, 255) for b in (0, 128, 255)]


def _encodes(name: str) -> bool:
    try:
        av.Codec(name, "w")
        return True
    except Exception:  # noqa: BLE001 - unknown codec
        return False


VPX = _encodes("libvpx-vp9") or _encodes("libvpx")
SUFFIXES = [".mp4", ".mkv", pytest.param(".webm", marks=pytest.mark.skipif(not VPX, reason="no VP8/VP9 encoder"))]


def _identify(img: Image.Image) -> int:
    mean = np.asarray(img, dtype=np.float64).reshape(-1, 3).mean(axis=0)
    return int(np.argmin([np.abs(mean - colour).sum() for colour in PALETTE]))


def _flat_clip(path: Path, colours: list[int], stamps: list[int], time_base: Fraction) -> Path:
    """Flat-colour frames at exact timestamps, written with PyAV directly (independent of the module)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24, options={"crf": "8"})
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        stream.codec_context.time_base = time_base
        for colour, stamp in zip(colours, stamps, strict=True):
            frame = av.VideoFrame.from_ndarray(np.full((24, 32, 3), PALETTE[colour], np.uint8), format="rgb24")
            frame.pts, frame.time_base = stamp, time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def nearest(seconds: list[float], t: float) -> set[int]:
    """The frames decode_frames may pick for time t: the one stamped nearest it; both of two equally near (the
    timestamps' rounding in the container decides which is nearer)."""
    i = max(bisect.bisect_right(seconds, t + 1e-9) - 1, 0)
    if i + 1 >= len(seconds):
        return {i}
    before, after = t - seconds[i], seconds[i + 1] - t
    return {i, i + 1} if abs(before - after) < 2e-3 else {i + 1} if after < before else {i}


def picked(frames: list[Image.Image], expected: list[set[int]]) -> bool:
    return len(frames) == len(expected) and all(_identify(f) in e for f, e in zip(frames, expected, strict=True))


def _diff(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_probe_synthetic_clip(tmp_path, suffix):
    path = synthetic_clip(tmp_path / f"clip{suffix}", width=32, height=24, frames=17, fps=24)
    info = probe_video(path)
    assert (info.width, info.height, info.frames, info.rotation) == (32, 24, 17, 0)
    assert info.span == pytest.approx(16 / 24, abs=1e-3)  # Matroska rounds stamps to 1 ms
    assert info.fps == pytest.approx(24, rel=2e-3)
    assert info.variable_rate is False
    frames = decode_frames(path, [k / 24 for k in range(17)])
    assert [f.size for f in frames] == [(32, 24)] * 17
    # The decoded pictures are the generated ones (4:2:0 colour on a steep gradient costs ~5 levels), in
    # order: the square crosses the picture, so the first, middle and last frames are told apart.
    expected = [Image.fromarray(a) for a in video._shapes(32, 24, 17, 0)]
    assert max(_diff(f, e) for f, e in zip(frames, expected, strict=True)) < 8
    for k in (0, 8, 16):
        assert min((0, 8, 16), key=lambda j, k=k: _diff(frames[k], expected[j])) == k


@pytest.mark.parametrize(("suffix", "rotation"), [(".mp4", 90), (".mp4", 270), (".mp4", 180), (".mkv", 90)])
def test_rotation_is_applied(tmp_path, suffix, rotation):
    plain = synthetic_clip(tmp_path / f"plain{suffix}", seed=3)
    turned = synthetic_clip(tmp_path / f"turned{suffix}", seed=3, rotation=rotation)
    info = probe_video(turned)
    assert info.rotation == rotation
    assert (info.width, info.height) == ((24, 32) if rotation in (90, 270) else (32, 24))
    times = [0.0, 8 / 24, 16 / 24]
    upright = decode_frames(turned, times)
    assert all(f.size == (info.width, info.height) for f in upright)
    # rotation = degrees counter-clockwise, like PIL's ROTATE_*; the opposite turn must not match
    # (the background is an x/y gradient, so it is not symmetric under any turn).
    turn = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}
    for got, reference in zip(upright, decode_frames(plain, times), strict=True):
        assert _diff(got, reference.transpose(turn[rotation])) < 6
        assert _diff(got, reference.transpose(turn[360 - rotation])) > 30 or rotation == 180


def test_rotation_sign_matches_phone_portrait_matrix(tmp_path):
    """Independent check of the sign against the QuickTime spec: a phone's portrait video carries the
    track matrix (a, b, c, d) = (0, 1, -1, 0), i.e. turn 90 degrees clockwise = 270 in this module."""
    data = synthetic_clip(tmp_path / "portrait.mp4", rotation=270).read_bytes()
    at = data.index(b"tkhd") + 4 + 40  # version/flags, 5 x 32-bit fields, 8 + 8 reserved/layer bytes
    a, b, _, c, d = struct.unpack(">5i", data[at : at + 20])
    assert (a, b, c, d) == (0, 1 << 16, -(1 << 16), 0)


@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
def test_variable_rate_probe(tmp_path, suffix):
    info = probe_video(synthetic_clip(tmp_path / f"vfr{suffix}", frames=17, fps=24, variable_rate=True))
    assert info.variable_rate is True
    assert info.frames == 17
    assert info.span == pytest.approx(1.0, abs=2e-3)  # 8 gaps of 1/24 s and 8 of 2/24 s
    assert info.fps == pytest.approx(16, rel=2e-3)


@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
def test_variable_rate_frame_hold(tmp_path, suffix):
    gaps = [5, 10, 3, 7, 5, 15, 5, 10, 2, 8, 5]  # in 1/120 s: 1/24, 1/12, 1/40, ...
    stamps = [0, *np.cumsum(gaps).tolist()]
    path = _flat_clip(tmp_path / f"vfr{suffix}", list(range(len(stamps))), stamps, Fraction(1, 120))
    info = probe_video(path)
    assert info.variable_rate is True and info.frames == len(stamps)
    assert info.span == pytest.approx(stamps[-1] / 120, abs=1e-3)
    seconds = [s / 120 for s in stamps]
    times = [k / 24 for k in range(int(seconds[-1] * 24) + 1)]  # several land exactly on a frame
    assert picked(decode_frames(path, times), [nearest(seconds, t) for t in times])


@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
def test_resample_30_to_24(tmp_path, suffix):
    colours = list(range(24))
    path = tmp_path / f"thirty{suffix}"
    if suffix == ".mp4":
        write_mp4([Image.new("RGB", (32, 24), PALETTE[c]) for c in colours], path, fps=30)
    else:
        _flat_clip(path, colours, list(range(24)), Fraction(1, 30))
    info = probe_video(path)
    assert info.fps == pytest.approx(30, rel=2e-3) and info.variable_rate is False
    frames = decode_frames(path, [k / 24 for k in range(19)])
    assert picked(frames, [nearest([i / 30 for i in range(24)], k / 24) for k in range(19)])


def _avi(path: Path, colours: list[int], fps: int) -> Path:
    """An AVI: its time base is the frame length itself (1/fps), the coarsest stamps a container has."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for i, colour in enumerate(colours):
            frame = av.VideoFrame.from_ndarray(np.full((24, 32, 3), PALETTE[colour], np.uint8), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def test_an_avi_at_its_own_rate_gets_each_frame_once(tmp_path):
    """With the time base as long as a frame, a time on a frame counted as a tie with the frame before: frame 0
    came twice and the last frame was lost."""
    path = _avi(tmp_path / "own.avi", list(range(6)), 24)
    assert [_identify(f) for f in decode_frames(path, [k / 24 for k in range(6)])] == list(range(6))


@pytest.mark.parametrize("suffix", [".mp4", ".mkv", ".avi"])
def test_twice_the_rate_holds_every_frame_twice(tmp_path, suffix):
    """12 fps clips at 24 fps: every other time falls exactly between two frames, and the earlier one is taken. The
    container's rounding (Matroska: 1 ms) or float error decided before, so frames were shown 1, 2 or 3 times
    (jerky motion in every 2x upsampled clip); and the clip counted 23 frames, not the 24 it plays for."""
    from difftune.data.frames import resampled_count

    colours = list(range(12))
    path = tmp_path / f"twelve{suffix}"
    if suffix == ".mp4":
        write_mp4([Image.new("RGB", (32, 24), PALETTE[c]) for c in colours], path, fps=12)
    elif suffix == ".avi":
        _avi(path, colours, 12)
    else:
        _flat_clip(path, colours, [round(i * 1000 / 12) for i in colours], Fraction(1, 1000))
    info = probe_video(path)
    count = resampled_count(info.frames, info.span, info.fps, 24.0, info.variable_rate)
    assert count == 24
    frames = decode_frames(path, [k / 24 for k in range(count)])
    assert [_identify(f) for f in frames] == [k // 2 for k in range(24)]


def test_decoding_past_the_end_is_reported(tmp_path):
    path = synthetic_clip(tmp_path / "short.mkv", frames=17, fps=24)
    assert len(decode_frames(path, [16 / 24, 16.9 / 24])) == 2  # the last frame lasts 1/24 s
    with pytest.raises(BadVideo, match=r"decoded only 17 frames \(0\.71 s\), needs 1\.00 s"):
        decode_frames(path, [0.0, 0.5, 1.0])


def test_empty_and_garbage_files(tmp_path):
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(BadVideo, match="empty file"):
        probe_video(empty)
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    with pytest.raises(BadVideo, match="not a readable video container"):
        probe_video(garbage)
    with pytest.raises(BadVideo, match="not a readable video container"):
        decode_frames(garbage, [0.0])


@pytest.mark.parametrize("kind", ["synthetic.mp4", "write_mp4.mp4", "synthetic.mkv", "synthetic.webm"])
def test_truncated_clip_raises_bad_video(tmp_path, kind):
    if kind.endswith(".webm") and not VPX:
        pytest.skip("no VP8/VP9 encoder")
    full = tmp_path / f"full-{kind}"
    if kind.startswith("write_mp4"):
        noise = np.random.default_rng(0).integers(0, 256, (40, 24, 32, 3), dtype=np.uint8)
        write_mp4([Image.fromarray(a) for a in noise], full, fps=24)
    else:
        synthetic_clip(full, frames=40, fps=24)
    cut = tmp_path / f"cut-{kind}"
    cut.write_bytes(full.read_bytes()[: int(full.stat().st_size * 0.4)])
    with pytest.raises(BadVideo) as caught:
        probe_video(cut)
        decode_frames(cut, [k / 24 for k in range(40)])
    reason = str(caught.value)
    assert reason and "Errno" not in reason


@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
def test_audio_only_file(tmp_path, suffix):
    path = audio_only_file(tmp_path / f"sound{suffix}")
    with pytest.raises(BadVideo, match=r"no video stream \(audio only\)"):
        probe_video(path)


def test_clip_with_audio_reads_as_video(tmp_path):
    info = probe_video(synthetic_clip(tmp_path / "talk.mp4", audio=True))
    assert (info.width, info.height, info.frames) == (32, 24, 17)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_odd_size(tmp_path, suffix):
    path = synthetic_clip(tmp_path / f"odd{suffix}", width=33, height=25, frames=9)
    info = probe_video(path)
    assert (info.width, info.height, info.frames) == (33, 25, 9)
    assert [f.size for f in decode_frames(path, [k / 24 for k in range(9)])] == [(33, 25)] * 9


def test_write_mp4_round_trip(tmp_path):
    frames = []
    for c in range(10):
        array = np.full((25, 33, 3), PALETTE[c + 1], np.uint8)
        array[:, -1] = (255, 0, 0)  # a red right edge: padding must repeat it, not add black
        frames.append(Image.fromarray(array))
    path = tmp_path / "out.mp4"
    write_mp4(frames, path, fps=30000 / 1001)
    assert [p.name for p in tmp_path.iterdir()] == ["out.mp4"]  # no temporary file left behind
    info = probe_video(path)
    assert (info.width, info.height, info.frames) == (34, 26, 10)
    assert info.fps == pytest.approx(30000 / 1001, rel=1e-3)
    decoded = decode_frames(path, [k * 1001 / 30000 for k in range(10)])
    assert [_identify(f.crop((0, 0, 30, 25))) for f in decoded] == [c + 1 for c in range(10)]
    edge = np.asarray(decoded[0], dtype=np.float64)[:, 32:34].reshape(-1, 3).mean(axis=0)
    assert np.abs(edge - (255, 0, 0)).max() < 40


def test_write_mp4_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "out.mp4"
    write_mp4([Image.new("RGB", (32, 24), PALETTE[5])] * 3, path, fps=24)
    before = path.read_bytes()

    encode = video._encode
    seen = []

    def killed(container, stream, arrays, stamps=None):  # every packet muxed, then killed before the trailer
        encode(container, stream, arrays, stamps)
        seen.extend(p.name for p in tmp_path.iterdir())
        raise KeyboardInterrupt

    monkeypatch.setattr(video, "_encode", killed)
    with pytest.raises(KeyboardInterrupt):
        write_mp4([Image.new("RGB", (32, 24), PALETTE[9])] * 3, path, fps=24)
    assert len(seen) == 2  # the half-written file existed, under another name
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.mp4"]


def test_contact_sheet(tmp_path):
    frames = [Image.new("RGB", (32, 24), PALETTE[c + 1]) for c in range(10)]  # none black like the gaps
    sheet = contact_sheet(frames, columns=4, max_frames=8)
    assert sheet.size == (4 * 32 + 3 * 2, 2 * 24 + 2)
    cells = [sheet.crop((x, y, x + 32, y + 24)) for y in (0, 26) for x in (0, 34, 68, 102)]
    assert [_identify(c) for c in cells] == [1, 2, 4, 5, 6, 7, 9, 10]  # evenly spread, first and last
    assert sheet.getpixel((32, 0)) == (0, 0, 0) and sheet.getpixel((0, 24)) == (0, 0, 0)  # the gaps
    few = contact_sheet(frames[:3], columns=4)
    assert few.size == (3 * 32 + 2 * 2, 24)
    assert [_identify(few.crop((x, 0, x + 32, 24))) for x in (0, 34, 68)] == [1, 2, 3]


@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
@pytest.mark.parametrize("rate,target", [(Fraction(24000, 1001), 24), (Fraction(30000, 1001), 30)])
def test_ntsc_rates_keep_every_frame_in_order(tmp_path, suffix, rate, target):
    """23.976 and 29.97 fps footage (most real clips) trained at 24 or 30: taken at its own rate, frame k is the
    clip's frame k. Frame hold at 1/24 s repeated frame 2 of an MP4, and a Matroska file's 1 ms rounding repeated
    and dropped frames all along."""
    from conftest import write_config
    from difftune.config import load_config
    from difftune.data.latents import sample_pixels
    from difftune.train.plan import discover_all

    folder = tmp_path / "clips"
    folder.mkdir()
    with av.open(str(folder / f"ntsc{suffix}"), "w") as container:
        stream = container.add_stream("libx264", rate=rate, options={"crf": "0"})
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv444p"
        for i in range(25):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 8, np.uint8), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    (folder / "ntsc.txt").write_text("grey levels")
    cfg = load_config(write_config(tmp_path, folder, model_family="kandinsky5-video", dataset={
        "dataset_type": "video", "resolution": 32, "resolution_type": "pixel",
        "video": {"num_frames": 21, "frame_rate": target}}))
    (found,) = discover_all(cfg, write_metadata=False, fetch=False)
    (sample,) = found.samples
    assert sample.fps == pytest.approx(float(rate), rel=1e-3) and sample.frames == 21
    pixels = sample_pixels(sample, "center", (0.5, 0.5))  # [3, F, H, W] in [-1, 1]
    levels = ((pixels[0].mean(dim=(1, 2)) + 1) * 127.5 / 8).round().int().tolist()
    assert levels == list(range(21))
    assert not any("resampled" in note for _, note in found.notes)


def test_an_animated_gif_is_a_clip_in_a_video_dataset(tmp_path):
    """A video dataset reported an animated GIF as "not read; images go in an image dataset" (where it trains as a
    still): it is a clip there, its frames in order."""
    from conftest import write_config
    from difftune.config import load_config
    from difftune.data.latents import sample_pixels
    from difftune.train.plan import discover_all

    folder = tmp_path / "clips"
    folder.mkdir()
    frames = [Image.new("RGB", (32, 32), (i * 8,) * 3) for i in range(12)]
    frames[0].save(folder / "loop.gif", save_all=True, append_images=frames[1:], duration=40, loop=0)
    (folder / "loop.txt").write_text("grey levels")
    cfg = load_config(write_config(tmp_path, folder, model_family="kandinsky5-video", dataset={
        "dataset_type": "video", "resolution": 32, "resolution_type": "pixel",
        "video": {"num_frames": 9, "frame_rate": 25}}))
    (found,) = discover_all(cfg, write_metadata=False, fetch=False)
    (sample,) = found.samples
    pixels = sample_pixels(sample, "center", (0.5, 0.5))
    assert ((pixels[0].mean(dim=(1, 2)) + 1) * 127.5 / 8).round().int().tolist() == list(range(9))


@pytest.mark.parametrize("delay", [0, 10])
def test_a_gif_of_the_fastest_delays_plays_as_browsers_play_it(tmp_path, delay):
    """A GIF frame delay of 10 ms or less is shown for 100 ms by browsers: such a GIF was read as 100 fps (10 ms) and
    trained ten times faster than it looks. Both delays are 10 fps here, probe and decode alike; 20 ms stays 50 fps."""
    from difftune.data.frames import FrameRule, plan_clip, resampled_count

    frames = [Image.new("RGB", (32, 24), PALETTE[i]) for i in range(10)]
    path = tmp_path / f"fast{delay}.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=delay, loop=0)
    info = probe_video(path)
    assert info.fps == pytest.approx(10) and info.span == pytest.approx(0.9)
    count = resampled_count(info.frames, info.span, info.fps, 20.0, info.variable_rate)
    assert count == 20
    assert [_identify(f) for f in decode_frames(path, [k / 20 for k in range(count)])] == [k // 2 for k in range(20)]
    frames[0].save(slow := tmp_path / "slow.gif", save_all=True, append_images=frames[1:], duration=20, loop=0)
    assert probe_video(slow).fps == pytest.approx(50)
    frames[0].save(still := tmp_path / "still.gif")  # one frame: no rate, no "resampled from 0 fps" note
    one = probe_video(still)
    assert plan_clip(one.frames, one.fps, FrameRule(1, 24.0)).note is None

