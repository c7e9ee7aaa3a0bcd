"""Type 'csv' datasets (config/source_csv_keys.py, data/sources/csv_table.py): the keys and their misuse, and the
download from a real HTTP server on this machine (http.server in a thread: the network edge, not a mock) and
from local paths, into a folder that then trains like any other."""

from __future__ import annotations

import csv
import hashlib
import json
import re
import shutil
import threading
from collections import Counter
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from PIL import Image

from conftest import config_problems, write_config
from difftune.config import ImageDataset, load_config
from difftune.data.sources import SourceError, csv_table
from difftune.demo import make_dataset


@dataclass
class Site:
    root: Path  # the files the server serves
    url: str
    hits: Counter  # requests per path


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A real HTTP server on 127.0.0.1 over tmp_path/site. Special paths: /status/<code>/... answers that code
    (with Retry-After: 0, so retries are quick); /flaky/<file> answers 503 twice, then the file; /noext/<stem>
    serves <stem>.png with no extension in the URL (the type is in the Content-Type only)."""
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    root = tmp_path / "site"
    make_dataset(root, count=4)
    hits: Counter = Counter()

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):  # keep the test output clean
            pass

        def answer(self, code: int, body: bytes = b"", kind: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            path = urlsplit(self.path).path
            hits[path] += 1
            if path.startswith("/status/"):
                return self.answer(int(path.split("/")[2]))
            if path.startswith("/flaky/"):
                if hits[path] <= 2:
                    return self.answer(503)
                self.path = self.path.removeprefix("/flaky")
            if path.startswith("/noext/"):
                return self.answer(200, (root / f"{path.rsplit('/', 1)[1]}.png").read_bytes(), "image/png")
            return super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield Site(root, f"http://127.0.0.1:{server.server_address[1]}", hits)
    server.shutdown()
    server.server_close()


def images(site: Site) -> list[Path]:
    return sorted(site.root.glob("*.png"))


def write_table(path: Path, rows: list[tuple[str, str]], header=("url", "caption")) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def entry(table: Path, folder: Path, **keys) -> ImageDataset:
    return ImageDataset.model_validate({"id": "web", "type": "csv", "csv_file": str(table),
                                        "csv_caption_column": "caption", "csv_cache_dir": str(folder), **keys})


def fetch(ds: ImageDataset) -> list[str]:
    said: list[str] = []
    csv_table.fetch(ds, Path(ds.instance_data_dir), said.append)
    return said


def name(location: str, suffix: str = ".png") -> str:
    return hashlib.sha256(location.encode()).hexdigest()[:16] + suffix


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


# --- config -----------------------------------------------------------------------------------------------------


def test_keys_parse_and_the_folder_is_csv_cache_dir(tmp_path, dataset):
    table = write_table(tmp_path / "list.csv", [("a.png", "a")])
    base = {"type": "csv", "csv_file": str(table), "csv_caption_column": "caption", "instance_data_dir": None}
    run = load_config(write_config(tmp_path, dataset, dataset={**base, "caption_strategy": "csv",
                                                               "csv_cache_dir": str(tmp_path / "dl")}))
    ds = run.datasets.images[0]
    assert (ds.type, ds.instance_data_dir, ds.csv_url_column, ds.caption_strategy) == ("csv", str(tmp_path / "dl"),
                                                                                       "url", "csv")
    # no folder at all: cache/sources/<id>; no caption_strategy: the caption column (SimpleTuner accepts it unset)
    entry_ = {k: v for k, v in base.items() if k != "instance_data_dir"}
    plain = ImageDataset.model_validate({"id": "web", **entry_})
    assert (plain.instance_data_dir, plain.caption_strategy) == ("cache/sources/web", "csv")
    # both folders, the same one spelt differently: accepted
    same = ImageDataset.model_validate({"id": "web", **entry_, "csv_cache_dir": "dl/", "instance_data_dir": "./dl"})
    assert same.instance_data_dir == "./dl"
    # instanceprompt needs no caption column
    prompt = ImageDataset.model_validate({"id": "web", "type": "csv", "csv_file": str(table),
                                          "caption_strategy": "instanceprompt", "instance_prompt": "sks"})
    assert prompt.csv_caption_column is None


@pytest.mark.parametrize(("keys", "expected"), [
    ({"type": "local", "csv_file": "x.csv"}, "csv_file belongs to datasets of type 'csv'"),
    ({"type": "local", "csv_url_column": "link", "csv_cache_dir": "dl"}, "csv_url_column, csv_cache_dir belong"),
    ({"type": "csv", "csv_caption_column": "caption"}, "type 'csv' needs csv_file"),
    ({"type": "csv", "csv_file": "x.csv"}, "caption_strategy 'csv' needs csv_caption_column"),
    ({"type": "csv", "csv_file": "https://host/x.csv", "csv_caption_column": "c"},
     "csv_file 'https://host/x.csv' is a URL"),
    ({"type": "csv", "csv_file": "x.csv", "csv_caption_column": "c", "caption_strategy": "filename"},
     "caption_strategy 'filename' does not work with type 'csv'"),
    ({"type": "csv", "csv_file": "x.csv", "csv_caption_column": "c", "caption_strategy": "textfile"},
     "caption_strategy 'textfile' does not work with type 'csv'"),
    ({"type": "csv", "csv_file": "x.csv", "csv_caption_column": "c", "caption_strategy": "instanceprompt",
      "instance_prompt": "sks"}, "csv_caption_column is read with caption_strategy 'csv'"),
    ({"type": "csv", "csv_file": "x.csv", "csv_caption_column": "c", "csv_cache_dir": "a", "instance_data_dir": "b"},
     "csv_cache_dir 'a' and instance_data_dir 'b' name different folders"),
    ({"type": "csv", "csv_file": "x.csv", "csv_caption_column": "c", "csv_url_column": ""}, "csv_url_column is empty"),
    ({"type": "local", "caption_strategy": "csv"}, "caption_strategy 'csv' reads the captions of a type 'csv'"),
])
def test_misuse_is_refused_with_the_key(tmp_path, dataset, keys, expected):
    if keys["type"] == "csv":  # write_config's entry says 'textfile'; a csv entry leaves it unset
        keys = {"caption_strategy": None, **keys}
    text = config_problems(write_config(tmp_path, dataset, dataset=keys))
    assert expected in text, text
    assert "not implemented yet" not in text


# --- fetch ------------------------------------------------------------------------------------------------------


def test_fetch_reuse_complete_and_prune(tmp_path, site):
    pngs = images(site)
    (tmp_path / "tables" / "local").mkdir(parents=True)
    shutil.copy(pngs[2], tmp_path / "tables" / "local" / "rel.png")
    rows = [(f"{site.url}/{pngs[0].name}", "first\nline"),
            (f"{site.url}/flaky/{pngs[1].name}", "flaky"),  # two 503s, then the file
            ("local/rel.png", "relative to the table"),
            (pngs[3].as_uri(), "a file:// URL"),
            (f"{site.url}/noext/{pngs[0].stem}", "type from the Content-Type")]
    table = write_table(tmp_path / "tables" / "list.csv", rows)
    folder = tmp_path / "dl"
    said = fetch(entry(table, folder))
    expected = sorted([name(u) for u, _ in rows] + [name(u, ".txt") for u, _ in rows])
    assert files(folder) == expected, said
    assert (folder / name(rows[0][0], ".txt")).read_text() == "first line\n"  # newlines in a caption: spaces
    assert Image.open(folder / name(rows[4][0])).format == "PNG"
    assert (folder / name(rows[2][0])).read_bytes() == pngs[2].read_bytes()
    assert site.hits[f"/flaky/{pngs[1].name}"] == 3
    assert said[-1].startswith("dataset 'web': 5 fetched, 0 reused, 0 skipped")
    manifest = json.loads((folder / ".difftune-source.json").read_text())
    assert manifest["type"] == "csv" and manifest["csv_file"] == str(table.resolve())

    # a second fetch asks the server nothing and changes nothing
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    requests_so_far = sum(site.hits.values())
    said = fetch(entry(table, folder))
    assert sum(site.hits.values()) == requests_so_far
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert said[-1].startswith("dataset 'web': 0 fetched, 5 reused, 0 skipped")

    # a partial folder (a killed run: one file missing, a temporary file left) is completed
    (folder / name(rows[0][0])).unlink()
    (folder / f".{name(rows[0][0], '')}.0123.part").write_bytes(b"half")
    said = fetch(entry(table, folder))
    assert files(folder) == expected and not list(folder.glob(".*.part"))
    assert said[-1].startswith("dataset 'web': 1 fetched, 4 reused, 0 skipped")

    # an edited table: a caption changed, a row gone (its download is removed), a row added
    rows2 = [(rows[0][0], "new caption"), *rows[1:4], (f"{site.url}/{pngs[3].name}", "added")]
    write_table(table, rows2)
    said = fetch(entry(table, folder))
    assert (folder / name(rows[0][0], ".txt")).read_text() == "new caption\n"
    assert not (folder / name(rows[4][0])).exists() and not (folder / name(rows[4][0], ".txt")).exists()
    assert (folder / name(rows2[4][0])).is_file()
    assert any("removed 1 earlier download" in s for s in said), said


def test_broken_rows_are_reported_and_skipped(tmp_path, site, monkeypatch):
    monkeypatch.setattr(csv_table, "BACKOFF_S", 0.01)  # the connection-refused row's waits
    good = images(site)[0]
    (site.root / "page.png").write_text("<html>not an image</html>")
    closed = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    dead = f"http://127.0.0.1:{closed.server_address[1]}/x.png"
    closed.server_close()  # nothing listens there now
    rows = [(f"{site.url}/{good.name}", "good"),
            (f"{site.url}/missing.png?token=SECRET", "404"),
            (f"{site.url}/status/500/a.png", "always 500"),
            (f"{site.url}/status/429/b.png", "always 429"),
            (f"{site.url}/page.png", "html"),
            (dead, "refused"),
            ("", "no url"),
            (f"{site.url}/{images(site)[1].name}", ""),
            ("s3://bucket/key.png", "other scheme"),
            ("nowhere/none.png", "no such file"),
            (f"{site.url}/{good.name}", "good, last caption wins")]
    folder = tmp_path / "dl"
    said = fetch(entry(write_table(tmp_path / "list.csv", rows), folder))
    text = "\n".join(said)
    assert files(folder) == sorted([name(rows[0][0]), name(rows[0][0], ".txt")]), text
    assert (folder / name(rows[0][0], ".txt")).read_text() == "good, last caption wins\n"
    for line, reason in [(3, "HTTP 404"), (4, "HTTP 500 Internal Server Error (4 tries)"), (5, "HTTP 429"),
                         (6, "not a readable image"), (7, "ConnectionError"), (8, "the 'url' column is empty"),
                         (9, "the 'caption' column is empty"), (10, "cannot fetch s3:// locations"),
                         (11, "no such file")]:
        assert any(re.search(rf"csv_file line {line}\b", s) and reason in s for s in said), (line, text)
    assert "1 row(s) repeat the location of an earlier row (csv_file line 12)" in text
    assert site.hits["/status/500/a.png"] == csv_table.ATTEMPTS and site.hits["/missing.png"] == 1
    assert "SECRET" not in text and "missing.png?***" in text
    assert said[-1].startswith("dataset 'web': 1 fetched, 0 reused, 9 skipped")


def test_sources_that_cannot_be_read(tmp_path, site):
    table = write_table(tmp_path / "list.csv", [(f"{site.url}/{images(site)[0].name}", "c")])
    with pytest.raises(SourceError, match=r"dataset 'web': csv_file .*nope.csv' is not a file; fix csv_file"):
        fetch(entry(tmp_path / "nope.csv", tmp_path / "dl"))
    with pytest.raises(SourceError,
                       match=r"has no column 'link' \(its columns: 'url', 'caption'\); fix csv_url_column"):
        fetch(entry(table, tmp_path / "dl", csv_url_column="link"))
    with pytest.raises(SourceError, match="has no column 'text'.*fix csv_caption_column"):
        fetch(entry(table, tmp_path / "dl", csv_caption_column="text"))
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(SourceError, match="is empty; its first line must name the columns"):
        fetch(entry(tmp_path / "empty.csv", tmp_path / "dl"))


def test_a_folder_of_something_else_is_refused(tmp_path, site):
    table = write_table(tmp_path / "list.csv", [(f"{site.url}/{images(site)[0].name}", "c")])
    other = write_table(tmp_path / "other.csv", [(f"{site.url}/{images(site)[1].name}", "c")])
    foreign = tmp_path / "hub"
    foreign.mkdir()
    (foreign / ".difftune-source.json").write_text(json.dumps({"type": "huggingface", "dataset_name": "x/y"}))
    with pytest.raises(SourceError, match="instance_data_dir .* holds the download of a dataset of type 'huggingface'"):
        fetch(entry(table, foreign))
    fetch(entry(table, tmp_path / "dl"))
    with pytest.raises(SourceError, match="holds the download of another table"):
        fetch(entry(other, tmp_path / "dl"))
    with pytest.raises(SourceError, match=r"already holds files that are not a download of this table \(\d{3}-"):
        fetch(entry(table, site.root))  # the user's own images: never mixed with downloads, never deleted
    assert len(images(site)) == 4


def test_other_column_names(tmp_path, site):
    """csv_url_column and csv_caption_column pick the columns (a spreadsheet's BOM and extra columns are fine)."""
    link = f"{site.url}/{images(site)[0].name}"
    table = tmp_path / "l.csv"
    table.write_text(f'id,link,url,text\n1,{link},{site.url}/wrong.png,"the caption"\n', encoding="utf-8-sig")
    said = fetch(entry(table, tmp_path / "dl", csv_url_column="link", csv_caption_column="text"))
    assert files(tmp_path / "dl") == sorted([name(link), name(link, ".txt")]), said
    assert (tmp_path / "dl" / name(link, ".txt")).read_text() == "the caption\n"


def test_one_local_file_spelt_several_ways_is_one_row(tmp_path, site):
    """A path, ./path and a file:// URL of one file were three files: one image trained three times, under
    three captions."""
    local = tmp_path / "pics"
    local.mkdir()
    shutil.copy(images(site)[0], local / "a.png")
    rows = [("pics/a.png", "first"), ("./pics/a.png", "second"), ((local / "a.png").as_uri(), "last")]
    said = fetch(entry(write_table(tmp_path / "l.csv", rows), tmp_path / "dl"))
    assert files(tmp_path / "dl") == sorted([name("pics/a.png"), name("pics/a.png", ".txt")]), said
    assert (tmp_path / "dl" / name("pics/a.png", ".txt")).read_text() == "last\n"
    assert any("2 row(s) repeat the location of an earlier row (csv_file line 3, 4)" in s for s in said), said


def test_instanceprompt_writes_no_captions(tmp_path, site):
    rows = [(f"{site.url}/{p.name}", "") for p in images(site)[:2]]
    table = write_table(tmp_path / "l.csv", rows)
    ds = ImageDataset.model_validate({"id": "web", "type": "csv", "csv_file": str(table),
                                      "caption_strategy": "instanceprompt", "instance_prompt": "sks",
                                      "instance_data_dir": str(tmp_path / "dl")})
    fetch(ds)
    assert files(tmp_path / "dl") == sorted(name(u) for u, _ in rows)


def test_video_datasets_take_clips(tmp_path, site):
    from families import make_clips

    make_clips(site.root / "clips", count=1, frames=9)
    rows = [(f"{site.url}/clips/clip0.mp4", "a clip"), (f"{site.url}/{images(site)[0].name}", "an image")]
    ds = entry(write_table(tmp_path / "l.csv", rows), tmp_path / "dl", dataset_type="video")
    said = fetch(ds)
    assert files(tmp_path / "dl") == sorted([name(rows[0][0], ".mp4"), name(rows[0][0], ".txt")])
    reason = "not a clip (.png, image/png); a video dataset takes .avi, .gif, .m4v, .mkv, .mov, .mp4, .mpeg, .mpg, .webm"
    assert any("csv_file line 3" in s and reason in s for s in said), said


# --- end to end -------------------------------------------------------------------------------------------------


def test_trains_on_a_csv_dataset(tmp_path, site):
    from difftune.train.loop import train
    from difftune.train.plan import discover_all
    from difftune.train.setup import build_run

    rows = [(f"{site.url}/{p.name}", p.with_suffix(".txt").read_text()) for p in images(site)]
    table = write_table(tmp_path / "list.csv", rows)
    folder = tmp_path / "dl"
    path = write_config(tmp_path, folder, max_train_steps=2, dataset={
        "type": "csv", "csv_file": str(table), "csv_caption_column": "caption", "caption_strategy": "csv"})
    found = discover_all(load_config(path))  # fetches first, as `difftune check` does
    assert sorted(s.caption for s in found[0].samples) == sorted(c for _, c in rows)
    assert sorted(s.path.name for s in found[0].samples) == sorted(name(u) for u, _ in rows)
    requests_so_far = sum(site.hits.values())
    run = build_run(load_config(path))
    train(run)
    assert sum(site.hits.values()) == requests_so_far  # the run reused the download
    steps = [json.loads(x) for x in (run.output_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in steps if e["event"] == "step"] == [1, 2]
    assert any(e["event"] == "info" and "0 fetched, 4 reused, 0 skipped" in e.get("message", "") for e in steps)


def test_rows_skipped_while_downloading_are_in_the_data_report(tmp_path, site):
    from difftune.data.report import DataReport
    from difftune.train.plan import discover_all

    good = images(site)
    rows = [(f"{site.url}/{good[0].name}", "good"), (f"{site.url}/missing.png", "404"),
            (f"{site.url}/{good[1].name}", ""), (f"{site.url}/{good[2].name}", "also good")]
    path = write_config(tmp_path, tmp_path / "dl", dataset={
        "type": "csv", "csv_file": str(write_table(tmp_path / "list.csv", rows)), "csv_caption_column": "caption",
        "caption_strategy": "csv"})
    for _ in range(2):  # downloaded, then reused: the skipped rows are still said
        found = discover_all(load_config(path))
        report = DataReport(found, [], {}).render()
        assert len(found[0].samples) == 2, report
        assert re.search(r"\s4\s+2\s+2\n", report), report  # found, used, left out
        assert re.search(r"csv_file line 3 \(\S+missing.png\): HTTP 404 .*\(skipped while downloading\)", report), report
        assert "csv_file line 4 (" in report and "the 'caption' column is empty" in report, report
