"""The wizard's questions about a dataset beyond its folder (`difftune configure`): the input images of an
image-to-image flavour, the `video` block's frames, image-to-video's validation frames, and what a change of family
or flavour leaves behind. A mixin of `ui.wizard.Wizard`, whose config, dataset list and questions it uses."""

from __future__ import annotations

from typing import Any

from difftune.config.compat import KEY_ALIASES
from difftune.config.cross_checks import VIDEO_KEYS
from difftune.config.dataset_entry_keys import I2V_MIN_FRAMES, disabled
from difftune.config.datasets import DATASET_MODELS, VideoOptions
from difftune.data.frames import vae_frames
from difftune.models.registry import FAMILY_FACTS
from difftune.ui import describe_model
from difftune.ui.terminal import _input, _show, _yes

# the input images of an image-to-image flavour: a folder of the user's, or a generator (config/generated_conditioning)
INPUT_IMAGES: list[tuple[dict[str, Any] | None, str]] = [
    (None, "a folder of input images, each named like its training image"),
    ({"type": "canny"}, "edge maps of the training images (canny): learns edges -> image"),
    ({"type": "superresolution"}, "blurred, noisy copies (superresolution): learns to restore detail"),
    ({"type": "jpeg_artifacts"}, "JPEG-damaged copies (jpeg_artifacts): learns to remove compression artifacts"),
    ({"type": "random_masks", "output_mode": "masked_image"},
     "the training images with random areas painted white (random_masks): learns inpainting"),
]




class DatasetQuestions:
    """Needs the Wizard's `config`, `datasets`, `image_specs`, `shortest`, `say` and `ask`."""

    config: dict[str, Any]
    datasets: list[Any]
    image_specs: dict[str, Any]
    shortest: Any

    def conditioning_question(self, entry: dict[str, Any]) -> None:
        """Image-to-image flavours train on (input, target) pairs: the folder of input images becomes a
        `dataset_type: conditioning` entry that the trained dataset names in conditioning_data (the review could
        never pass without it), or they are generated from the training images (`conditioning`: a generator)."""
        if entry.get("conditioning"):  # an edited config's generator: kept as it is
            self.say(f"\n  input images: generated from the training images ({_show(entry['conditioning'])}); edit "
                     "the dataset list to change the generator's settings")
            return
        self.say(f"\n  flavour {self.config['model_flavour']} trains on image pairs (input image -> training image)")
        for i, (_, what) in enumerate(INPUT_IMAGES, 1):
            self.say(f"  {i}) {what}")
        while True:
            answer = _input("input_images [1]: ").strip() or "1"
            if answer.isdigit() and 0 < int(answer) <= len(INPUT_IMAGES):
                break
            self.say(f"  choose a number from 1 to {len(INPUT_IMAGES)}")
        generator = INPUT_IMAGES[int(answer) - 1][0]
        if generator is not None:
            if entry.get("conditioning_data") is not None:
                self.forget_conditioning(entry)
            entry["conditioning"] = [dict(generator)]
            self.say(f"  made before training into cache/conditioning_data/{entry['id']}_conditioning_"
                     f"{generator['type']}-<digest of the images' folder>")
            return
        wanted = entry.get("conditioning_data")
        inputs = next((e for e in self.datasets if isinstance(e, dict) and e.get("dataset_type") == "conditioning"
                       and (e.get("id") == wanted or wanted is None)), None)
        if inputs is None:
            inputs = {"id": f"{entry['id']}-inputs", "type": "local", "dataset_type": "conditioning"}
            self.datasets.insert(self.datasets.index(entry) + 1, inputs)
        self.say(f"\n  flavour {self.config['model_flavour']} trains on image pairs: give the folder of input images, "
                 "each named like its target image in the dataset folder")
        spec = {f["name"]: f for f in describe_model(DATASET_MODELS["conditioning"])["fields"]}["instance_data_dir"]
        self.ask(spec, inputs, DATASET_MODELS["conditioning"], label="conditioning.instance_data_dir")
        entry["conditioning_data"] = inputs["id"]

    def leftovers(self, entry: dict[str, Any]) -> None:
        """After a change of family or flavour: offer to remove what the new one refuses and no question asks about
        (the review failed on it at every pass): video datasets and video keys under an image family, and the input
        images (conditioning_data, conditioning) of datasets under a flavour that does not train on image pairs."""
        cfg = self.config
        facts = FAMILY_FACTS[cfg["model_family"]]
        for other in [e for e in self.datasets if isinstance(e, dict) and e is not entry and not facts.video
                      and e.get("dataset_type") == "video" and not disabled(e)]:
            self.say(f"\n  dataset {other.get('id')!r} holds clips, and {cfg['model_family']} trains on images")
            if _yes(f"Remove the dataset {other.get('id')!r} from the list? [Y/n]: "):
                self.datasets.remove(other)
        names = {k: KEY_ALIASES.get(k, k) for k in cfg}
        video_keys = [k for k, name in names.items() if name in VIDEO_KEYS and cfg[k] not in (None, False)]
        if video_keys and not facts.video:
            self.say(f"\n  {', '.join(video_keys)}: for video families only, and {cfg['model_family']} trains on images")
            if _yes(f"Remove {'it' if len(video_keys) == 1 else 'them'}? [Y/n]: "):
                for key in video_keys:
                    del cfg[key]
        if not facts.needs_conditioning(str(cfg.get("model_flavour"))):
            for other in [e for e in self.datasets if isinstance(e, dict) and e.get("dataset_type", "image") == "image"
                          and (e.get("conditioning_data") is not None or e.get("conditioning"))]:
                self.drop_conditioning(other)

    def drop_conditioning(self, entry: dict[str, Any]) -> None:
        """Offer to remove a dataset's conditioning_data (and the conditioning entry it names, when no other
        dataset names it): a flavour that does not train on pairs refuses it, and no question could change it."""
        flavour = self.config.get("model_flavour")
        if entry.get("conditioning"):
            self.say(f"\n  flavour {flavour} does not train on image pairs, but dataset {entry.get('id')!r} "
                     "generates input images for image-to-image flavours (conditioning)")
            if _yes("Remove conditioning? [Y/n]: "):
                del entry["conditioning"]
            return  # if not, the review says why it cannot pass
        name = entry["conditioning_data"]
        self.say(f"\n  flavour {flavour} does not train on image pairs, but dataset "
                 f"{entry.get('id')!r} has conditioning_data {name!r} (input images for image-to-image flavours)")
        if not _yes(f"Remove conditioning_data and the dataset {name!r}? [Y/n]: "):
            return  # the review says why it cannot pass
        self.forget_conditioning(entry)

    def forget_conditioning(self, entry: dict[str, Any]) -> None:
        """Remove the entry's conditioning_data, and the conditioning entry it names when no other dataset does."""
        name = entry.pop("conditioning_data")
        if not any(isinstance(e, dict) and e.get("conditioning_data") == name for e in self.datasets):
            self.datasets[:] = [e for e in self.datasets if not (isinstance(e, dict) and e.get("id") == name
                                                                 and e.get("dataset_type") == "conditioning")]

    def i2v_frames(self, entry: dict[str, Any]) -> int | None:
        """The validation_num_video_frames to offer an image-to-video flavour whose validation would get fewer
        than it needs (the video dataset's num_frames, the default, is often shorter), said with why."""
        cfg = self.config
        if not (FAMILY_FACTS[cfg["model_family"]].first_frame(str(cfg.get("model_flavour")))
                and cfg.get("validation_prompt")):
            return None
        block = entry.get("video") if isinstance(entry.get("video"), dict) else {}
        frames = cfg.get("validation_num_video_frames") or block.get("num_frames") or 61  # config/load.py's rule
        if not isinstance(frames, int) or frames >= I2V_MIN_FRAMES:
            return None
        self.say(f"\n  image-to-video validation needs at least {I2V_MIN_FRAMES} frames (the stock I2V pipeline "
                 f"renormalizes the first 4 latent frames against the next ones); {frames} would be refused")
        return I2V_MIN_FRAMES

    def video_questions(self, entry: dict[str, Any]) -> None:
        """The `video` block's frame keys, with num_frames offered from the shortest clip: with bucket_strategy
        'aspect_ratio' a clip shorter than num_frames is left out, so the default 61 would leave out short clips."""
        specs = {f["name"]: f for f in self.image_specs["video"]["fields"]}
        block = entry.get("video") if isinstance(entry.get("video"), dict) else {}
        self.ask(specs["bucket_strategy"], block, VideoOptions, label="video.bucket_strategy")
        offer = None
        current = block.get("num_frames", specs["num_frames"]["default"])
        cfg = self.config
        least = 5 if FAMILY_FACTS[cfg["model_family"]].first_frame(str(cfg.get("model_flavour"))) else 1
        if self.shortest is not None:
            frames, probed, fps = self.shortest
            fit = vae_frames(frames)
            self.say(f"\n  the shortest of {probed} clip(s) probed has {frames} frame(s) at {fps:g} fps: "
                     f"num_frames {fit} or less (4k+1) keeps every clip")
            if fit < least:
                self.say(f"  image-to-video trains the frames after the first latent frame: num_frames must be "
                         f"{least} or more, so clips shorter than {least} frames are left out")
            if (isinstance(current, int) and current > max(fit, least)
                    and block.get("bucket_strategy", "aspect_ratio") == "aspect_ratio"):
                offer = max(fit, least)
        self.ask(specs["num_frames"], block, VideoOptions, offer=offer, label="video.num_frames")
        chosen = block.get("num_frames", specs["num_frames"]["default"])
        if isinstance(block.get("min_frames"), int) and isinstance(chosen, int) and block["min_frames"] > chosen:
            # the dataset list's own min_frames (the spec's examples set it to num_frames): no question asked it
            self.say(f"\n  min_frames {block['min_frames']} leaves out every clip shorter than that, more than "
                     f"num_frames {chosen} needs")
            self.ask(specs["min_frames"], block, VideoOptions, offer=chosen, label="video.min_frames")
        if block:
            entry["video"] = block
        else:
            entry.pop("video", None)
