"""Dataset-entry keys of type 'csv': a CSV table of image URLs or paths and captions. data/sources/csv_table.py
downloads it into instance_data_dir before discovery.

SimpleTuner's keys (its "Train directly from CSV URL list"): `csv_file`, `csv_url_column` (default 'url'),
`csv_caption_column`, `csv_cache_dir`, with `caption_strategy: csv`. Where difftune differs, the key's description
says so: `csv_cache_dir` is optional (the folder is instance_data_dir, default cache/sources/<id>), and
caption_strategy 'instanceprompt' works without a caption column.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, model_validator

from difftune.config.fields import field

CSV_KEYS = ("csv_file", "csv_url_column", "csv_caption_column", "csv_cache_dir", "csv_hash_filenames",
            "shorten_filenames")
# What a csv dataset's captions can come from: the caption column, or instance_prompt for every image. The
# downloads are named by a hash of their URL, so 'filename' would caption them with hashes; 'textfile' and
# 'parquet' read files that the download does not make.
CSV_CAPTION_STRATEGIES = ("csv", "instanceprompt")


def _same_folder(a: str, b: str) -> bool:
    return os.path.normpath(os.path.expanduser(a)) == os.path.normpath(os.path.expanduser(b))


class CsvSource(BaseModel):
    """The keys of a type 'csv' dataset entry (a mixin of ImageDataset)."""

    csv_file: str | None = field(
        None, "Type 'csv': the CSV table, a local file whose first line names its columns (a relative path is taken "
        "from the current folder, like instance_data_dir). Each row is one image (or clip): its location in "
        "csv_url_column, its caption in csv_caption_column. A location that appears in several rows is downloaded "
        "once, with the caption of its last row (as SimpleTuner).", "data", advanced=True,
    )
    csv_url_column: str = field(
        "url", "Type 'csv': the column holding each file's location: an http(s) URL (downloaded with retries), a "
        "file:// URL or a path (absolute, or relative to the CSV file's folder; copied, or hard-linked on the same "
        "disk). Files are named by a hash of the location, with its extension (from the URL, else the server's "
        "Content-Type). A row with an empty location, a file that cannot be fetched or is not an image (not a clip, "
        "for a video dataset) is reported and skipped.", "data", advanced=True,
    )
    csv_caption_column: str | None = field(
        None, "Type 'csv': the column holding each file's caption, written to a caption file beside it (newlines "
        "become spaces). Required with caption_strategy 'csv'; a row whose caption is empty is reported and "
        "skipped. Not used with caption_strategy 'instanceprompt' (which SimpleTuner does not allow here).", "data",
        advanced=True,
    )
    csv_cache_dir: str | None = field(
        None, "Type 'csv': the folder the files are downloaded into (SimpleTuner's name for instance_data_dir): set "
        "one of the two, or both to the same folder. Optional here (SimpleTuner requires it): the default is "
        "cache/sources/<id>. The folder holds only this table's downloads: files whose rows are gone from csv_file "
        "are removed, and a folder holding other files is refused.", "data", advanced=True,
    )

    # SimpleTuner names a download after its URL's file name unless hash_filenames, and shortens and cleans such
    # names with shorten_filenames (csv_shorten_filenames is its other spelling). Here files are always named by a
    # hash of their location: only the values that give that are accepted.
    csv_hash_filenames: bool | None = field(
        None, "Type 'csv': SimpleTuner's choice between files named by a hash of their location (true) and by the "
        "URL's file name (false; also spelt hash_filenames on a csv entry). Files here are always named by a hash "
        "(16 hex digits and the extension), which keeps names unique and short: true is accepted, false is refused.",
        "data", advanced=True,
    )
    shorten_filenames: bool | None = field(
        None, "Type 'csv': SimpleTuner shortens and cleans file names taken from URLs (also spelt "
        "csv_shorten_filenames). Names here are hashes, already short: true is accepted; false (keeping long URL "
        "names) is refused, except beside csv_hash_filenames true, where SimpleTuner hashes the names as well.",
        "data", advanced=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _csv_caption_default(cls, data: Any) -> Any:
        """A csv entry without caption_strategy reads the caption column (SimpleTuner accepts it unset)."""
        if isinstance(data, dict) and data.get("type") == "csv" and data.get("caption_strategy") is None:
            data = {**data, "caption_strategy": "csv"}
        return data

    @model_validator(mode="after")
    def _csv_keys(self) -> Any:
        kind, strategy = getattr(self, "type", "local"), getattr(self, "caption_strategy", None)
        if kind != "csv":
            # a value other than its default: a dumped entry (model_dump) validates again unchanged
            stray = [k for k in CSV_KEYS
                     if k in self.model_fields_set and getattr(self, k) not in (None, type(self).model_fields[k].default)]
            if stray:
                raise ValueError(f"{', '.join(stray)} belong{'s' if len(stray) == 1 else ''} to datasets of type "
                                 f"'csv'; this one is type {kind!r}: remove {'it' if len(stray) == 1 else 'them'} "
                                 "or set type to 'csv'")
            return self
        if not self.csv_file:
            raise ValueError("type 'csv' needs csv_file: the path of the CSV table of image URLs (or paths) and "
                             "captions")
        if "://" in self.csv_file:
            raise ValueError(f"csv_file {self.csv_file!r} is a URL; it must be a local file: download the table and "
                             "give its path")
        if strategy not in CSV_CAPTION_STRATEGIES:
            raise ValueError(f"caption_strategy {strategy!r} does not work with type 'csv' (its files are named by a "
                             "hash of their URL and come with no caption files); use 'csv' (the csv_caption_column "
                             "of the table) or 'instanceprompt'")
        if strategy == "csv" and not self.csv_caption_column:
            raise ValueError("caption_strategy 'csv' needs csv_caption_column: the column of csv_file holding the "
                             "captions (or use caption_strategy 'instanceprompt' with instance_prompt)")
        if strategy != "csv" and self.csv_caption_column:
            raise ValueError(f"csv_caption_column is read with caption_strategy 'csv'; with {strategy!r} it would be "
                             "ignored: remove it or set caption_strategy to 'csv'")
        if self.csv_hash_filenames is False:
            raise ValueError("not implemented yet: csv_hash_filenames false (files named after their URLs); a csv "
                             "dataset's files are named by a hash of their location: set it to true or remove it")
        if self.shorten_filenames is False and not self.csv_hash_filenames:
            raise ValueError("not implemented yet: shorten_filenames false (files keeping their URL's full name); a "
                             "csv dataset's files are named by a short hash of their location: set it to true or "
                             "remove it")
        if not self.csv_url_column:
            raise ValueError("csv_url_column is empty; name the column of csv_file holding the URLs (default 'url')")
        folder = getattr(self, "instance_data_dir", None)
        if self.csv_cache_dir and folder and not _same_folder(self.csv_cache_dir, folder):
            raise ValueError(f"csv_cache_dir {self.csv_cache_dir!r} and instance_data_dir {folder!r} name different "
                             "folders; a csv dataset is downloaded into one folder: remove one of them (or make them "
                             "the same)")
        return self
