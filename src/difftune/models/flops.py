"""Model FLOPs of a training step, counted from a transformer's config and a batch's shapes (no model runs).

Each family counts its forward pass (`Family.forward_flops`): every matrix product at 2·m·n·k (linear layers,
patch and caption embeddings, modulations) and attention's two products, QK^T and AV, at 2·2·B·heads·Lq·Lk·d over
the sequence lengths the network really computes (Lumina2's joint caption + image sequence padded to the
batch's longest caption, Kandinsky 5's visual self-attention, text self-attention and visual-to-text
cross-attention). Elementwise work (norms, activations, rotary embeddings, softmax) is not counted: it is a few
percent of the matmuls and runs on other units, as in the usual MFU definition (PaLM, Megatron). Tests check the
counts against `torch.utils.flop_counter.FlopCounterMode` on the real diffusers classes (within 2%).

The forward is split by what its backward needs, since that decides the step:
- `inputs`: matmuls on the raw inputs (the latents' patch embedding, the first timestep layer, Kandinsky 5's text
  projections): their input never needs a gradient;
- `conditioning`: the other matmuls before the first block, and those on the timestep conditioning (the time
  MLP's second layer, every modulation, Lumina2's caption projection after its trained norm): with a frozen base
  nothing before them trains, so they have no backward; in a full fine-tune their input depends on trained weights;
- `linear`: every other matmul (the blocks' projections and feed-forwards, the output layer);
- `attention`: QK^T and AV.

Step FLOPs are model FLOPs of one micro-batch's forward and backward (`Flops.step`):
- full fine-tune: the forward, plus the backward's weight gradients of every matmul and input gradients of all
  but `inputs`, plus attention's backward (dQ, dK, dV: twice its forward). About 3x the forward.
- LoRA / LyCORIS: the base weights are frozen, so the backward of `linear` computes only input gradients (1x),
  and `inputs` and `conditioning` have no backward at all (nothing before them trains); attention's backward is
  the same. About 2x the forward's matmuls plus 3x its attention. The adapters' own products are added
  (`adapter`: 3x their forward: forward, weight gradient, input gradient), counted from the LoRA matrices' shapes
  and the rows each adapted layer sees (`Flops.rows_of`). LyCORIS modules add no term (their cost depends on the
  algorithm; it is small).
Not counted, on purpose: gradient checkpointing's recomputation (hardware FLOPs, not model FLOPs: MFU is about the
math the step needs, so turning checkpointing on lowers MFU, as it should), the flash-attention backward's
recomputation of QK^T, scheduled sampling's rollouts, CREPA's DINOv2 and VAE passes, and Kandinsky 5 Pro's NABLA
sparsity: its attention is counted dense (the block mask is drawn from the data at each call), so MFU there is
dense-equivalent.
TREAD routes are counted: a routed block computes the tokens it keeps. One approximation: with a frozen base the
first adapted block's q/k/v need no input gradient, counted all the same (+0.2% at real size, a few % on the tiny
models). For scale: a Lumina2 LoRA step at 512² batch 2 (128 caption tokens) is 22.2 TFLOP (forward 10.7), the
issue's "about 22 TFLOP"; a full fine-tune step of it 32.2.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Flops:
    """The forward FLOPs of one call of the transformer, by kind (see the module docstring)."""

    inputs: float = 0.0
    conditioning: float = 0.0
    linear: float = 0.0
    attention: float = 0.0
    tokens: int = 0  # image/video latent tokens after patchify, whole batch
    # (module-path regex, rows that module sees) in order, first match wins: the adapter term's rows
    rows: list[tuple[str, int]] = field(default_factory=list)

    @property
    def forward(self) -> float:
        return self.inputs + self.conditioning + self.linear + self.attention

    def rows_of(self, module_path: str) -> int:
        """Rows (tokens, or samples for the modulations) the module at `module_path` multiplies per call;
        the image tokens for a module no pattern names."""
        for pattern, rows in self.rows:
            if re.search(pattern, module_path):
                return rows
        return self.tokens

    def step(self, full: bool, adapter: float = 0.0) -> float:
        """Model FLOPs of forward + backward. `full`: every weight trains; else a frozen base with an adapter whose
        own forward is `adapter` FLOPs."""
        backward = 2.0 * self.attention
        if full:
            backward += self.inputs + 2.0 * (self.conditioning + self.linear)
        else:
            backward += self.linear + 2.0 * adapter
        return self.forward + adapter + backward


def matmul(rows: int, n_in: int, n_out: int) -> float:
    """A linear layer over `rows` rows: 2 FLOPs (multiply, add) per weight per row."""
    return 2.0 * rows * n_in * n_out


def attention(batch: int, heads: int, q_len: int, k_len: int, head_dim: int) -> float:
    """QK^T and AV of every head (grouped-query attention repeats K and V: the same count)."""
    return 2.0 * matmul(batch * heads * q_len, head_dim, k_len)


def routed_tokens(routes: Sequence[Any], block: int, routable: int) -> int:
    """Tokens (of `routable`, per sample) that TREAD's routes drop in `block`; as train/tread.py draws them:
    int(ratio * routable) per sample in every block of a route."""
    for route in routes:
        if route.start <= block <= route.end:
            return int(route.ratio * routable)
    return 0


def lora_forward(flops: Flops, adapter_shapes: Sequence[tuple[str, int]]) -> float:
    """The forward FLOPs of the LoRA matrices: (parameter name, numel) of each lora_A / lora_B weight; each
    multiplies the rows of its layer, 2 FLOPs per weight per row."""
    total = 0.0
    for name, numel in adapter_shapes:
        module = name.split(".lora_")[0]
        total += 2.0 * numel * flops.rows_of(module)
    return total
