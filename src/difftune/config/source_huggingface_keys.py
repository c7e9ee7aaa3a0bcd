"""Dataset-entry keys of type 'huggingface': a dataset on the Hugging Face hub (or a local folder in its layout).
data/sources/huggingface.py downloads it into instance_data_dir before discovery: each row's image (or clip)
becomes a file named by its row number, with a caption file beside it.

SimpleTuner's keys, at the top level of the entry or in its `huggingface` block (SimpleTuner reads both);
the same key in both places with different values is refused. Its keys that have no meaning once the rows are
files on disk (filters, composite images, size columns) are refused with what to do instead, never ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from difftune.config.fields import field

TYPE = "huggingface"

# SimpleTuner's `huggingface` block keys that difftune does not take, and why (the fix is in the message).
_REFUSED_IN_BLOCK = {
    "filter_func": "row filters are not implemented; filter the dataset first (datasets' Dataset.filter, then "
                   "to_parquet or push_to_hub), or use minimum_image_size / minimum_aspect_ratio / max_num_samples",
    "composite_image_config": "composite (grid) images are not implemented; split the grids into images first",
    "width_column": "sizes are read from the downloaded files (discovery), so no size column is needed; remove it",
    "height_column": "sizes are read from the downloaded files (discovery), so no size column is needed; remove it",
    "num_frames_column": "frame counts are read from the downloaded clips; remove it",
    "fps_column": "frame rates are read from the downloaded clips; remove it",
    "quality_column": "quality filters are not implemented; filter the dataset first",
    "description_column": "use fallback_caption_column to name the column used when caption_column is empty",
    "file_extension": "each downloaded file keeps its own format's extension; remove it",
    "audio_column": "audio datasets are not trained here; remove it",
    "audio_caption_fields": "audio datasets are not trained here; remove it",
    "lyrics_column": "audio datasets are not trained here; remove it",
    "auto_load": "the dataset is always read once, before training, to download it; remove it",
}

# Keys the block and the top level share (difftune stores the top-level one; see _fold_block).
SHARED = ("dataset_name", "dataset_config", "data_files", "split", "revision", "image_column", "video_column",
          "caption_column", "fallback_caption_column", "cache_dir", "streaming", "num_proc")
# Every key of this mixin (set on an entry of another type: refused).
KEYS = (*SHARED, "huggingface")

DataFiles = str | list[str] | dict[str, str | list[str]]


class HuggingfaceBlock(BaseModel):
    """The `huggingface` block of a type 'huggingface' entry: the same keys as at the top level."""

    model_config = ConfigDict(extra="forbid")

    dataset_name: str | None = field(None, "As the top-level dataset_name.", "data", min_length=1)
    dataset_config: str | None = field(None, "As the top-level dataset_config.", "data", min_length=1)
    data_files: DataFiles | None = field(None, "As the top-level data_files.", "data")
    split: str | None = field(None, "As the top-level split.", "data", min_length=1)
    revision: str | None = field(None, "As the top-level revision.", "data", min_length=1)
    image_column: str | None = field(None, "As the top-level image_column.", "data", min_length=1)
    video_column: str | None = field(None, "As the top-level video_column.", "data", min_length=1)
    caption_column: str | list[str] | None = field(None, "As the top-level caption_column.", "data")
    fallback_caption_column: str | None = field(None, "As the top-level fallback_caption_column.", "data",
                                                min_length=1)
    cache_dir: str | None = field(None, "As the top-level cache_dir.", "data", min_length=1)
    streaming: bool | None = field(None, "As the top-level streaming.", "data")
    num_proc: int | None = field(None, "As the top-level num_proc.", "data", ge=1)

    @model_validator(mode="before")
    @classmethod
    def huggingface_block_refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in _REFUSED_IN_BLOCK.items():
                if key in data and not (key == "auto_load" and data[key] in (False, None)):
                    raise ValueError(f"huggingface.{key}: {why}")
        return data


class HuggingfaceSource(BaseModel):
    """The keys of a type 'huggingface' dataset entry (a mixin of ImageDataset)."""

    dataset_name: str | None = field(
        None, "Type 'huggingface': the dataset's hub id (user/name), or a local folder in the hub's layout (parquet "
        "files under data/ with a README.md card, or an image folder with metadata.jsonl); read with datasets' "
        "load_dataset either way. Private or gated datasets: log in (hf auth login) or set HF_TOKEN. A folder "
        "written by save_to_disk is not read (SimpleTuner does not read one either): write it with to_parquet.",
        "data", min_length=1, advanced=True,
    )
    dataset_config: str | None = field(
        None, "Type 'huggingface': the dataset's configuration (subset) name, for datasets that have several.",
        "data", min_length=1, advanced=True,
    )
    data_files: DataFiles | None = field(
        None, "Type 'huggingface': which of the dataset's files to read (a pattern, a list, or split -> files), as "
        "datasets' load_dataset takes them.", "data", advanced=True,
    )
    split: str = field(
        "train", "Type 'huggingface': the split to download ('train[:1000]' slices work without streaming).",
        "data", min_length=1, advanced=True,
    )
    revision: str | None = field(
        None, "Type 'huggingface': a branch, tag or commit of the hub dataset. Empty: the main branch.", "data",
        min_length=1, advanced=True,
    )
    image_column: str = field(
        "image", "Type 'huggingface', image datasets: the column of images (datasets' Image feature, or bytes). "
        "Each image is written with its original bytes and format; one in a format not trained from (not jpg, "
        "png, webp, bmp, gif, tiff or avif) is re-encoded to PNG.", "data", min_length=1, advanced=True,
    )
    video_column: str = field(
        "video", "Type 'huggingface', video datasets: the column of clips (datasets' Video feature, or bytes), "
        "written with their original bytes (.mp4, .mov, .webm or .mkv).", "data", min_length=1, advanced=True,
    )
    caption_column: str | list[str] = field(
        "caption", "Type 'huggingface' with caption_strategy 'huggingface': the caption column, or a list of columns "
        "(each a caption, one drawn per sample); a column of lists gives several captions; 'a.b' reads key b of a "
        "dict column. Written one caption per line to the caption file beside each image.", "data", advanced=True,
    )
    fallback_caption_column: str | None = field(
        None, "Type 'huggingface': the column read when caption_column is empty for a row. A row with neither is "
        "reported and left out. (SimpleTuner also falls back on a 'description' column by itself; difftune reads "
        "only the columns named.)", "data", min_length=1, advanced=True,
    )
    cache_dir: str | None = field(
        None, "Type 'huggingface': datasets' own cache folder for the download (its arrow copy). Empty: datasets' "
        "default (HF_DATASETS_CACHE, ~/.cache/huggingface/datasets).", "data", min_length=1, advanced=True,
    )
    streaming: bool = field(
        False, "Type 'huggingface': read the rows as a stream, writing each file as it arrives, with no full copy "
        "in datasets' cache first (SimpleTuner cannot stream). A finished streamed download is not read again: "
        "difftune trusts the folder while its manifest says it is complete and every file is there. Not with "
        "split slices or num_proc.", "data", advanced=True,
    )
    num_proc: int | None = field(
        None, "Type 'huggingface': processes datasets uses to download and prepare the dataset (load_dataset's "
        "num_proc; SimpleTuner uses it for its row filter). Not with streaming.", "data", ge=1, advanced=True,
    )
    huggingface: HuggingfaceBlock | None = field(
        None, "Type 'huggingface': SimpleTuner's block of the same keys (dataset_name, split, caption_column, "
        "fallback_caption_column, streaming, cache_dir, ...); a key may be given here or at the top level.",
        "data", advanced=True,
    )

    @model_validator(mode="before")
    @classmethod
    def huggingface_defaults(cls, data: Any) -> Any:
        """As in SimpleTuner, a huggingface entry without caption_strategy reads its caption column."""
        if isinstance(data, dict) and data.get("type") == TYPE and data.get("caption_strategy") is None:
            data = {**data, "caption_strategy": TYPE}
        return data

    @model_validator(mode="after")
    def huggingface_checks(self) -> Any:
        given = self.model_fields_set
        kind: Any = getattr(self, "type", None)
        if kind != TYPE:
            for key in KEYS:
                # a value other than its default: a dumped entry (model_dump) validates again unchanged
                if key in given and getattr(self, key) not in (None, type(self).model_fields[key].default):
                    raise ValueError(f"{key} belongs to type 'huggingface' datasets; this one is type {kind!r}: "
                                     "remove it or set type to 'huggingface'")
            if getattr(self, "metadata_backend", None) == TYPE:
                raise ValueError(f"metadata_backend 'huggingface' belongs to type 'huggingface' datasets; this one "
                                 f"is type {kind!r}: use 'discovery'")
            return self
        _fold_block(self)
        given = self.model_fields_set
        if not self.dataset_name:
            raise ValueError("type 'huggingface' needs dataset_name: the hub id (user/name) or a local folder in "
                             "the hub's layout")
        strategy = getattr(self, "caption_strategy", None)
        if strategy not in (TYPE, "instanceprompt"):
            raise ValueError(f"caption_strategy {strategy!r} does not go with type 'huggingface' (its files are "
                             "named by row number, and the download writes their caption files from caption_column); "
                             "use 'huggingface' or 'instanceprompt'")
        if strategy == "instanceprompt":
            for key in ("caption_column", "fallback_caption_column"):
                if key in given and getattr(self, key) is not None:
                    raise ValueError(f"{key} is not read with caption_strategy 'instanceprompt' (every image gets "
                                     "instance_prompt); remove it or use caption_strategy 'huggingface'")
        columns = self.caption_column if isinstance(self.caption_column, list) else [self.caption_column]
        if not columns or not all(columns):
            raise ValueError("caption_column needs a column name (or a list of them), not an empty one")
        clips = getattr(self, "video", None) is not None or getattr(self, "dataset_type", None) == "video"
        unused = "image_column" if clips else "video_column"
        if unused in given and getattr(self, unused) != type(self).model_fields[unused].default:
            raise ValueError(f"{unused} is not read by a {'video' if clips else 'image'} dataset (it reads "
                             f"{'video_column' if clips else 'image_column'}); remove it")
        if self.streaming and self.num_proc is not None:
            raise ValueError("num_proc parallelises datasets' download before the rows are read, which streaming "
                             "skips; remove num_proc or streaming")
        if self.streaming and "[" in self.split:
            raise ValueError(f"split {self.split!r} slices the split, which datasets cannot do while streaming; "
                             "remove the slice or streaming")
        return self


def _fold_block(entry: Any) -> None:
    """Move the `huggingface` block's keys to the top level, refusing one given in both places differently."""
    block = entry.huggingface
    if block is None:
        return
    for key in SHARED:
        value = getattr(block, key)
        if value is None:
            continue
        if key in entry.model_fields_set and getattr(entry, key) != value:
            raise ValueError(f"{key} is given twice, {getattr(entry, key)!r} at the top level and {value!r} in the "
                             "huggingface block; keep one")
        setattr(entry, key, value)
        entry.model_fields_set.add(key)
