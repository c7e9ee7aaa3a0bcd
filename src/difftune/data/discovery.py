"""Find images (or clips) and their captions in a dataset folder, and say what was left out and why.

Image sizes (and clip sizes, frame counts and rates) are kept in a metadata file beside the dataset's
latent cache: a later scan re-reads only files that were added or changed (by size and mtime), and
forgets removed ones.

Hidden files and folders (names starting with '.') are not used, as most trainers do: `.git`,
`.thumbnails`, `.ipynb_checkpoints` and editors' backups hold no training data. The report counts them.
A filesystem error on one file (a symlink that leads nowhere or loops, permission denied, a file
that vanished during the scan) leaves that file out with the error in the report; a folder that
cannot be listed is reported the same way. Neither stops the scan.

Images far below their bucket: without `minimum_image_size`, an image that would have to be enlarged
MAX_UPSCALE times or more to cover its bucket is left out (a 8x8 image says nothing at 1024 px), and
one enlarged more than NOTE_UPSCALE times is used with a note in the report.

Files of a type the dataset does not read (a .psd among images, an image among clips, a container PyAV was not
asked to read) are counted per extension and named in the report, so none is dropped without a word; caption
files and tables (COMPANION_SUFFIXES) are not. PyAV decodes more containers than the common four: .avi, .m4v,
.mpg and .mpeg are read as clips too (tests/test_video_extensions.py makes each with PyAV and trains on it).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from difftune.data.buckets import (
    SizeRule,
    aspect_problem,
    bucket_for,
    downsample_first,
    minimum_above_resolution,
    too_small_problem,
    upscale,
    upscale_problem,
)
from difftune.data.captions import CaptionRule, CaptionTable, caption
from difftune.data.frames import TEMPORAL, FrameRule, plan_clip, resampled_count, same_rate
from difftune.data.images import IMAGE_EXTENSIONS, BadImage, probe_size
from difftune.data.metadata import PROBE_VERSION, MetadataCache  # noqa: F401 (PROBE_VERSION: tests)

SOURCE_MANIFEST = ".difftune-source.json"  # in a downloaded dataset's folder (data/sources): the source it holds
SOURCE_LEFT_OUT = "left_out"  # the manifest's [where, why] of each row or object the download skipped

# Clips PyAV demuxes and decodes (PyAV is imported on demand; each was checked with clips PyAV wrote): the one list
VIDEO_SUFFIXES = {".mp4", ".mov", ".webm", ".mkv", ".avi", ".m4v", ".mpg", ".mpeg"}
# what a video dataset reads: animated GIFs are clips there (PyAV decodes them; one of a single frame is too short)
CLIP_SUFFIXES = VIDEO_SUFFIXES | {".gif"}
# Beside the images or clips but never read as them: caption files and caption or metadata tables. Any other file
# of a type the dataset does not read is named in the report.
COMPANION_SUFFIXES = {".txt", ".json", ".jsonl", ".parquet", ".csv"}
MAX_UPSCALE = 8.0  # left out from this enlargement on (when minimum_image_size is not set)
NOTE_UPSCALE = 2.0  # a note in the report above this one


@dataclass(frozen=True)
class Sample:
    dataset_id: str
    path: Path
    captions: tuple[str, ...]  # one is drawn per sample during training
    width: int  # as displayed (EXIF applied)
    height: int
    bucket: tuple[int, int]
    downsample: tuple[int, int] | None
    conditioning: Path | None = None  # the paired input image (image-to-image), same relative name
    frames: int = 0  # clips: frames trained on (4k+1), taken at `fps` from the first frame; 0 for images
    fps: float = 0.0
    mask: Path | None = None  # its loss mask (conditioning_type 'mask', train/masked_loss.py), same relative name
    name: str = ""  # its path below the dataset's folder, '/'-separated (discovery sets it)
    sized_by_table: bool = False  # width/height from a caption table (metadata_backend 'parquet'), not the file
    resampled: bool = False  # a clip whose frames are taken by time at another rate than its own (clip_frames)

    @property
    def ident(self) -> str:
        """What names the file wherever its dataset's folder lies: the cache keys, random crops and the
        max_num_samples draw follow it, so a dataset moved or copied with its times (mv, rsync -a) to another
        folder or machine keeps its cached latents and trains the same. The path itself when `name` is unset."""
        return f"{self.dataset_id}/{self.name}" if self.name else str(self.path)

    @property
    def caption(self) -> str:
        return self.captions[0]

    @property
    def group(self) -> tuple[int, ...]:
        """What samples of one batch share: the bucket, and for clips the frame count."""
        return (*self.bucket, self.frames) if self.frames else self.bucket


@dataclass
class Discovery:
    dataset_id: str
    samples: list[Sample] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    notes: list[tuple[Path, str]] = field(default_factory=list)  # used, but worth telling the user
    probed: int = 0  # files whose header was read this time (the rest came from the metadata file)
    not_drawn: int = 0  # usable files max_num_samples left out of this run (train/plan.py limit)
    held_out: bool = False  # an eval dataset's (dataset_type 'eval'): measured, never trained on
    masks: str | None = None  # the id of its mask dataset (conditioning_type 'mask'), for the report
    regularisation: bool = False  # is_regularisation_data: the memory planner's teacher pass (memory_plan/passes.py)
    # latents encoded during training (vae_cache_disable, vae_cache_clear_each_epoch, vae_cache_ondemand): the VAE stays
    # on the accelerator
    on_the_fly: bool = False
    crops_each_epoch: bool = False  # vae_cache_clear_each_epoch: a new random crop each epoch (for the report)
    caption_filter: bool = False  # its captions go through caption_filter_list (for the report)
    captions_changed: int = 0  # by those filters
    captions_emptied: int = 0
    root: Path | None = None  # the folder scanned
    reads: frozenset[str] = frozenset()  # the extensions it reads
    video: bool = False
    unread: dict[str, list[Path]] = field(default_factory=dict)  # extension -> files of a type it does not read

    def unread_reasons(self) -> list[tuple[Path, str]]:
        """One (first file, reason) per extension not read, for the report."""
        kind, reads = "video" if self.video else "image", ", ".join(sorted(self.reads))
        out = []
        for suffix, files in sorted(self.unread.items()):
            name = suffix or "a file without an extension"
            more = f" (nor {len(files) - 1} more {suffix or 'such'} file(s))" if len(files) > 1 else ""
            hint = ""
            if self.video and suffix in IMAGE_EXTENSIONS - CLIP_SUFFIXES:
                hint = "; images go in an image dataset"
            elif not self.video and suffix in VIDEO_SUFFIXES:
                hint = "; clips go in a dataset_type 'video' entry"
            out.append((files[0], f"{name} is not read{more}; {kind} datasets read {reads}{hint}"))
        return out

    def why_empty(self) -> str:
        """Why a dataset has no usable file, for the error that says so."""
        if self.skipped and all(why.startswith("no caption file ") for _, why in self.skipped):
            # SimpleTuner's default is 'filename', and its web UI's dataset builder writes no caption_strategy
            return ("none of its files has a caption file, which caption_strategy 'textfile' reads (difftune's "
                    "default when it is not set); add .txt captions beside them, or set caption_strategy 'filename' "
                    "to caption each by its file name (SimpleTuner's default), or 'instanceprompt' with an "
                    "instance_prompt; the files are listed below")
        if self.skipped:
            return "see each file's reason below"
        why = f"no {'/'.join(sorted(self.reads))} file in {self.root}"
        unread = sum(len(files) for files in self.unread.values())
        if unread:
            why += f", only {unread} file(s) of other types, not read (see below)"
        return why


@dataclass
class Walk:
    files: list[Path]
    hidden: int = 0  # hidden files and folders passed over
    errors: list[tuple[Path, str]] = field(default_factory=list)  # folders that could not be listed
    generated: list[Path] = field(default_factory=list)  # folders of generated input images passed over


def walk(root: Path, skip: tuple[Path, ...] = ()) -> Walk:
    """Every file under root, sorted, following symlinked folders once (no loops), passing over hidden
    files and folders, and recording folders that cannot be listed instead of failing. `skip`: folders not read
    (a dataset's input images or loss masks kept in a sub-folder of it)."""
    seen: set[str] = {os.path.realpath(p) for p in skip}
    result = Walk([])

    def failed(error: OSError) -> None:
        result.errors.append((Path(error.filename or root), f"folder not readable: {error.strerror or error}"))

    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=failed):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        if dirpath != str(root) and SOURCE_MANIFEST in filenames and _generated_here(Path(dirpath)):
            result.generated.append(Path(dirpath))  # its images were made from others: never training images
            dirnames[:] = []
            continue
        visible = sorted(d for d in dirnames if not d.startswith("."))
        # a downloaded dataset's manifest (data/sources) is not the user's file to be told about
        result.hidden += len(dirnames) - len(visible) + sum(1 for n in filenames if n.startswith(".") and n != SOURCE_MANIFEST)
        dirnames[:] = visible
        result.files.extend(Path(dirpath) / name for name in filenames if not name.startswith("."))
    result.files.sort()
    return result


def _not_downloaded(root: Path) -> list[tuple[str, str]]:
    """What a downloaded dataset's source held that its download skipped (a broken image, an empty caption), as
    the download's manifest records it (data/sources), so that the data report counts and names them."""
    try:
        found = json.loads((root / SOURCE_MANIFEST).read_text(encoding="utf-8")).get(SOURCE_LEFT_OUT) or []
        return [(str(where), str(why)) for where, why in found]
    except (OSError, ValueError, TypeError, AttributeError):
        return []  # no manifest (a local folder), or one this version did not write


def _generated_here(folder: Path) -> bool:
    """Whether `folder` holds generated input images (its manifest says so: data/generated_conditioning.py)."""
    try:
        return "generated_conditioning" in json.loads((folder / SOURCE_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def count_files(root: Path, suffixes: set[str] | frozenset[str], cap: int) -> tuple[list[Path], bool]:
    """The files with these suffixes that discovery would find under root (sub-folders searched, hidden ones and
    symlink loops passed over, as `walk` does), stopping at `cap` of them: (the files, whether it stopped early).
    For a quick count in the wizard and the web UI's folder picker; a huge folder is not listed in full."""
    seen: set[str] = set()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in suffixes:
                if len(found) >= cap:
                    return found, True
                found.append(Path(dirpath) / name)
    return found, False


def walk_files(root: Path) -> list[Path]:
    return walk(root).files


def image_files(root: Path, suffixes: set[str] = IMAGE_EXTENSIONS) -> list[Path]:
    return [p for p in walk_files(root) if p.suffix.lower() in suffixes]


def pair_index(root: Path) -> dict[Path, list[Path]]:
    """Conditioning images by relative path without extension (a .png target may pair with a .jpg); two files of
    one name (cat.png and cat.jpg) are both listed, so that the pair is refused rather than one picked silently."""
    index: dict[Path, list[Path]] = {}
    for p in image_files(root):
        index.setdefault(p.relative_to(root).with_suffix(""), []).append(p)
    return index


def _partner(index: dict[Path, list[Path]], rel: Path, what: str, root: Path) -> tuple[Path | None, str | None]:
    """The one file of `index` named as `rel`, or why there is none (missing, or several)."""
    found = index.get(rel.with_suffix(""), [])
    if not found:
        return None, f"no {what} of the same name in {root}"
    if len(found) > 1:
        return None, (f"{len(found)} files in {root} could be its {what} ({', '.join(p.name for p in found)}); "
                      "keep one")
    return found[0], None


def filesystem_problem(path: Path) -> str | None:
    """Why a listed file cannot be read, in words (broken or looping symlink, permission, vanished), or None."""
    try:
        st = path.stat()
    except OSError as e:
        if os.path.islink(path):  # (os.path, unlike Path, answers False on any error)
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            if e.errno == errno.ELOOP:
                return f"symlink loop ({path.name} -> {target})"
            return f"broken symlink: its target {target} does not exist"
        return f"filesystem error: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a FIFO, socket or device is never read)"
    if not os.access(path, os.R_OK):
        return "permission denied"
    return None


def input_aspect_note(input_size: tuple[int, int], size: tuple[int, int], bucket: tuple[int, int]) -> str | None:
    """A note when an image-to-image input image's aspect differs from its target's (by more than 1%): it is
    resized to cover the target's bucket and cropped to it (data/latents.py), so part of it is cut off."""
    (iw, ih), (w, h) = input_size, size
    if iw < 1 or ih < 1 or abs(math.log((iw / ih) / (w / h))) <= 0.01:
        return None
    return (f"its input image is {iw}x{ih} (aspect {iw / ih:.2f}), the image {w}x{h} ({w / h:.2f}): the input image "
            f"is resized to cover the {bucket[0]}x{bucket[1]} bucket and cropped to it, so part of it is cut off")


def choice_for(ident: str, seed: int) -> float:
    """A fixed number in [0, 1) per file (its Sample.ident) and seed (for crop_aspect 'random')."""
    digest = hashlib.sha256(f"{seed}|aspect|{ident}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:4], "little") / 2**32


@dataclass(frozen=True)
class DatasetSpec:
    """What discovery needs to know about one dataset (built from its config entry)."""

    dataset_id: str
    root: Path
    rule: SizeRule
    captions: CaptionRule
    table: CaptionTable | None = None
    conditioning_root: Path | None = None
    metadata_file: Path | None = None
    seed: int = 0
    write_metadata: bool = True  # several processes: only one writes the shared metadata file
    frames: FrameRule | None = None  # a video dataset's frame rule
    mask_root: Path | None = None  # its loss masks' folder (conditioning_type 'mask')
    # image-to-video: the frame rule as the dataset sets it, when the flavour's floor (the first frame is the input
    # image: train/plan.py) raised `frames.min_frames`; to say which of the two leaves a clip out
    frames_as_set: FrameRule | None = None
    # conditioning_root is generated (data/generated_conditioning.py) and has not been brought up to date: an image
    # without its input image is taken as if it had one (the web UI's and the wizard's scans write no file)
    conditioning_pending: bool = False
    conditioning_generated: bool = False  # conditioning_root is made by data/generated_conditioning.py
    sizes_from_table: bool = False  # metadata_backend 'parquet': the caption table's width/height, the files unopened


def first_frame_problem(available: int, own: int, rule: FrameRule) -> str:
    """Why image-to-video's floor of frames leaves out a clip the dataset's own rule keeps (`own` frames)."""
    at = f"{available} frame(s) at {rule.frame_rate:g} fps"
    if available >= (rule.min_frames or 0) and own < available:  # resolution_frames: rounded down below the floor
        step = f"frame_interval {rule.frame_interval}" if rule.frame_interval != TEMPORAL else "4k+1"
        at += f" round down to {own} ({step})"
    return (f"{at}: image-to-video needs at least {rule.min_frames} frames (the first frame is the input image, "
            "the frames after it are trained)")


def clip_frames(path: Path, rel: str, metadata: MetadataCache, rule: FrameRule, result: Discovery,
                as_set: FrameRule | None = None):
    """((width, height), frames, fps, resampled) of a usable clip, or None after recording why it is left out. `fps`:
    the rate its frames are taken at, the rule's, or the clip's own when that is the same within 0.5% (23.976 for
    24): frame k is then the clip's frame k, where taking frames 1/24 s apart from a 23.976 fps clip would repeat
    one. `resampled`: taken at the rule's rate (another rate, or a variable one)."""
    info, problem, probed = metadata.video(path, rel)
    result.probed += probed
    if info is None:
        result.skipped.append((path, problem or "unreadable"))
        return None
    available = resampled_count(info.frames, info.span, info.fps, rule.frame_rate, info.variable_rate)
    plan = plan_clip(available, info.fps, rule)
    if plan.frames is None:
        problem = plan.problem or "unusable"
        own = plan_clip(available, info.fps, as_set) if as_set is not None else None
        if own is not None and own.frames is not None:  # only image-to-video's floor leaves it out
            problem = first_frame_problem(available, own.frames, rule)
        elif own is not None:  # the dataset's own settings leave it out too: said in their words (not the floor's)
            problem = own.problem or problem
        # the counts above are at the rule's rate: the clip's own too, for a clip that has another
        if info.frames > 1 and info.fps > 0 and (info.variable_rate or not same_rate(info.fps, rule.frame_rate)):
            problem += (f" (the clip has {info.frames} frames at {info.fps:.3g} fps, taken at {rule.frame_rate:g} "
                        "fps)")
        result.skipped.append((path, problem))
        return None
    notes = [plan.note] if plan.note else []
    if info.variable_rate:
        notes.append(f"variable frame rate (average {info.fps:.3g} fps): frames are taken by timestamp")
    if info.rotation:
        notes.append(f"rotated {info.rotation} degrees by its metadata: trained upright, {info.width}x{info.height}")
    if notes:
        result.notes.append((path, "; ".join(notes)))
    resampled = info.variable_rate or not same_rate(info.fps, rule.frame_rate)
    return (info.width, info.height), plan.frames, rule.frame_rate if resampled else info.fps, resampled


def discover(spec: DatasetSpec) -> Discovery:
    suffixes = CLIP_SUFFIXES if spec.frames is not None else IMAGE_EXTENSIONS
    result = Discovery(spec.dataset_id, caption_filter=spec.captions.filters is not None, root=spec.root,
                       reads=frozenset(suffixes), video=spec.frames is not None)
    pairs = pair_index(spec.conditioning_root) if spec.conditioning_root is not None else None
    masks = pair_index(spec.mask_root) if spec.mask_root is not None else None
    metadata = MetadataCache(spec.metadata_file)
    # input images or masks kept inside the dataset's folder (edits/inputs/) are not training images
    inside = tuple(p for p in (spec.conditioning_root, spec.mask_root)
                   if p is not None and p.resolve().is_relative_to(spec.root.resolve()) and p.resolve() != spec.root.resolve())
    listing = walk(spec.root, inside)
    for folder in inside:
        result.notes.append((folder, "inside the dataset's folder: read as its input images or masks only, not "
                                     "as images to train on"))
    result.skipped += listing.errors
    result.skipped += [(spec.root, f"{where}: {why} (skipped while downloading)")
                       for where, why in _not_downloaded(spec.root)]
    for folder in listing.generated:
        result.notes.append((folder, "generated input images (its .difftune-source.json says so): not read as "
                                     "images to train on"))
    if listing.hidden:
        result.notes.append((spec.root, f"{listing.hidden} hidden file(s) or folder(s) (name starting with '.') "
                                        "not used"))
    if (warning := minimum_above_resolution(spec.rule)) is not None:
        result.notes.append((spec.root, warning))
    for path in listing.files:
        suffix = path.suffix.lower()
        if suffix not in suffixes:
            if suffix not in COMPANION_SUFFIXES:
                result.unread.setdefault(suffix, []).append(path)
            continue
        problem = filesystem_problem(path)
        if problem is None:
            try:
                problem = _one(path, spec, pairs, metadata, result, masks)
            except (OSError, RuntimeError) as e:  # it changed under us; RuntimeError: resolve() of a loop
                problem = f"filesystem error: {getattr(e, 'strerror', None) or e}"
        if problem:
            result.skipped.append((path, problem))
    names = {p.relative_to(spec.root).with_suffix("") for p in listing.files if p.suffix.lower() in suffixes}
    for index, root, what in ((None if spec.conditioning_generated else pairs, spec.conditioning_root, "input image"),
                              (masks, spec.mask_root, "mask")):
        unpaired = sorted(str(k) for k in (index or {}) if k not in names)
        if unpaired:  # a renamed or extra file: said, not silently left out
            shown = ", ".join(unpaired[:3]) + (", ..." if len(unpaired) > 3 else "")
            result.notes.append((root, f"{len(unpaired)} {what}(s) with no file of the same name in {spec.root} to "
                                       f"train: not used ({shown})"))
    readable = [p for p in listing.files if p.suffix.lower() in suffixes]
    if spec.table is not None and (orphans := spec.table.unmatched(readable, spec.root)):
        shown = ", ".join(repr(name) for name in orphans[:3]) + (", ..." if len(orphans) > 3 else "")
        result.notes.append((spec.table.path, f"{len(orphans)} row(s) name no {'clip' if spec.frames else 'image'} "
                                              f"in {spec.root}: not used ({shown})"))
    if spec.write_metadata and (problem := metadata.save()) is not None:
        result.notes.append((spec.metadata_file, problem))
    return result


def _one(path: Path, spec: DatasetSpec, pairs, metadata: MetadataCache, result: Discovery, masks=None) -> str | None:
    """Add one file's sample to `result`, or return why it is left out."""
    rule = spec.rule
    rel_path = path.relative_to(spec.root)
    rel = str(rel_path)
    conditioning = None
    to_generate = False  # a generated input image not made yet (spec.conditioning_pending)
    not_generated = None  # a generated input image the generator could not make
    if pairs is not None:
        conditioning, problem = _partner(pairs, path.relative_to(spec.root), "conditioning image",
                                         spec.conditioning_root)
        if conditioning is None and spec.conditioning_pending and rel_path.with_suffix("") not in pairs:
            conditioning, to_generate = spec.conditioning_root / rel_path.with_suffix(".png"), True
        elif conditioning is None and spec.conditioning_generated and rel_path.with_suffix("") not in pairs:
            # said after the image's own problems: an unreadable image has no input image either
            not_generated = (f"no input image was generated for it in {spec.conditioning_root} (the generation's "
                             "message says why)")
        elif conditioning is None:
            return problem
        elif (problem := filesystem_problem(conditioning)) is not None:
            return f"its conditioning image {conditioning}: {problem}"
    mask = None
    if masks is not None:  # like the i2i pairs: an image without its mask is left out (SimpleTuner pairs strictly)
        mask, problem = _partner(masks, path.relative_to(spec.root), "loss mask", spec.mask_root)
        if mask is None:
            return f"{problem} (conditioning_type 'mask')"
        if (problem := filesystem_problem(mask)) is not None:
            return f"its loss mask {mask}: {problem}"
    captioned = caption(path, spec.root, spec.captions, spec.table)
    result.captions_changed += captioned.changed
    result.captions_emptied += captioned.emptied
    if captioned.captions is None:
        return captioned.problem or "no caption"
    frames, resampled = 0, False
    if spec.frames is not None:  # clips are always probed: frame counts and rates come from the file
        clip = clip_frames(path, rel, metadata, spec.frames, result, spec.frames_as_set)
        if clip is None:
            return None  # clip_frames recorded why
        (width, height), frames, fps, resampled = clip
    else:
        if spec.sizes_from_table and captioned.size is not None:  # metadata_backend 'parquet': no file opened;
            size, problem, probed = captioned.size, None, False  # caching leaves out a file not of this size
        else:  # the file's header: the displayed size (EXIF rotation) and a first look at its data, kept in the
            size, problem, probed = metadata.size(path, rel)  # metadata cache, so later runs open no file
        result.probed += probed
        if size is None:
            return problem or "unreadable"
        width, height = size
        if not spec.sizes_from_table and metadata.animated(rel):
            result.notes.append((path, "an animation: trained on its first frame only (a video dataset, "
                                       "dataset_type 'video', reads a GIF as a clip)"))
        if not spec.sizes_from_table and captioned.size is not None and tuple(captioned.size) != (width, height):
            table = f"{captioned.size[0]}x{captioned.size[1]}"
            turned = tuple(captioned.size) == (height, width)
            result.notes.append((path, f"the parquet table's size {table} is not the image's {width}x{height}"
                                 + (" as displayed (its EXIF rotation turns it)" if turned else "")
                                 + ": the image's is used"))
    if not_generated is not None:
        return not_generated
    if width < 1 or height < 1:
        return f"{width}x{height}: no pixels"
    problem = too_small_problem(width, height, rule) or aspect_problem(width, height, rule)
    if problem:
        return problem
    down = downsample_first(width, height, rule)
    basis = down or (width, height)
    if problem := upscale_problem(*basis, rule):
        return problem
    name = rel_path.as_posix()
    bucket = bucket_for(*basis, rule, choice_for(f"{spec.dataset_id}/{name}", spec.seed))
    factor = upscale(*basis, bucket)
    if rule.minimum_image_size is None and factor >= MAX_UPSCALE:
        return (f"{width}x{height} is far below its {bucket[0]}x{bucket[1]} bucket (it would be enlarged "
                f"{factor:.0f}x; {MAX_UPSCALE:g}x or more is left out); set minimum_image_size to choose the floor")
    notes = [captioned.note] if captioned.note else []
    if mask is not None:
        try:
            mask_size = probe_size(mask)
        except (BadImage, OSError) as e:
            return f"its loss mask {mask}: {e}"
        if mask_size != (width, height):
            notes.append(f"its loss mask is {mask_size[0]}x{mask_size[1]}, the image {width}x{height}: the mask is "
                         "stretched to the image's size, then resized and cropped with it")
    if conditioning is not None and not to_generate:
        try:
            input_size = probe_size(conditioning)
        except (BadImage, OSError) as e:
            return f"its conditioning image {conditioning}: {e}"
        if (note := input_aspect_note(input_size, (width, height), bucket)) is not None:
            notes.append(note)
    if factor > NOTE_UPSCALE and down is not None:  # shrunk by target_downsample_size first, then enlarged
        notes.append(f"{width}x{height} is shrunk to {down[0]}x{down[1]} by target_downsample_size, then enlarged "
                     f"{factor:.1f}x to its {bucket[0]}x{bucket[1]} bucket: it will look blurry (a larger "
                     "target_downsample_size avoids it)")
    elif factor > NOTE_UPSCALE:
        notes.append(f"{width}x{height} is enlarged {factor:.1f}x to its {bucket[0]}x{bucket[1]} bucket: it will "
                     "look blurry (minimum_image_size leaves such images out)")
    if notes:
        result.notes.append((path, "; ".join(notes)))
    if spec.frames is None:
        fps = 0.0
    result.samples.append(
        Sample(spec.dataset_id, path, captioned.captions, width, height, bucket, down, conditioning, frames, fps, mask,
               name, sized_by_table=spec.sizes_from_table and captioned.size is not None and not spec.frames,
               resampled=resampled)
    )
    return None
