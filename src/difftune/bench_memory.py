"""`make bench-memory`: the weight bytes each `base_model_precision` gives at real size (issue 13).

For each family's transformer and text encoder, built from the real architecture config (the hub
repository's config.json, or the original code's config where the diffusers one is not stored anywhere
we can read; see CONFIG_SOURCES), with random weights, on the CPU:

1. The whole model is built on the meta device (no memory) and cast as `from_pretrained(torch_dtype=bf16)`
   would: bf16, except the class's `_keep_in_fp32_modules`. That gives the parameter count and bf16 bytes.
2. Its repeated blocks (every nn.ModuleList of same-class modules: transformer layers, refiners, vision
   blocks) are grouped by kind (class and parameter shapes). One block of each kind is made real on the
   CPU (random normal weights), quantized with `models.quantize.QUANTIZERS[precision]` on
   `quantized_layers(block)` - exactly what `quantize_transformer` does to the whole model - and measured
   with `weight_bytes`. The rest of the model (embeddings, output layers, everything outside those lists)
   is made real and quantized the same way, once.
3. Model bytes = sum over kinds of (bytes of one block x blocks of that kind) + bytes of the rest.

`--validate NAME...` also builds those whole models for real and quantizes them with each precision, to check
the extrapolation (slow: a 2.6B model takes minutes per precision on 2 cores). Activations, optimizer state and
step time are not measured: weights only.

Text encoders are measured the same way: every linear layer of the whole module the pipeline loads (for
Qwen2.5-VL: the language model, its lm_head and the vision tower).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from difftune.bench import machine_info
from difftune.models.quantize import QUANTIZERS, quantized_layers, weight_bytes

GIB = 2**30

# Alpha-VLLM/Lumina-Image-2.0 transformer/config.json (as quoted verbatim in sgl-project/sglang
# python/sglang/multimodal_gen/test/unit/test_lumina2.py, LUMINA2_CHECKPOINT_CONFIG).
LUMINA2 = dict(
    axes_dim_rope=(32, 32, 32), axes_lens=(300, 512, 512), cap_feat_dim=2304, ffn_dim_multiplier=None,
    hidden_size=2304, in_channels=16, multiple_of=256, norm_eps=1e-05, num_attention_heads=24, num_kv_heads=8,
    num_layers=26, num_refiner_layers=2, out_channels=None, patch_size=2, sample_size=128, scaling_factor=1.0,
)

# Kandinsky 5 `dit_params` from the original code's configs (kandinskylab/kandinsky-5 configs/*.yaml); the
# diffusers Kandinsky5Transformer3DModel takes the same keys. in_text_dim/in_text_dim2 are Qwen2.5-VL 7B's
# hidden size and CLIP-L's. The image model's config omits visual_cond (the original default: False).
K5_TEXT = dict(in_text_dim=3584, in_text_dim2=768, in_visual_dim=16, out_visual_dim=16, patch_size=(1, 2, 2))
K5_IMAGE_LITE = dict(K5_TEXT, time_dim=512, model_dim=2560, ff_dim=10240, num_text_blocks=2, num_visual_blocks=50,
                     axes_dims=(32, 48, 48), visual_cond=False)
K5_VIDEO_LITE = dict(K5_TEXT, time_dim=512, model_dim=1792, ff_dim=7168, num_text_blocks=2, num_visual_blocks=32,
                     axes_dims=(16, 24, 24), visual_cond=True)
K5_VIDEO_PRO = dict(K5_TEXT, time_dim=1024, model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=60,
                    axes_dims=(32, 48, 48), visual_cond=True)

# Lumina-Image-2.0 text_encoder/config.json (Gemma2Model of google/gemma-2-2b), as quoted in kohya-ss/sd-scripts
# library/lumina_util.py (GEMMA2_CONFIG).
GEMMA2_2B = dict(
    attention_bias=False, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", hidden_size=2304, intermediate_size=9216, max_position_embeddings=8192,
    num_attention_heads=8, num_hidden_layers=26, num_key_value_heads=4, query_pre_attn_scalar=256, rms_norm_eps=1e-06,
    rope_theta=10000.0, sliding_window=4096, vocab_size=256000, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)

# Qwen/Qwen2.5-VL-7B-Instruct config.json, as quoted in kohya-ss/sd-scripts library/hunyuan_image_text_encoder.py
# (QWEN2_5_VL_CONFIG_JSON). The Kandinsky 5 pipelines load it as Qwen2_5_VLForConditionalGeneration.
QWEN25_VL_7B_TEXT = dict(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-06, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
QWEN25_VL_7B_VISION = dict(
    depth=32, fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", hidden_size=1280, in_channels=3,
    intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, tokens_per_second=2, window_size=112,
)

CONFIG_SOURCES = {
    "Lumina2 transformer": "Alpha-VLLM/Lumina-Image-2.0 transformer/config.json, verbatim in sgl-project/sglang "
                           "python/sglang/multimodal_gen/test/unit/test_lumina2.py",
    "Gemma2 2B (Lumina2 text encoder)": "Lumina-Image-2.0 text_encoder config (Gemma2Model), in kohya-ss/sd-scripts "
                                        "library/lumina_util.py",
    "K5 Image Lite transformer": "kandinskylab/kandinsky-5 configs/config_t2i.yaml (dit_params)",
    "K5 Video Lite transformer": "kandinskylab/kandinsky-5 configs/k5_lite_i2v_5s_sft_sd.yaml (dit_params; the "
                                 "T2V Lite 5s sft config has the same dimensions)",
    "K5 Video Pro transformer": "kandinskylab/kandinsky-5 configs/k5_pro_t2v_5s_sft_sd.yaml (dit_params)",
    "Qwen2.5-VL 7B (K5 text encoder)": "Qwen/Qwen2.5-VL-7B-Instruct config.json, in kohya-ss/sd-scripts "
                                       "library/hunyuan_image_text_encoder.py",
}


def lumina2() -> torch.nn.Module:
    from diffusers import Lumina2Transformer2DModel

    return Lumina2Transformer2DModel(**LUMINA2)


def kandinsky5(config: dict) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from diffusers import Kandinsky5Transformer3DModel

        return Kandinsky5Transformer3DModel(**config, attention_type="regular")

    return build


def gemma2() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2Model

    return Gemma2Model(Gemma2Config(**GEMMA2_2B))


def qwen25_vl() -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(text_config=QWEN25_VL_7B_TEXT, vision_config=QWEN25_VL_7B_VISION,
                              tie_word_embeddings=False)
    return Qwen2_5_VLForConditionalGeneration(config)


@dataclass
class Spec:
    name: str
    build: Callable[[], torch.nn.Module]


MODELS = [
    Spec("Lumina2 transformer", lumina2),
    Spec("Gemma2 2B (Lumina2 text encoder)", gemma2),
    Spec("K5 Image Lite transformer", kandinsky5(K5_IMAGE_LITE)),
    Spec("K5 Video Lite transformer", kandinsky5(K5_VIDEO_LITE)),
    Spec("K5 Video Pro transformer", kandinsky5(K5_VIDEO_PRO)),
    Spec("Qwen2.5-VL 7B (K5 text encoder)", qwen25_vl),
]
PRECISIONS = list(QUANTIZERS)  # --precisions narrows it


def on_meta(spec: Spec) -> torch.nn.Module:
    """The model on the meta device, in the dtypes `from_pretrained(torch_dtype=torch.bfloat16)` gives it."""
    with torch.device("meta"):
        model = spec.build()
    model.to(torch.bfloat16)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    if keep:  # diffusers' rule (model_loading_utils): a module name that is one of the dotted parts
        for name, module in model.named_modules():
            if any(k in name.split(".") for k in keep):
                module.to(torch.float32)
    return model.eval().requires_grad_(False)


def block_lists(model: torch.nn.Module) -> list[str]:
    """Paths of the outermost ModuleLists of two or more modules of one class: the repeated blocks."""
    found: list[str] = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if (isinstance(child, torch.nn.ModuleList) and len(child) >= 2
                    and len({type(m) for m in child}) == 1 and any(True for _ in child.parameters())):
                found.append(path)
            else:
                walk(child, path + ".")

    walk(model, "")
    return found


def kind_of(block: torch.nn.Module) -> tuple:
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return (type(block).__name__, tuple((n, tuple(t.shape), t.dtype) for n, t in tensors))


def split(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module, int]], torch.nn.Module]:
    """([(kind label, one meta block, count)], the rest of the model on meta without those blocks)."""
    kinds: dict[tuple, list] = {}
    paths = block_lists(model)
    for path in paths:
        for block in model.get_submodule(path):
            entry = kinds.setdefault(kind_of(block), [[], block, 0])
            if path not in entry[0]:
                entry[0].append(path)
            entry[2] += 1
    rest = copy.deepcopy(model)
    for path in paths:
        parent, _, name = path.rpartition(".")
        setattr(rest.get_submodule(parent) if parent else rest, name, torch.nn.ModuleList())
    labelled = [(f"{', '.join(p + '.*' for p in names)} ({type(b).__name__})", b, n) for names, b, n in kinds.values()]
    return labelled, rest


# Random values for the weights: one normal chunk (std 0.02) of a prime length, tiled over each tensor, so rows
# differ. The bytes a precision gives do not depend on the values; drawing every value (`normal_`) took 30x longer.
NOISE = torch.Generator().manual_seed(0)
CHUNK = 1_000_003


@torch.no_grad()
def fill(t: torch.Tensor, chunk: torch.Tensor) -> None:
    flat = t.view(-1)
    rows, tail = divmod(flat.numel(), chunk.numel())
    if rows:
        flat[: rows * chunk.numel()].view(rows, -1).copy_(chunk.expand(rows, -1))
    flat[rows * chunk.numel():].copy_(chunk[:tail])


@torch.no_grad()
def materialize(meta: torch.nn.Module) -> torch.nn.Module:
    """A real CPU copy of a meta module with random weights (see NOISE) in the same dtypes."""
    real = copy.deepcopy(meta).to_empty(device="cpu")
    chunk = torch.randn(CHUNK, generator=NOISE).mul_(0.02)
    for t in (*real.parameters(), *real.buffers()):
        if t.is_floating_point():
            fill(t, chunk.to(t.dtype))
        else:
            t.zero_()
    return real


def quantized_bytes(meta: torch.nn.Module, precision: str) -> int:
    module = materialize(meta)
    if precision != "bf16":
        QUANTIZERS[precision](module, quantized_layers(module))
    size = weight_bytes(module)
    del module
    return size


def meta_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def measure(spec: Spec, validate: bool) -> dict:
    started = time.perf_counter()
    model = on_meta(spec)
    params = sum(p.numel() for p in model.parameters())
    kinds, rest = split(model)
    parts = [(label, block, count) for label, block, count in kinds] + [("rest (non-block)", rest, 1)]
    assert sum(meta_bytes(b) * c for _, b, c in parts) == meta_bytes(model), "blocks + rest must be the whole model"
    result = {"name": spec.name, "params": params, "linear layers": len(quantized_layers(model)),
              "parts": [(label, count, sum(p.numel() for p in b.parameters())) for label, b, count in parts],
              "bytes": {}, "whole": {}}
    for precision in ["bf16", *PRECISIONS]:
        try:
            result["bytes"][precision] = sum(quantized_bytes(block, precision) * count for _, block, count in parts)
        except RuntimeError as error:  # e.g. quanto's CPU int4 packing needs out_features divisible by 16
            result["bytes"][precision] = None
            result.setdefault("failed", {})[precision] = str(error).splitlines()[0]
    assert result["bytes"]["bf16"] == meta_bytes(model)
    result["seconds"] = time.perf_counter() - started
    if validate:
        started = time.perf_counter()
        for precision in PRECISIONS:
            result["whole"][precision] = quantized_bytes(model, precision)
        result["validate seconds"] = time.perf_counter() - started
    return result


def gib(n: int | None) -> str:
    return "fails" if n is None else f"{n / GIB:.2f}"


def report(results: list[dict]) -> None:
    head = ["model", "parameters", "bf16 GiB", *(f"{p} GiB" for p in PRECISIONS)]
    rows = [[r["name"], f"{r['params'] / 1e9:.2f}B", gib(r["bytes"]["bf16"]), *(gib(r["bytes"][p]) for p in PRECISIONS)]
            for r in results]
    print()
    print("  ".join(f"{h:>14}" if i else f"{h:<34}" for i, h in enumerate(head)))
    for row in rows:
        print("  ".join(f"{c:>14}" if i else f"{c:<34}" for i, c in enumerate(row)))
    print("\nMarkdown:\n")
    print("| " + " | ".join(head) + " |")
    print("| --- | " + " | ".join("---:" for _ in head[1:]) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for r in results:
        print(f"\n{r['name']}: {r['params']:,} parameters, {r['linear layers']} linear layers, "
              f"{r['seconds']:.1f} s; parts (kind, count, parameters each):")
        for label, count, n in r["parts"]:
            print(f"  {label}: {count} x {n:,}")
        for p, reason in r.get("failed", {}).items():
            print(f"  {p} fails: {reason}")
        if r["whole"]:
            print(f"  whole model built and quantized ({r['validate seconds']:.1f} s):")
            for p, whole in r["whole"].items():
                print(f"    {p}: whole {whole:,} bytes, extrapolated {r['bytes'][p]:,} bytes, "
                      f"difference {r['bytes'][p] - whole:+,} bytes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model names (substrings) to measure; all by default")
    parser.add_argument("--validate", nargs="*", default=[],
                        help="models (substrings) to also build whole and quantize, to check the extrapolation")
    parser.add_argument("--precisions", nargs="*", choices=list(QUANTIZERS), help="precisions to measure; all by default")
    args = parser.parse_args(argv)
    if args.precisions:
        PRECISIONS[:] = args.precisions
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # the cast to bf16 on meta is deliberate (see on_meta)
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    started = time.perf_counter()
    results = []
    for spec in MODELS:
        if args.only and not any(s in spec.name for s in args.only):
            continue
        validate = any(s in spec.name for s in args.validate)
        print(f"{spec.name}: {CONFIG_SOURCES[spec.name]}", flush=True)
        results.append(measure(spec, validate))
        print(f"  done in {results[-1]['seconds'] + results[-1].get('validate seconds', 0):.1f} s", flush=True)
    report(results)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
