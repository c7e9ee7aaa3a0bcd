"""Reading and writing video clips with PyAV: probing by demuxing, frame-hold resampling at given
times (correct for variable frame rate), rotation metadata, clear errors for bad files, atomic MP4 output.

Rotation convention: `rotation` is the angle in degrees by which the coded picture must be turned
COUNTER-clockwise to be displayed upright, normalised to 0/90/180/270. It is what PyAV reads back as
`VideoFrame.rotation` and writes with `VideoStream.set_display_rotation`, and it matches PIL, whose
`Image.Transpose.ROTATE_90` also turns counter-clockwise. A phone's portrait video (the legacy `rotate=90`
tag, "rotation of -90 degrees" in ffprobe, meaning turn 90 degrees clockwise) therefore reads as 270 here.
Mirroring in the display matrix is ignored (it is very rare in real files).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

EPSILON = 1e-4  # seconds: a frame stamped this much after a requested time still counts as "at" it
_TRANSPOSE = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}
_GAP = 2  # pixels between the frames of a contact sheet
# The mpeg4 fallback ignores "crf"/"qscale" options; a fixed quantiser needs the qscale flag with a
# lambda (FF_QP2LAMBDA = 118 per quantiser step); 2 is near-transparent, like `ffmpeg -q:v 2`.
_MPEG4_Q2 = {"flags": "+qscale", "global_quality": str(2 * 118)}


class BadVideo(Exception):
    """A file that cannot be used as a video; the message is the reason shown in the report."""


@dataclass(frozen=True)
class VideoInfo:
    width: int  # as displayed: rotation applied (90/270 swap width and height)
    height: int
    frames: int  # video packets demuxed (one per frame), nothing decoded
    span: float  # seconds from the first frame's timestamp to the last one's (0.0 for a single frame)
    fps: float  # (frames - 1) / span, or the stream's average rate when span is 0
    rotation: int  # degrees counter-clockwise to display upright: 0, 90, 180 or 270 (see module doc)
    variable_rate: bool  # frame durations differ noticeably


def _why(error: Exception) -> str:
    # FFmpeg errors print as "[Errno 1094995529] ...: 'avcodec_send_packet()'"; the text alone reads better.
    return getattr(error, "strerror", None) or f"{type(error).__name__}: {error}"


def _open(path: Path):
    """(container, its first video stream); the container is closed again when this raises."""
    if path.stat().st_size == 0:
        raise BadVideo("empty file (0 bytes)")
    try:
        container = av.open(str(path), metadata_errors="replace")  # odd tag bytes are no reason to fail
    except av.FFmpegError as e:
        raise BadVideo(f"not a readable video container ({_why(e)})") from e
    if not container.streams.video:
        audio = bool(container.streams.audio)
        container.close()
        raise BadVideo("no video stream (audio only)" if audio else "no video stream")
    return container, container.streams.video[0]


def _normal_rotation(degrees: float) -> int:
    return int(round(degrees / 90.0)) * 90 % 360


def _stamp(obj) -> int | None:
    return obj.pts if obj.pts is not None else obj.dts


GIF_FAST = 0.0105  # seconds: a GIF frame delay of 10 ms or less is played as 100 ms by browsers, and here too
GIF_SLOW = 0.1


def _played(gap: float, gif: bool) -> float:
    """How long a frame with this timestamp gap is shown: a GIF's delay of 0-10 ms (the "as fast as possible" of
    old web animations) plays as 100 ms in browsers, so a clip of such frames trains at the rate it looks."""
    return GIF_SLOW if gif and gap <= GIF_FAST else gap


def _is_gif(container) -> bool:
    return "gif" in container.format.name.split(",")


def probe_video(path: Path) -> VideoInfo:
    """Header + packet demux. Only the first frame is decoded: PyAV exposes the display matrix (rotation)
    on decoded frames only, not on the stream."""
    container, stream = _open(path)
    with container:
        stamps: list[int] = []
        count = 0
        rotation = None
        try:
            for packet in container.demux(stream):
                if packet.size == 0:  # end-of-stream marker
                    continue
                if rotation is None:  # discarded (edit-list preroll) packets may be references: decode them
                    rotation = next((f.rotation for f in stream.decode(packet)), None)
                if packet.is_discard:  # the decoder drops their frames, so they are not frames of the clip
                    continue
                count += 1
                stamp = _stamp(packet)
                if stamp is not None:
                    stamps.append(stamp)
            if count and rotation is None:  # a decoder that holds frames back gives them up at the flush
                rotation = next((f.rotation for f in stream.decode(None)), None)
        except av.FFmpegError as e:
            raise BadVideo(f"corrupt video data after {count} frames ({_why(e)})") from e
        if not count:
            raise BadVideo("no video frames")
        if rotation is None:
            raise BadVideo(f"none of the {count} video frames could be decoded")
        nominal = float(stream.average_rate or 0.0)
        gif, tick = _is_gif(container), float(stream.time_base)
        if len(stamps) == count:
            stamps.sort()  # decode order -> presentation order (B-frames)
            # in ticks, as played (GIF: `_played`)
            gaps = np.asarray([round(_played((b - a) * tick, gif) / tick)
                               for a, b in zip(stamps, stamps[1:], strict=False)], dtype=np.int64)
            span = float(gaps.sum()) * tick
        else:  # some packets carry no timestamp: fall back on the stream's nominal rate
            gaps = np.zeros(0, dtype=np.int64)
            span = (count - 1) / nominal if nominal else 0.0
        fps = (count - 1) / span if span > 0 else nominal
        # Timestamps are rounded to the time base (1 ms in Matroska), so constant-rate durations can
        # differ by a tick or two; only a bigger spread means the rate really varies.
        variable = bool(len(gaps) > 1 and gaps.max() - gaps.min() > max(0.1 * np.median(gaps), 2))
        width, height = stream.codec_context.width, stream.codec_context.height
        rotation = _normal_rotation(rotation)
    if rotation in (90, 270):
        width, height = height, width
    return VideoInfo(width, height, count, float(span), float(fps), rotation, variable)


def _upright(frame) -> Image.Image:
    img = frame.to_image()  # RGB
    turn = _TRANSPOSE.get(_normal_rotation(frame.rotation))
    return img.transpose(turn) if turn is not None else img


def decode_frames(path: Path, times: list[float]) -> list[Image.Image]:
    """Upright RGB frames at `times` (seconds from the first frame, ascending): each is the frame whose timestamp is
    nearest the time (the earlier of two equally near), so a clip taken at its own rate gets each of its frames once
    whatever its timestamps' rounding (Matroska's 1 ms, 23.976 fps), and variable or other rates resample by time.
    Frames are converted only when picked and decoding stops once every time has its frame, so memory stays small."""
    if any(b < a for a, b in zip(times, times[1:], strict=False)):
        raise ValueError("times must be ascending")
    if not times:
        return []
    container, stream = _open(path)
    out: list[Image.Image] = []
    with container:
        slack = EPSILON + float(stream.time_base) / 2  # a time this near the last frame is still within the clip
        # two frames this nearly as near a time are equally near (stamps are rounded to the time base, and float
        # sums are not exact): the earlier one is taken, so a 12 fps clip at 24 fps shows each frame twice. Never a
        # quarter of the gap or more: an AVI's time base is the frame length itself (1/24), where a time on a frame
        # would otherwise count as a tie with the frame before
        rounding = EPSILON + float(stream.time_base)
        gif = _is_gif(container)
        before = before_image = None  # the frame before the one just decoded, and its picture once made
        first = last = previous = None  # the first frame's stamp; the times of the last two frames
        stamped = None  # the last frame's stamp (a GIF's times add up its frames' delays as played)
        count = 0

        def take(frame, image):  # the picture of `frame`, made once however often it is picked
            out.append(image.copy() if image is not None else _upright(frame))
            return out[-1]

        try:
            for frame in container.decode(stream):
                stamp = _stamp(frame)
                if stamp is None:  # no timestamps at all: assume the nominal rate
                    t = count / float(stream.average_rate or 1)
                elif gif and stamped is not None and last is not None:  # after the frames before it as played
                    t = last + _played(float((stamp - stamped) * stream.time_base), gif)
                else:
                    first = stamp if first is None else first
                    t = float((stamp - first) * stream.time_base)
                stamped = stamp if stamp is not None else stamped
                count += 1
                image = None
                # each time up to this frame's goes to the nearer of it and the frame before
                while len(out) < len(times) and times[len(out)] <= t:
                    wanted = times[len(out)]
                    if before is not None and wanted - last <= t - wanted + min(rounding, (t - last) / 4):
                        before_image = take(before, before_image)
                    else:
                        image = take(frame, image)
                if len(out) == len(times):
                    return out
                before, before_image, previous, last = frame, image, last, t
        except av.FFmpegError as e:
            raise BadVideo(f"cannot decode after {count} frames ({_why(e)})") from e
        if before is None:
            raise BadVideo("no video frames could be decoded")
        # The last frame is shown for its own duration; a time past that is beyond the end of the clip.
        if before.duration and before.time_base:
            duration = _played(float(before.duration * before.time_base), gif)
        elif previous is not None:
            duration = last - previous
        else:
            duration = 1.0 / float(stream.average_rate or 1)
        if count > 1 and last > 0:  # at least the average gap: frames.resampled_count counts a clip that long
            duration = max(duration, last / (count - 1))
        end = last + duration
        while len(out) < len(times) and (times[len(out)] <= last + slack or times[len(out)] < end):
            before_image = take(before, before_image)
        if len(out) < len(times):
            raise BadVideo(f"decoded only {count} frames ({end:.2f} s), needs {times[-1]:.2f} s")
    return out


def _encoder(*names: str) -> str:
    for name in names:
        try:
            av.Codec(name, "w")
            return name
        except (av.codec.codec.UnknownCodecError, av.FFmpegError):
            continue
    raise RuntimeError(f"none of these encoders is in this PyAV build: {', '.join(names)}")


def _rate(fps: float) -> Fraction:
    rate = Fraction(fps).limit_denominator(1001)  # 29.97 -> 2997/100, 30000/1001 stays exact
    if rate <= 0:
        raise ValueError(f"fps must be positive, not {fps}")
    return rate


def _encode(container, stream, arrays, stamps: list[int] | None = None) -> None:
    for i, array in enumerate(arrays):
        frame = av.VideoFrame.from_ndarray(array, format="rgb24")
        frame.pts = i if stamps is None else stamps[i]
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


def write_mp4(frames: list[Image.Image], path: Path, fps: float) -> None:
    """H.264 (yuv420p) MP4, written to a temporary file beside `path` and moved into place, so an
    interrupted write never leaves a truncated file under the real name."""
    if not frames:
        raise ValueError("write_mp4 needs at least one frame")
    width, height = frames[0].size
    if any(f.size != (width, height) for f in frames):
        raise ValueError("all frames must have the same size")
    rate = _rate(fps)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # yuv420p stores colour at half resolution, so encoders and players need even sizes; the edge
    # row/column is repeated rather than cropping the picture.
    pad = ((0, height % 2), (0, width % 2), (0, 0))
    try:
        with av.open(str(tmp), "w", format="mp4", options={"movflags": "+faststart"}) as container:
            codec = _encoder("libx264", "mpeg4")
            options = {"crf": "18"} if codec == "libx264" else _MPEG4_Q2
            stream = container.add_stream(codec, rate=rate, options=options)
            stream.width, stream.height = width + width % 2, height + height % 2
            stream.pix_fmt = "yuv420p"
            arrays = (np.pad(np.asarray(f.convert("RGB")), pad, mode="edge") for f in frames)
            _encode(container, stream, arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def contact_sheet(frames: list[Image.Image], columns: int = 4, max_frames: int = 8) -> Image.Image:
    """A still grid of up to `max_frames` frames picked evenly (first and last included), `columns` per
    row, to glance at a clip without playing it."""
    if not frames:
        raise ValueError("contact_sheet needs at least one frame")
    count = min(len(frames), max(1, max_frames))
    picks = [round(k * (len(frames) - 1) / (count - 1)) for k in range(count)] if count > 1 else [0]
    columns = max(1, min(columns, count))
    rows = math.ceil(count / columns)
    cell_w = max(f.width for f in frames)
    cell_h = max(f.height for f in frames)
    sheet = Image.new("RGB", (columns * cell_w + (columns - 1) * _GAP, rows * cell_h + (rows - 1) * _GAP))
    for k, index in enumerate(picks):
        row, col = divmod(k, columns)
        sheet.paste(frames[index].convert("RGB"), (col * (cell_w + _GAP), row * (cell_h + _GAP)))
    return sheet


def _shapes(width: int, height: int, frames: int, seed: int):
    """Moving-square frames: an x/y gradient (so any rotation or flip is visible) and a square that
    crosses from left to right, its colour and height set by the seed."""
    rng = np.random.default_rng(seed)
    tint, colour = rng.integers(0, 256, 1), rng.integers(0, 256, 3)
    side = max(2, min(width, height) // 3)
    top = int(rng.integers(0, height - side + 1))
    ys, xs = np.mgrid[0:height, 0:width]
    background = np.stack(
        [xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1), np.broadcast_to(tint, xs.shape)], axis=-1
    ).astype(np.uint8)
    for i in range(frames):
        array = background.copy()
        left = (width - side) * i // max(frames - 1, 1)
        array[top : top + side, left : left + side] = colour
        yield array


def _audio_stream(container, suffix: str):
    codec = _encoder("libopus", "opus") if suffix in (".webm", ".ogg", ".opus") else _encoder("aac")
    return container.add_stream(codec, rate=48000, layout="mono")


def _encode_tone(container, stream, seconds: float) -> None:
    samples = max(1, round(seconds * 48000))
    wave = (0.3 * np.sin(2 * np.pi * 440 * np.arange(samples) / 48000)).astype(np.float32)
    for start in range(0, samples, 4800):
        chunk = av.AudioFrame.from_ndarray(wave[None, start : start + 4800], format="fltp", layout="mono")
        chunk.sample_rate, chunk.pts = 48000, start
        container.mux(stream.encode(chunk))
    container.mux(stream.encode(None))


def synthetic_clip(
    path: Path, width: int = 32, height: int = 24, frames: int = 17, fps: float = 24, seed: int = 0,
    rotation: int = 0, variable_rate: bool = False, audio: bool = False,
) -> Path:
    """A test clip of a square moving over a gradient, deterministic from `seed`; the container follows
    the suffix. `rotation` is stored as display metadata (module doc has the sign). `variable_rate`
    alternates frame durations of 1x and 2x the nominal 1/fps."""
    path = Path(path)
    suffix = path.suffix.lower()
    rate = _rate(fps)
    stamps = [i + i // 2 for i in range(frames)] if variable_rate else list(range(frames))
    with av.open(str(path), "w") as container:
        if suffix == ".webm":
            codec, pix_fmt, options = _encoder("libvpx-vp9", "libvpx"), "yuv420p", {"crf": "10", "b": "0"}
        else:
            codec = _encoder("libx264", "mpeg4")
            # libx264 refuses odd sizes in 4:2:0; 4:4:4 keeps odd-sized test clips possible.
            odd = width % 2 or height % 2
            pix_fmt = "yuv444p" if codec == "libx264" and odd else "yuv420p"
            options = {"crf": "12"} if codec == "libx264" else _MPEG4_Q2
        stream = container.add_stream(codec, rate=rate, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if rotation % 360:
            stream.set_display_rotation(rotation)
        # Every stream must exist before the first packet is muxed (that writes the header).
        sound = _audio_stream(container, suffix) if audio else None
        _encode(container, stream, _shapes(width, height, frames, seed), stamps)
        if sound is not None:
            _encode_tone(container, sound, float((stamps[-1] + 1) / rate))
    return path


def audio_only_file(path: Path) -> Path:
    """A half-second sine tone with no video stream (AAC, or Opus for .webm)."""
    path = Path(path)
    with av.open(str(path), "w") as container:
        _encode_tone(container, _audio_stream(container, path.suffix.lower()), 0.5)
    return path
