"""Measured activation coefficients (bytes), written by `python -m difftune.memory_plan.measure` (`make plan-calibrate`).

How: `measure.py` (its docstring has the method). Each real architecture (bench_memory.py's configs) at real
width with 2 blocks per stack, bf16 weights under bf16 autocast, LoRA rank 16 on the family's targets (fp32, with
the trainer's skipped input casts: adapters/casts.py) or the whole base trainable ('full'), batch 1, on the CPU
(PyTorch's CPU flash attention; bf16 matrix products emulated in fp32, same tensors), measured at (256, 64), (576, 64) and (256, 256) (image, text) tokens. The second
block of each stack gives the per-block figure; bytes per block = a * image_tokens + b * text_tokens + c, per
sample of the batch. 'outside': everything saved outside the blocks (embedders, the final layer, the tables all
blocks share). 'checkpointed': with gradient checkpointing (what a checkpointed block keeps: its inputs; a stack
the model does not checkpoint, such as Lumina2's refiners, keeps its full figure here).

COEFFICIENTS[name][mode][stack] = (a, b, c). VAE[name][what] = bytes per pixel (per pixel-frame for video):
the peak of live tensor storages during one image's (clip's) encode or decode, bf16, no grad, weights not
counted (measure.vae_per_pixel: FLUX VAE at 256 and 384 px; the HunyuanVideo VAE with the family's framewise
and tiling settings at 64-96 px and 9-17 frames, since a 256 px clip needed more CPU memory than this machine
had to spare).
"""

from __future__ import annotations

COEFFICIENTS: dict[str, dict[str, dict[str, tuple[float, float, float]]]] = {
    'Lumina2 2.0': {'lora': {'noise_refiner': (170864.0, -0.0, 509952.0), 'layers': (170864.0, 170864.0, 509952.0), 'context_refiner': (-0.0, 170866.0, 491520.0), 'outside': (-7424.0, -7680.0, -442368.0)}, 'checkpointed': {'noise_refiner': (170864.0, -0.0, 509952.0), 'layers': (4608.0, 4608.0, 0.0), 'context_refiner': (-0.0, 170866.0, 491520.0), 'outside': (-7424.0, -7680.0, -440320.0)}, 'full': {'noise_refiner': (236784.0, -0.0, 20480.0), 'layers': (236784.0, 236784.0, 20480.0), 'context_refiner': (-0.0, 218354.0, 0.0), 'outside': (15748.0, 24580.0, 13312.0)}},
    'K5 Image Lite': {'lora': {'visual_transformer_blocks': (123496.0, 20624.0, 1372160.0), 'text_transformer_blocks': (0.0, 87424.0, 696320.0), 'outside': (768.0, -4616.0, -501760.0)}, 'checkpointed': {'visual_transformer_blocks': (5120.0, -0.0, 0.0), 'text_transformer_blocks': (-0.0, 5120.0, 0.0), 'outside': (11016.0, 5632.0, 11264.0)}, 'full': {'visual_transformer_blocks': (241064.0, 30800.0, 23655424.0), 'text_transformer_blocks': (-0.0, 174336.0, 15770624.0), 'outside': (26504.0, 17924.0, 5789188.0)}},
    'K5 Video Lite': {'lora': {'visual_transformer_blocks': (86792.0, 14512.0, 960512.0), 'text_transformer_blocks': (-0.0, 61408.0, 487424.0), 'outside': (512.0, -3336.0, -351232.0)}, 'checkpointed': {'visual_transformer_blocks': (3584.0, -0.0, 0.0), 'text_transformer_blocks': (0.0, 3584.0, -0.0), 'outside': (7688.0, 3840.0, 8192.0)}, 'full': {'visual_transformer_blocks': (169032.0, 21616.0, 16559104.0), 'text_transformer_blocks': (0.0, 122208.0, 11039744.0), 'outside': (18704.0, 14596.0, 4211716.0)}},
    'K5 Video Pro': {'lora': {'visual_transformer_blocks': (197464.0, 32960.0, 2195456.0), 'text_transformer_blocks': (0.0, 139792.0, 1114112.0), 'outside': (768.0, -7688.0, -802816.0)}, 'checkpointed': {'visual_transformer_blocks': (8192.0, -0.0, 0.0), 'text_transformer_blocks': (-0.0, 8192.0, -0.0), 'outside': (17160.0, 8704.0, 18432.0)}, 'full': {'visual_transformer_blocks': (385688.0, 49280.0, 75597824.0), 'text_transformer_blocks': (-0.0, 278928.0, 50399232.0), 'outside': (42000.0, 24068.0, 18910724.0)}},
}
VAE: dict[str, dict[str, float]] = {
    "FLUX": {"encode": 1280.0, "decode": 1568.0},  # 256 and 384 px
    "HunyuanVideo": {"encode": 1357.0, "decode": 2472.0},  # per pixel-frame; 64-96 px, 9-17 frames
}
