"""Import-light facts about each model family: names, flavours, defaults.

The config schema validates against these without importing torch or diffusers. The heavy code of a
family lives in its own module (`models/lumina2.py`), looked up by `models.get_family`.
"""

from __future__ import annotations

from dataclasses import dataclass

TINY_FLAVOUR = "tiny-random"


@dataclass(frozen=True)
class FamilyFacts:
    name: str
    flavours: dict[str, str]  # flavour -> hub repository id ("tiny-random" -> "" : built offline)
    default_flavour: str
    default_guidance: float
    module: str  # where the family's implementation lives, imported on demand
    conditioning_flavours: frozenset[str] = frozenset()  # flavours trained on (condition, target) pairs
    default_resolution: str = "1024x1024"
    pixel_multiple: int = 16  # image sides must be multiples of this (VAE factor x patch size)
    video: bool = False  # trains on clips (video datasets; images count as one-frame clips)
    first_frame_flavours: frozenset[str] = frozenset()  # image-to-video: conditioned on each clip's first frame
    default_frame_rate: float = 24.0  # video families: fps of validation videos and of resampled clips
    comfyui_layout: str | None = None  # key layout of its ComfyUI LoRAs (adapters/comfyui.py); None: none
    # Its text encoders in pipeline order: the first is component `text_encoder` (text_encoder_1_precision),
    # the second `text_encoder_2` (text_encoder_2_precision).
    text_encoders: tuple[str, ...] = ()
    # The transformer's ModuleLists of blocks, in execution order, that block streaming (train/offload.py) moves
    # group by group; the last is the main stack (musubi_blocks_to_swap streams the end of it).
    block_stacks: tuple[str, ...] = ()
    # tokenizer_max_length: the stock pipeline's max_sequence_length when it is not set, (text alone, with an input
    # image the text encoder sees), and the most its pipelines take (their check_inputs refuse more)
    text_lengths: tuple[int, int] = (512, 512)
    max_text_length: int = 1024
    # diffusers can load its transformer from one original-layout .safetensors file (from_single_file)
    single_file_transformer: bool = False

    def text_length(self, flavour: str) -> int:
        """The prompt length (tokens) the stock pipeline encodes at for this flavour (its encode_prompt default)."""
        return self.text_lengths[1 if self.needs_conditioning(flavour) else 0]

    def needs_conditioning(self, flavour: str) -> bool:
        return flavour in self.conditioning_flavours

    def first_frame(self, flavour: str) -> bool:
        return flavour in self.first_frame_flavours

    def takes_input_image(self, flavour: str) -> bool:
        """Validation samples of this flavour start from an input image (image-to-image or image-to-video)."""
        return self.needs_conditioning(flavour) or self.first_frame(flavour)


FAMILY_FACTS: dict[str, FamilyFacts] = {
    "lumina2": FamilyFacts(
        name="lumina2",
        flavours={"2.0": "Alpha-VLLM/Lumina-Image-2.0", TINY_FLAVOUR: ""},
        default_flavour="2.0",
        default_guidance=4.0,
        module="difftune.models.lumina2",
        single_file_transformer=True,  # Lumina2Transformer2DModel is a FromOriginalModelMixin
        comfyui_layout="lumina2",
        text_encoders=("Gemma2",),
        block_stacks=("context_refiner", "noise_refiner", "layers"),
        text_lengths=(256, 256),  # Lumina2Pipeline.encode_prompt; its system prompt counts too
        max_text_length=512,
    ),
    "kandinsky5-image": FamilyFacts(
        name="kandinsky5-image",
        flavours={
            "t2i-lite-sft": "kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers",
            "t2i-lite-pretrain": "kandinskylab/Kandinsky-5.0-T2I-Lite-pretrain-Diffusers",
            "i2i-lite-sft": "kandinskylab/Kandinsky-5.0-I2I-Lite-sft-Diffusers",
            "i2i-lite-pretrain": "kandinskylab/Kandinsky-5.0-I2I-Lite-pretrain-Diffusers",
            TINY_FLAVOUR: "",
            TINY_FLAVOUR + "-i2i": "",
        },
        default_flavour="t2i-lite-sft",
        default_guidance=5.0,
        module="difftune.models.kandinsky5_image",
        comfyui_layout="kandinsky5",
        text_encoders=("Qwen2.5-VL", "CLIP"),
        block_stacks=("text_transformer_blocks", "visual_transformer_blocks"),
        conditioning_flavours=frozenset({"i2i-lite-sft", "i2i-lite-pretrain", TINY_FLAVOUR + "-i2i"}),
        text_lengths=(512, 1024),  # Kandinsky5T2IPipeline / Kandinsky5I2IPipeline (image tokens count there)
    ),
    "kandinsky5-video": FamilyFacts(
        name="kandinsky5-video",
        # Confirmed in diffusers' docs: T2V-Lite-{sft,pretrain}-{5s,10s}, T2V-Pro-sft-5s, I2V-Pro-sft-5s. The other
        # Pro and I2V-Lite ids follow the same naming on the kandinskylab hub; pretrained_model_name_or_path
        # overrides any of them.
        flavours={
            "t2v-lite-sft-5s": "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers",
            "t2v-lite-sft-10s": "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-10s-Diffusers",
            "t2v-lite-pretrain-5s": "kandinskylab/Kandinsky-5.0-T2V-Lite-pretrain-5s-Diffusers",
            "t2v-lite-pretrain-10s": "kandinskylab/Kandinsky-5.0-T2V-Lite-pretrain-10s-Diffusers",
            "t2v-pro-sft-5s-hd": "kandinskylab/Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers",
            "t2v-pro-sft-10s-hd": "kandinskylab/Kandinsky-5.0-T2V-Pro-sft-10s-Diffusers",
            "t2v-pro-pretrain-5s-hd": "kandinskylab/Kandinsky-5.0-T2V-Pro-pretrain-5s-Diffusers",
            "t2v-pro-pretrain-10s-hd": "kandinskylab/Kandinsky-5.0-T2V-Pro-pretrain-10s-Diffusers",
            "i2v-lite-5s": "kandinskylab/Kandinsky-5.0-I2V-Lite-5s-Diffusers",
            "i2v-lite-pretrain-5s": "kandinskylab/Kandinsky-5.0-I2V-Lite-pretrain-5s-Diffusers",
            "i2v-pro-sft-5s": "kandinskylab/Kandinsky-5.0-I2V-Pro-sft-5s-Diffusers",
            "i2v-pro-pretrain-5s": "kandinskylab/Kandinsky-5.0-I2V-Pro-pretrain-5s-Diffusers",
            TINY_FLAVOUR: "",
            TINY_FLAVOUR + "-i2v": "",
        },
        default_flavour="t2v-lite-sft-5s",
        default_guidance=5.0,
        module="difftune.models.kandinsky5_video",
        default_resolution="512x768",
        video=True,
        comfyui_layout="kandinsky5",  # the same transformer class as the image family
        text_encoders=("Qwen2.5-VL", "CLIP"),
        block_stacks=("text_transformer_blocks", "visual_transformer_blocks"),
        first_frame_flavours=frozenset({
            "i2v-lite-5s", "i2v-lite-pretrain-5s", "i2v-pro-sft-5s", "i2v-pro-pretrain-5s", TINY_FLAVOUR + "-i2v",
        }),
    ),
}


def family_names() -> tuple[str, ...]:
    return tuple(FAMILY_FACTS)
