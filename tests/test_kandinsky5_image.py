"""Kandinsky 5 Image specifics (the generic conformance suite is test_families.py)."""

import json

import pytest
import torch
from PIL import Image

from conftest import write_config
from difftune.config import ConfigError, load_config
from difftune.models import get_family, tiny_model
from difftune.models.tiny_kandinsky5 import load_qwen_processor
from difftune.train.loop import train
from difftune.train.setup import build_run
from families import Case, make_pairs

FAMILY = get_family("kandinsky5-image")


@pytest.mark.parametrize("flavour", ["tiny-random", "tiny-random-i2i"])
def test_text_encoding_matches_pipeline(flavour):
    case = Case("kandinsky5-image", flavour)
    folder = tiny_model(case.family, flavour)
    comps = FAMILY.load(str(folder), torch.float32)
    pipe = case.stock(folder)
    prompts = ["a red circle", "a much longer prompt about a blue square on a green field"]
    if case.i2i:
        image = Image.new("RGB", (64, 64), (10, 200, 30))
        for prompt in prompts:  # image prompts are encoded one by one
            ours = FAMILY.encode_text(comps, [prompt], images=[image])[0]
            qwen, clip, cu = pipe.encode_prompt([prompt], image=[image], device="cpu")
            torch.testing.assert_close(ours["prompt_embeds"], qwen[0, : int(cu[1])])
            torch.testing.assert_close(ours["pooled"], clip[0])
    else:
        ours = FAMILY.encode_text(comps, prompts)  # batched: right padding keeps each a prefix
        for i, prompt in enumerate(prompts):
            qwen, clip, cu = pipe.encode_prompt([prompt], device="cpu")
            assert ours[i]["prompt_embeds"].shape[0] == int(cu[1])
            torch.testing.assert_close(ours[i]["prompt_embeds"], qwen[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours[i]["pooled"], clip[0], atol=1e-5, rtol=1e-5)


def test_processor_loads_without_torchvision():
    processor = load_qwen_processor(tiny_model("kandinsky5-image", "tiny-random"))
    assert "image_pad" in processor.image_token


def test_defaults_from_the_spec(tmp_path, dataset):
    cfg = load_config(write_config(tmp_path, dataset, model_family="kandinsky5-image", model_flavour=None)).train
    assert cfg.flavour() == "t2i-lite-sft"
    assert cfg.model_source() == "kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers"
    assert cfg.guidance() == 5.0 and cfg.flow_schedule_shift == 1.0
    assert cfg.validation_resolution is None and cfg.validation_sizes() == [(1024, 1024)]


def test_spec_example_dataset_list_validates(tmp_path):
    """The dataset list of the Kandinsky 5 Image guide (../shared/spec/000_*) as written, folder aside."""
    images = tmp_path / "datasets" / "my_images"
    images.mkdir(parents=True)
    spec = [
        {"id": "my-image-dataset", "type": "local", "dataset_type": "image", "instance_data_dir": str(images),
         "caption_strategy": "textfile", "resolution": 1024, "crop": True, "crop_aspect": "square", "repeats": 10},
        {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True,
         "cache_dir": "cache/text/kandinsky5", "disabled": False},
    ]
    (tmp_path / "list.json").write_text(json.dumps(spec))
    config = {"model_family": "kandinsky5-image", "model_type": "lora", "lora_rank": 16,
              "text_encoder_1_precision": "no_change", "text_encoder_2_precision": "no_change",
              "base_model_default_dtype": "bf16", "max_train_steps": 10,
              "data_backend_config": str(tmp_path / "list.json")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = load_config(tmp_path / "config.json")
    assert run.datasets.images[0].repeats == 10 and run.train.weight_dtype_name() == "bf16"


def test_i2i_needs_pairs_and_t2i_refuses_them(tmp_path, dataset):
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, model_family="kandinsky5-image", model_flavour="i2i-lite-sft"))
    assert "conditioning_data" in str(info.value)
    make_pairs(dataset, tmp_path / "inputs")
    paired = {"dataset": {"conditioning_data": "inputs"}, "conditioning_dir": tmp_path / "inputs"}
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, model_family="kandinsky5-image", **paired))
    assert "only used by image-to-image" in str(info.value)
    wrong = {"dataset": {"conditioning_data": "inptus"}, "conditioning_dir": tmp_path / "inputs"}
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, dataset, model_family="kandinsky5-image", model_flavour="i2i-lite-sft",
                                 **wrong))
    assert "'inptus'" in str(info.value)


def test_i2i_pairs_by_name_reports_missing_and_validates_from_dataset(tmp_path, dataset):
    make_pairs(dataset, tmp_path / "inputs")
    missing = sorted((tmp_path / "inputs").glob("*.png"))[-1]
    missing.unlink()
    chosen = tmp_path / "eval"
    chosen.mkdir()
    Image.new("RGB", (40, 40), (1, 2, 3)).save(chosen / "probe.png")
    (chosen / "probe.txt").write_text("probe")
    path = write_config(
        tmp_path, dataset, model_family="kandinsky5-image", model_flavour="tiny-random-i2i", max_train_steps=2,
        dataset={"conditioning_data": "inputs"}, conditioning_dir=tmp_path / "inputs",
        validation_prompt="swap it", validation_resolution="64x64", validation_num_inference_steps=2,
        validation_using_datasets=True, eval_dataset_id="probes",
    )
    backend = json.loads((tmp_path / "config" / "multidatabackend.json").read_text())
    backend.append({"id": "probes", "type": "local", "dataset_type": "conditioning", "instance_data_dir": str(chosen)})
    (tmp_path / "config" / "multidatabackend.json").write_text(json.dumps(backend))
    run = build_run(load_config(path))
    assert len(run.data.items) == 3
    # the probe, fitted to the validation size as training inputs are (the pipeline would stretch it)
    assert run.validation[0].image.size == (64, 64) and run.validation[0].image.getpixel((32, 32)) == (1, 2, 3)
    train(run)
    log = (run.output_dir / "events.jsonl").read_text()
    assert missing.name in log and "no conditioning image" in log
    assert list((run.output_dir / "validation").glob("final-*.png"))
