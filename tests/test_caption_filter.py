"""caption_filter_list (a text_embeds entry's key, as in SimpleTuner): what each kind of filter does, the three ways
to give the list, the refusals at config load, captions the filters empty, and the path from discovery to what the
text cache encodes. No model is loaded."""

import json

import pytest
import torch

from conftest import config_problems as problems
from conftest import write_config
from difftune.config import load_config
from difftune.data.cache import TensorCache, fill_text_cache
from difftune.data.caption_filter import CaptionFilter, FilterError
from difftune.data.captions import CaptionRule, caption
from difftune.data.latents import text_jobs
from difftune.data.report import DataReport
from difftune.demo import make_dataset
from difftune.train.plan import discover_all


def filtered(entries, text):
    return CaptionFilter.parse([(f"entry {n}", e) for n, e in enumerate(entries, 1)]).apply(text)


# --- what the filters do --------------------------------------------------------------------------------------


def test_plain_and_regex_filters_remove_what_they_match():
    assert filtered(["arafed "], "an arafed man beside an arafed dog") == "an man beside an dog"
    assert filtered(["^there is "], "there is a cat; there is a dog") == "a cat; there is a dog"
    assert filtered(["this .* has a "], "look: this old box has a lid") == "look: lid"
    # written as is first, then as a regex (SimpleTuner's two passes): the brackets go, then any bare word left
    assert filtered(["(blurry)"], "a (blurry) photo, slightly blurry") == "a photo, slightly"
    assert filtered(["cat"], "a Cat and a cat") == "a Cat and a"  # case matters ...
    assert filtered(["(?i)cat"], "a Cat and a cat") == "a and a"  # ... unless the regex says otherwise


def test_substitutions_follow_sed():
    assert filtered(["s/this/that/"], "this and this") == "that and this"  # the first match, as documented
    assert filtered(["s/this/that/g"], "this and this") == "that and that"
    assert filtered(["s/THIS/that/gi"], "This and this") == "that and that"
    assert filtered([r"s/(\w+) (\w+)/\2 \1/"], "red ball") == "ball red"
    assert filtered([r"s/a\/b/c\/d/g"], "x a/b y") == "x c/d y"
    assert filtered([r"s/cat/[\g<0>]/"], "a cat") == "a [cat]"


def test_filters_run_in_order_and_only_changed_captions_are_tidied():
    assert filtered(["s/cat/dog/", "dog "], "a cat sleeps") == "a sleeps"
    assert filtered(["dog ", "s/cat/dog/"], "a cat sleeps") == "a dog sleeps"
    assert filtered(["red"], "a  red\tball ") == "a ball"  # changed: runs of spaces become one, ends stripped
    assert filtered(["green"], "a  red\tball ") == "a  red\tball "  # unchanged: byte for byte (its cache key stays)
    assert filtered(["red"], "red line one\n\n\n\n  line  two ") == "line one\n\nline two"  # one blank line kept


@pytest.mark.parametrize("entry,says", [
    ("(", "not a valid regular expression"), ("s/a/b", "add the closing '/'"), ("s/a/b/x", "unknown flag(s) 'x'"),
    ("s//b/", "the find part is empty"), ("s/(/x/", "fix the find part"), (r"s/a/\2/", "the replacement is not valid"),
    ("  ", "only spaces"), ("s/a", "write s\\/ to remove"),
])
def test_bad_filters_are_refused(entry, says):
    with pytest.raises(FilterError) as info:
        CaptionFilter.parse([("line 4", "ok"), ("line 5", entry)])
    assert info.value.label == "line 5" and says in str(info.value)


# --- giving the list: a .txt file, a .json file, the list itself -------------------------------------------------


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("filter-images")
    paths = make_dataset(folder, count=3)
    captions = ["The image shows an arafed cat on a mat", "The image shows a dog  on a rug\nthe image shows a dog",
                "The image shows"]
    for path, text in zip(paths, captions, strict=True):
        path.with_suffix(".txt").write_text(text)
    return folder


def config_with(tmp_path, images, filters, **dataset):
    path = write_config(tmp_path, images, dataset=dataset)
    backend = tmp_path / "config" / "multidatabackend.json"
    entries = json.loads(backend.read_text())
    entries[-1]["caption_filter_list"] = filters
    backend.write_text(json.dumps(entries))
    return path


def discovered(path):
    (found,) = discover_all(load_config(path), write_metadata=False, fetch=False)
    return found


FILTERS = ["The image shows ", "arafed ", "s/ on a / upon a /", "^the image shows "]


def test_txt_json_and_inline_lists_filter_alike(tmp_path, images, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths are taken from the working folder, as instance_data_dir's are
    windows, unix = "\r\n".join(FILTERS[:2]), "\n".join(FILTERS[2:])
    (tmp_path / "filters.txt").write_text(f"\ufeff{windows}\r\n\r\n{unix}\n")  # a BOM, CRLF, a blank line
    (tmp_path / "filters.json").write_text(json.dumps(FILTERS))
    results = [sorted(s.captions for s in discovered(config_with(tmp_path, images, value)).samples)
               for value in ("filters.txt", "filters.json", FILTERS)]
    assert results[0] == results[1] == results[2]
    # "The image shows " keeps its trailing space (a txt line loses only its line break), so a caption that is
    # only "The image shows" stays; the BOM and the Windows line ends are not part of any filter
    assert results[0] == [("The image shows",), ("a dog upon a rug", "a dog"), ("an cat upon a mat",)]
    assert sorted(s.captions for s in discovered(config_with(tmp_path, images, [])).samples) == [
        ("The image shows",), ("The image shows a dog  on a rug", "the image shows a dog"),
        ("The image shows an arafed cat on a mat",)]  # off ([]): the captions as written


@pytest.mark.parametrize("content,name,says", [
    ("ok\nfine\n(unclosed\n", "f.txt", "f.txt line 3 '(unclosed': not a valid regular expression"),
    ("ok\ns/x/y\n", "f.txt", "f.txt line 2 's/x/y': a substitution ends with '/'"),
    ('["ok", 7]', "f.json", "f.json entry 2 7: a filter is a string"),
    ('{"filters": []}', "f.json", "a list of strings, got dict"),
    ('["ok",]', "f.json", "trailing comma"),
    ("\n\n", "f.txt", "has no filters"),
    ("ok", "f.yaml", "give a .txt file"),
])
def test_bad_lists_are_refused_at_config_load(tmp_path, images, content, name, says):
    (tmp_path / name).write_text(content)
    text = problems(config_with(tmp_path, images, str(tmp_path / name)))
    assert "dataset 'text-embeds': caption_filter_list: " in text and says in text


def test_a_missing_file_and_bad_list_entries_are_refused(tmp_path, images):
    text = problems(config_with(tmp_path, images, "nowhere/filters.txt"))
    assert "'nowhere/filters.txt': the caption filter list file does not exist" in text and "working folder" in text
    assert "entry 2 'a(': not a valid regular expression" in problems(config_with(tmp_path, images, ["ok", "a("]))
    assert "escape the regular-expression characters" in problems(config_with(tmp_path, images, ["a("]))


# --- captions the filters empty, instance prompts -----------------------------------------------------------


def test_emptied_captions_are_reported_and_fall_back_like_an_empty_caption_file(tmp_path, images):
    found = discovered(config_with(tmp_path, images, ["(?i)the image shows ?"]))
    assert sorted(s.captions for s in found.samples) == [
        ("",), ("a dog on a rug", "a dog"), ("an arafed cat on a mat",)]
    assert [(p.name[:4], n) for p, n in found.notes] == [
        ("002-", "caption_filter_list left nothing of its caption: trained with an empty prompt")]
    assert (found.captions_changed, found.captions_emptied) == (4, 1)
    report = DataReport([found], [], {}).render()
    assert "caption_filter_list: train: 4 caption(s) changed, 1 left empty (see the notes)" in report
    assert "left nothing of its caption" in report


def test_one_emptied_line_of_several_is_left_out(tmp_path):
    folder = tmp_path / "lines"
    (path,) = make_dataset(folder, count=1)
    path.with_suffix(".txt").write_text("a red circle\nwatermark\nred circle on blue")
    rule = CaptionRule("textfile", filters=CaptionFilter.parse([("1", "watermark")]))
    result = caption(path, folder, rule, None)
    assert result.captions == ("a red circle", "red circle on blue") and (result.changed, result.emptied) == (1, 1)
    assert result.note == "caption_filter_list left nothing of 1 of its 3 captions: those are not used"


def test_instance_prompts_are_never_filtered(tmp_path):
    folder = tmp_path / "sks"
    (path,) = make_dataset(folder, count=1)
    path.with_suffix(".txt").write_text("sks photo of a dog")
    rule = CaptionFilter.parse([("1", "sks ?"), ("2", "s/dog/hound/")])
    prepend = CaptionRule("textfile", "sks dog", prepend_instance_prompt=True, filters=rule)
    assert caption(path, folder, prepend, None).captions == ("sks dog photo of a hound",)
    assert caption(path, folder, CaptionRule("instanceprompt", "sks dog", filters=rule), None).captions == ("sks dog",)
    path.with_suffix(".txt").write_text("sks")
    emptied = caption(path, folder, prepend, None)
    assert emptied.captions == ("sks dog",) and "instance_prompt 'sks dog' alone" in emptied.note


# --- what the text cache encodes ----------------------------------------------------------------------------


def test_the_text_cache_encodes_filtered_captions_and_only_what_a_new_list_changes(tmp_path, images):
    cache = TensorCache(tmp_path / "text", {"family": "test"})
    encoded: list[str] = []

    def encode(prompts, images_):
        encoded.extend(prompts)
        return [{"embeds": torch.zeros(2)} for _ in prompts]

    def fill(filters):
        found = discovered(config_with(tmp_path, images, filters))
        encoded.clear()
        fill_text_cache(cache, text_jobs(found.samples, "center", 7, with_empty=False), encode, 8)
        return sorted(encoded), sorted(c for s in found.samples for c in s.captions)

    first, captions = fill(["The image shows ", "arafed "])
    assert first == captions == ["The image shows", "a dog on a rug", "an cat on a mat", "the image shows a dog"]
    again, same = fill(["The image shows ", "arafed "])  # a restart (resume) with the same list: the same captions,
    assert again == [] and same == captions  # all cached
    changed, captions = fill(["The image shows ", "arafed ", "s/ on a / upon a /"])
    assert changed == ["a dog upon a rug", "an cat upon a mat"]  # only the captions whose text changed
    assert captions == ["The image shows", "a dog upon a rug", "an cat upon a mat", "the image shows a dog"]
