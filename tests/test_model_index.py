"""difftune loads what the stock pipeline loads: each component of the class model_index.json names.

Some Kandinsky 5 repositories ship a plain Qwen2 tokenizer as `tokenizer` (no preprocessor_config.json).
The stock text-to-image and text-to-video pipelines load and encode with it; so must difftune. Where the
text encoder sees an image (image-to-image), the processor is required, and its absence is a clear error.
"""

import shutil

import pytest
import torch

from conftest import write_config
from difftune import cli
from difftune.models import get_family, tiny_model
from difftune.models.hub import ComponentError, component_class, model_index
from families import make_pairs


def with_plain_tokenizer(family: str, flavour: str, folder):
    """A copy of the tiny model whose `tokenizer` is the processor's plain tokenizer, saved by the stock
    pipeline itself (so model_index.json names the tokenizer's class)."""
    from families import Case

    case = Case(family, flavour)
    pipe = case.stock(tiny_model(family, flavour))
    plain = pipe.tokenizer.tokenizer
    components = dict(pipe.components) | {"tokenizer": plain}
    type(pipe)(**components).save_pretrained(folder)
    assert not (folder / "tokenizer" / "preprocessor_config.json").exists()
    assert not component_class(model_index(str(folder)), "tokenizer").endswith("Processor")
    return folder, type(pipe)


@pytest.mark.parametrize("family", ["kandinsky5-image", "kandinsky5-video"])
def test_plain_tokenizer_loads_and_encodes_like_the_stock_pipeline(family, tmp_path):
    folder, pipeline_class = with_plain_tokenizer(family, "tiny-random", tmp_path / "model")
    stock = pipeline_class.from_pretrained(folder)  # the stock pipeline accepts this folder
    fam = get_family(family)
    comps = fam.load(str(folder), torch.float32)
    assert type(comps.text["tokenizer"]) is type(stock.tokenizer)
    ours = fam.encode_text(comps, ["a red square"])[0]
    qwen, clip, cu = stock.encode_prompt(["a red square"], device="cpu", dtype=torch.float32)
    torch.testing.assert_close(ours["prompt_embeds"], qwen[0, : int(cu[1])])
    torch.testing.assert_close(ours["pooled"], clip[0])
    # and it encodes exactly as the original folder with its processor does
    original = fam.load(str(tiny_model(family, "tiny-random")), torch.float32)
    torch.testing.assert_close(ours["prompt_embeds"], fam.encode_text(original, ["a red square"])[0]["prompt_embeds"])


def test_image_to_image_without_the_processor_is_a_clear_error(tmp_path, dataset, capsys):
    folder, _ = with_plain_tokenizer("kandinsky5-image", "tiny-random-i2i", tmp_path / "model")
    with pytest.raises(ComponentError, match="needs the Qwen2-VL processor"):
        get_family("kandinsky5-image").load(str(folder), torch.float32)
    make_pairs(dataset, tmp_path / "inputs")
    config = write_config(tmp_path, dataset, model_family="kandinsky5-image", model_flavour="i2i-lite-sft",
                          pretrained_model_name_or_path=str(folder), conditioning_dir=tmp_path / "inputs",
                          dataset={"conditioning_data": "inputs"})
    assert cli.main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer/" in err and "Qwen2VLProcessor" in err and "Traceback" not in err


def test_a_processor_folder_missing_its_image_config_is_named(tmp_path):
    source = tiny_model("kandinsky5-image", "tiny-random-i2i")
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    for f in (folder / "tokenizer").glob("*"):
        if "processor" in f.name:
            f.unlink()
    with pytest.raises(ComponentError, match="tokenizer/ should hold a Qwen2VLProcessor"):
        get_family("kandinsky5-image").load(str(folder), torch.float32)

