"""CREPA (video) and REPA (images): representation alignment as a training regularizer (`crepa_*` keys).

REPA (Yu et al., 2024, "Representation Alignment for Generation") adds to the diffusion loss the
negative cosine similarity between the transformer's hidden states after one block, passed through a
small trained MLP projector, and frozen DINOv2 patch features of the clean image. CREPA extends it over
time: each latent frame's tokens are also aligned with the features of the frames
`crepa_adjacent_distance` latent frames away (or every frame up to there, `crepa_cumulative_neighbors`), a
neighbour d frames away weighing exp(-d/tau). On the
image families (Lumina2, Kandinsky 5 image) there is one frame, so the same switch is plain REPA.

Backbone mode (`crepa_use_backbone_features`): the targets are the transformer's own output after the deeper block
`crepa_teacher_block_index` in the same call, detached (a frozen teacher, as SimpleTuner treats it), so no encoder
loads and no VAE decode or DINOv2 pass runs; the projector maps the hidden size to itself. The neighbour weighting,
the schedule and the threshold are the same.

Targets: the cached latents x0 are decoded with the family's VAE (no gradient) at each step, and the
frames go through DINOv2. Decision: decoding costs a VAE pass per step, but it needs no second cache
(the latent cache and its fingerprint stay as they are) and it works for on-the-fly latents too; the
spec's "drop VAE encoder" option also implies this design (only the decoder is needed). Caching the
DINOv2 features beside the latents would be cheaper per step and is left for later. A video's latent
frame t stands for pixel frames 4t-3..4t: the last of them (frame 4t; frame 0 for t = 0) is encoded.
Each frame is resized to crepa_encoder_image_size square, and DINOv2's patch grid is interpolated
(bilinearly) to the frame's token grid.

Hooked from outside diffusers' classes, never by copying their code (train/block_taps.py): block
`crepa_block_index`'s output of each training call is taken (validation, sampling and the no-grad rollouts
capture nothing; gradient checkpointing's recomputation is not captured again). `add_term` then adds the alignment term to the
flow loss, weighted by `weight`: crepa_lambda, or its warm-up, decay (`crepa_scheduler`) and cut-off; a step
whose weight is 0 skips the term's VAE decode and DINOv2 pass.

`crepa_drop_vae_encoder`: since only decoding is left once the latent caches are complete, `drop_vae_encoder`
(called by train/caching.py at the end of every start, after the caches are filled, so a resumed run still
encodes what its cache lacks) replaces the VAE's encoder and quant_conv (encode-only in diffusers' AutoencoderKL
and AutoencoderKLHunyuanVideo) with a parameterless module that raises a clear error if called. The config
refuses what would still encode (config/crepa_keys.py): on-the-fly latents and image-conditioned validation.

The projector (hidden -> 2048 -> 2048 -> DINOv2 width, SiLU) joins the optimizer (outside gradient
clipping, which covers the adapter) and is saved in each checkpoint as `crepa_projector.safetensors`
and restored on resume; it is never part of the saved adapter. It is initialized from its own RNG
seeded with `seed`, so turning CREPA on draws nothing from the global RNG.
"""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from difftune.config.crepa_keys import ENCODER_ALIASES
from difftune.models.hub import ComponentError
from difftune.train.block_taps import Taps, check_indexes, spatial_patch, token_grid
from difftune.train.tread import LAYOUTS

PROJECTOR_WIDTH = 2048
PROJECTOR_FILE = "crepa_projector.safetensors"
SIMILARITY_FILE = "crepa_similarity.safetensors"  # crepa_similarity_threshold's moving average and cut flag
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# Families whose cached latents are (z - shift_factor) * scaling_factor (models/lumina2.py); the Kandinsky 5
# pipelines ignore the VAE's shift_factor (models/kandinsky5_image.py): their latents are z * scaling_factor.
SHIFTED_LATENTS = ("lumina2",)
# The submodules diffusers' VAEs use only to encode (`_encode`, `tiled_encode`); decoding goes through
# post_quant_conv and decoder. Lumina2 and Kandinsky 5 Image use AutoencoderKL, Kandinsky 5 Video the HunyuanVideo one.
ENCODE_ONLY = {"AutoencoderKL": ("encoder", "quant_conv"), "AutoencoderKLHunyuanVideo": ("encoder", "quant_conv")}


class CrepaError(ComponentError):
    """A CREPA setting that does not fit the loaded model (exit code 2 with the message)."""


def projector(hidden: int, features: int, seed: int) -> torch.nn.Sequential:
    with torch.random.fork_rng(devices=[]):  # its own draws: the global RNG (peft, dropout) is left as it was
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(hidden, PROJECTOR_WIDTH), torch.nn.SiLU(),
            torch.nn.Linear(PROJECTOR_WIDTH, PROJECTOR_WIDTH), torch.nn.SiLU(),
            torch.nn.Linear(PROJECTOR_WIDTH, features),
        )


def encoder_dtype(weights: str) -> torch.dtype:
    """The encoder's dtype for weights of dtype `weights` (cfg.weight_dtype_name()): bf16 with bf16 weights, half
    the memory of its fp32 checkpoint (DINOv2-giant: 2.1 GiB instead of 4.2); fp32 otherwise (fp16's range is
    not trusted with a ViT's activations)."""
    return torch.bfloat16 if weights == "bf16" else torch.float32


def load_encoder(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModel

    source = ENCODER_ALIASES.get(name, name)
    try:
        encoder = AutoModel.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as e:
        raise CrepaError(f"crepa_encoder {name!r}: cannot load DINOv2 from {source!r} ({e}); name a transformers "
                         "DINOv2 model id such as facebook/dinov2-small, or a local folder holding one") from e
    if not hasattr(encoder.config, "patch_size") or not hasattr(encoder.config, "hidden_size"):
        raise CrepaError(f"crepa_encoder {name!r}: {type(encoder).__name__} is not a DINOv2-like vision encoder")
    return encoder.eval().requires_grad_(False).to(device)


def alignment(tokens: torch.Tensor, targets: torch.Tensor, distance: int, tau: float, by_frames: bool,
              cumulative: bool = False) -> torch.Tensor:
    """tokens, targets: [B, T, N, D]. Per frame t: sum over the offsets d (0 and +-distance; with `cumulative`
    every |d| <= distance) of exp(-|d|/tau) times the mean over tokens of -cos(tokens[t], targets[t+d]); then
    the mean (or the sum) over frames, the mean over B."""
    frames = tokens.shape[1]
    total = tokens.new_zeros(tokens.shape[0])
    offsets = range(-distance, distance + 1) if cumulative else sorted({-distance, 0, distance})
    for d in offsets:
        lo, hi = max(0, -d), min(frames, frames - d)
        if lo >= hi:
            continue
        cos = F.cosine_similarity(tokens[:, lo:hi], targets[:, lo + d : hi + d], dim=-1)  # [B, frames', N]
        total = total - math.exp(-abs(d) / tau) * cos.mean(dim=2).sum(dim=1)
    return (total / frames if by_frames else total).mean()


def _aligned_blocks(cfg: Any) -> list[str]:
    """The keys of the blocks CREPA captures: the student, and in backbone mode the teacher."""
    return ["crepa_block_index"] + (["crepa_teacher_block_index"] if cfg.crepa_use_backbone_features else [])


def _check_indexes(cfg: Any, count: int) -> None:
    """The aligned blocks against a model of `count` blocks and TREAD's routes there (resolved as TREAD does)."""
    check_indexes(cfg, {key: getattr(cfg, key) for key in _aligned_blocks(cfg)}, count, CrepaError)


def check_before_load(cfg: Any, build_tiny: bool = True) -> None:
    """The block indexes against the transformer's config.json, before any model loads (`difftune check` too), where
    its depth is known then (train/tread.blocks_before_load); otherwise `check_block` checks them once it loads."""
    if not cfg.crepa_enabled:
        return
    from difftune.train.tread import blocks_before_load

    count = blocks_before_load(cfg, build_tiny)
    if count is not None:
        _check_indexes(cfg, count)


def check_block(cfg: Any, family: Any, transformer: torch.nn.Module) -> None:
    """crepa_block_index (and crepa_teacher_block_index) against the loaded model's blocks and the TREAD routes, and
    crepa_encoder's config (read from its folder or the hub): called before caching too, so what cannot be used
    fails before the caches fill."""
    if not cfg.crepa_enabled:
        return
    if not cfg.crepa_use_backbone_features:
        from transformers import AutoConfig

        source = ENCODER_ALIASES.get(cfg.crepa_encoder, cfg.crepa_encoder)
        try:
            AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise CrepaError(f"crepa_encoder {cfg.crepa_encoder!r}: cannot load DINOv2 from {source!r} "
                             f"({str(e).splitlines()[0]}); name a transformers DINOv2 model id such as "
                             "facebook/dinov2-small, or a local folder holding one") from e
    count = len(LAYOUTS[family.tread_layout].blocks(transformer))
    _check_indexes(cfg, count)


class Crepa:
    def __init__(self, cfg: Any, family: Any, comps: Any, device: torch.device):
        self.cfg, self.family, self.comps, self.device = cfg, family, comps, device
        transformer = comps.transformer
        check_block(cfg, family, transformer)
        config = transformer.config
        hidden = getattr(config, "hidden_size", None) or config.model_dim
        self.patch = spatial_patch(transformer)
        # backbone mode: the teacher is block crepa_teacher_block_index of the same call, of the same width
        self.backbone = bool(cfg.crepa_use_backbone_features)
        self.encoder = None if self.backbone else load_encoder(cfg.crepa_encoder, device,
                                                               encoder_dtype(cfg.weight_dtype_name()))
        width = hidden if self.encoder is None else self.encoder.config.hidden_size
        self.module = projector(hidden, width, cfg.seed).to(device)
        self.forward_module: Any = self.module  # accelerate's prepared (DDP) module with several processes
        self.processes = 1
        self.ungated: torch.Tensor | None = None  # the last term before crepa_similarity_threshold's gate
        # crepa_similarity_threshold: the moving average and the permanent cut, kept on the device (no host read)
        self.similarity: torch.Tensor | None = None
        self.cut = torch.zeros((), dtype=torch.bool, device=device)
        # backbone mode: the teacher block's output is a frozen target, taken without gradient
        teacher = [cfg.crepa_teacher_block_index] if self.backbone else []
        self.taps = Taps(transformer, family.tread_layout, [cfg.crepa_block_index, *teacher], detached=teacher)
        vae = comps.vae
        if not self.backbone and vae is not None and vae.device != device:  # decoded every step: on the accelerator
            vae.to(device)

    def prepare(self, accelerator: Any, processes: int) -> None:
        """Several processes: the projector in accelerate's DDP wrapper, so its gradients are averaged too."""
        self.processes = processes
        if processes > 1:
            self.forward_module = accelerator.prepare(self.module)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    @property
    def captured(self) -> torch.Tensor | None:
        """The student block's output in the last training call (None once `term` took it, or outside training)."""
        return self.taps.output(self.cfg.crepa_block_index)

    @property
    def teacher(self) -> torch.Tensor | None:
        return self.taps.output(self.cfg.crepa_teacher_block_index) if self.backbone else None

    def _targets(self, x0: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """What the projected tokens align with, on the token grid: [B, T, h*w, D]."""
        if not self.backbone:
            return self._encoded(x0, grid)
        return self.taps.tokens(self.cfg.crepa_teacher_block_index, grid,
                                "CREPA: block crepa_teacher_block_index").float()

    @torch.no_grad()
    def _encoded(self, x0: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """DINOv2 patch features of the clean frames, on the token grid: [B, T, h*w, D]."""
        vae = self.comps.vae
        z = x0.to(vae.device, vae.dtype) / vae.config.scaling_factor
        if self.family.facts.name in SHIFTED_LATENTS:
            z = z + vae.config.shift_factor
        pixels = vae.decode(z).sample.float()
        t, h, w = grid
        if pixels.dim() == 5:  # [B, 3, F, H, W]: latent frame t stands for pixel frames 4t-3..4t; take 4t
            frames = pixels.shape[2]
            step = (frames - 1) // max(t - 1, 1) if t > 1 else 0
            pixels = pixels[:, :, [min(i * step, frames - 1) for i in range(t)]].transpose(1, 2).flatten(0, 1)
        size = self.cfg.crepa_encoder_image_size
        x = F.interpolate((pixels.clamp(-1, 1) + 1) / 2, size=(size, size), mode="bicubic", align_corners=False)
        mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
        x = ((x - mean) / std).to(self.device, self.encoder.dtype)
        out = self.encoder(pixel_values=x).last_hidden_state
        skip = 1 + getattr(self.encoder.config, "num_register_tokens", 0)  # the CLS token (and any registers)
        side = size // self.encoder.config.patch_size
        patches = out[:, skip : skip + side * side].float()
        patches = patches.reshape(-1, side, side, patches.shape[-1]).permute(0, 3, 1, 2)
        patches = F.interpolate(patches, size=(h, w), mode="bilinear", align_corners=False)
        return patches.flatten(2).transpose(1, 2).reshape(x0.shape[0], t, h * w, -1)

    def term(self, x0: torch.Tensor) -> torch.Tensor:
        """The alignment loss of the last training call of the transformer (unweighted: see `weight`)."""
        grid = token_grid(x0, self.patch)
        frames = grid[0]
        tokens = self.forward_module(self.taps.tokens(self.cfg.crepa_block_index, grid,
                                                      "CREPA: block crepa_block_index").float())
        targets = self._targets(x0, grid).to(tokens.device)
        if not self.cfg.crepa_spatial_align:  # one vector per frame on each side
            tokens, targets = tokens.mean(dim=2, keepdim=True), targets.mean(dim=2, keepdim=True)
        distance = self.cfg.crepa_adjacent_distance if frames > 1 else 0
        loss = alignment(tokens, targets, distance, self.cfg.crepa_adjacent_tau, self.cfg.crepa_normalize_by_frames,
                         self.cfg.crepa_cumulative_neighbors)
        self.taps.clear()
        self.ungated = loss.detach()  # the step event's crepa_loss, also while the threshold has cut the term off
        if self.cfg.crepa_similarity_threshold is not None:
            loss = loss * self._gate(F.cosine_similarity(tokens, targets, dim=-1).mean().detach())
        return loss

    def _gate(self, similarity: torch.Tensor) -> torch.Tensor:
        """crepa_similarity_threshold: 1.0 while the alignment applies, 0.0 once it is cut. The moving average is
        of every process's similarity (so all of them cut at the same step), updated on the device."""
        if self.processes > 1:
            import torch.distributed as dist

            dist.all_reduce(similarity)
            similarity = similarity / self.processes
        decay = self.cfg.crepa_similarity_ema_decay
        self.similarity = similarity if self.similarity is None else decay * self.similarity + (1 - decay) * similarity
        reached = self.similarity >= self.cfg.crepa_similarity_threshold
        if self.cfg.crepa_threshold_mode == "recoverable":
            return (~reached).float()
        self.cut = self.cut | reached
        return (~self.cut).float()

    def target(self) -> dict[str, str]:
        """What the projector was trained for, saved in its file's metadata: a resume that aligns anything else
        (another mode, encoder, width or block) starts a fresh projector (`mismatch`)."""
        encoder = ENCODER_ALIASES.get(self.cfg.crepa_encoder, self.cfg.crepa_encoder)  # the weights, however named
        teacher = f"block {self.cfg.crepa_teacher_block_index}" if self.backbone else f"DINOv2 {encoder}"
        width = self.module[-1].out_features
        return {"student": f"block {self.cfg.crepa_block_index}", "teacher": teacher, "width": str(width)}

    def mismatch(self, folder: Path) -> str | None:
        """Why the checkpoint's projector does not fit this run's CREPA (None when it does). A file of an earlier
        difftune has no metadata: its tensor shapes decide."""
        from safetensors import safe_open

        with safe_open(str(folder / PROJECTOR_FILE), framework="pt") as f:
            saved = f.metadata() or {}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open's keys()
        now = self.target()
        if saved and saved != now:
            was = ", ".join(f"{k} {saved.get(k, '?')}" for k in now)
            return f"its CREPA projector was trained for {was}, and this run aligns {', '.join(f'{k} {v}' for k, v in now.items())}"
        if shapes != {k: tuple(v.shape) for k, v in self.module.state_dict().items()}:
            return "its CREPA projector has other shapes than this run's (another encoder width or transformer)"
        return None

    def save(self, folder: Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in self.module.state_dict().items()},
                  folder / PROJECTOR_FILE, metadata=self.target())
        if self.similarity is not None:
            save_file({"average": self.similarity.detach().float().cpu().reshape(1),
                       "cut": self.cut.float().cpu().reshape(1)}, folder / SIMILARITY_FILE)

    def load(self, folder: Path) -> None:
        if not (folder / PROJECTOR_FILE).is_file():
            raise ValueError(f"{folder} has no CREPA projector ({PROJECTOR_FILE}) but crepa_enabled is on; resume "
                             "with crepa_enabled false, or start a new output_dir")
        if self.mismatch(folder) is not None:  # the resume's warning said so: a fresh projector and similarity
            return
        self.module.load_state_dict(load_file(folder / PROJECTOR_FILE))
        if (folder / SIMILARITY_FILE).is_file():  # absent: no average yet (or no threshold when it was saved)
            state = load_file(folder / SIMILARITY_FILE)
            self.similarity = state["average"].reshape(()).to(self.device)
            self.cut = state["cut"].reshape(()).to(self.device) > 0.5


class DroppedEncoder(torch.nn.Module):
    """Stands where the VAE's encoder was (no parameters): a call fails with the reason, not a NoneType error."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"the VAE's {self.name} was freed after caching (crepa_drop_vae_encoder), but something "
                           "tried to encode pixels; set crepa_drop_vae_encoder to false")


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def drop_vae_encoder(vae: Any, emit: Callable[..., None]) -> int:
    """Free the encode-only submodules of `vae` (crepa_drop_vae_encoder); returns the bytes they held."""
    names = ENCODE_ONLY.get(type(vae).__name__)
    if names is None:
        raise CrepaError(f"crepa_drop_vae_encoder: difftune does not know which parts of a {type(vae).__name__} VAE "
                         "only encode; set crepa_drop_vae_encoder to false")
    gone: list[tuple[str, weakref.ref, int]] = []
    for name in names:
        module = getattr(vae, name, None)
        if module is None or isinstance(module, DroppedEncoder):  # AutoencoderKL(use_quant_conv=False): none
            continue
        gone.append((name, weakref.ref(module), _bytes(module)))
        setattr(vae, name, DroppedEncoder(name))
        del module
    gc.collect()  # the patch_conv wrappers (models/patch_conv.py) are reference cycles through the convs
    held = [name for name, ref, _ in gone if ref() is not None]
    if held:  # not given back while anything else references them: not counted as freed
        emit("warning", message=f"crepa_drop_vae_encoder: the VAE's {', '.join(held)} is still referenced elsewhere; "
                                "its memory is not released")
    dropped = [name for name, _, _ in gone]
    freed = sum(size for name, _, size in gone if name not in held)
    emit("info", message=f"crepa_drop_vae_encoder: the VAE's {' and '.join(dropped) or 'encoder'} freed after "
                         f"caching ({freed / 2**20:.1f} MiB)", freed_bytes=freed, modules=dropped)
    return freed


def attach(cfg: Any, family: Any, comps: Any, device: torch.device) -> Crepa | None:
    """Hook CREPA onto the (unwrapped) transformer; None when crepa_enabled is off."""
    return Crepa(cfg, family, comps, device) if cfg.crepa_enabled else None


def weight(cfg: Any, step: int, total_steps: int) -> float:
    """The alignment loss's weight at optimizer step `step` (steps done so far): a linear warm-up from 0 to
    crepa_lambda over crepa_warmup_steps, then crepa_scheduler's way to crepa_lambda_end over crepa_decay_steps
    (0: the rest of the run), and 0 from crepa_cutoff_step on."""
    if cfg.crepa_cutoff_step and step >= cfg.crepa_cutoff_step:
        return 0.0
    peak, warmup = cfg.crepa_lambda, cfg.crepa_warmup_steps
    if step < warmup:
        return peak * step / warmup
    if cfg.crepa_scheduler == "constant":
        return peak
    span = cfg.crepa_decay_steps or max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    end = cfg.crepa_lambda_end
    if cfg.crepa_scheduler == "linear":
        return peak + (end - peak) * progress
    if cfg.crepa_scheduler == "cosine":
        return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return end + (peak - end) * (1.0 - progress) ** cfg.crepa_power  # polynomial


def add_term(run: Any, loss: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The flow loss plus the weighted CREPA term (the loss unchanged when CREPA is off, or its weight is 0 at
    this step: then the VAE decode and the DINOv2 pass are skipped too)."""
    crepa = getattr(run, "crepa", None)
    if crepa is None:
        return loss
    w = weight(run.cfg, run.state.step, run.total_steps)
    if w == 0.0:
        crepa.taps.clear()
        return loss
    term = crepa.term(x0).to(loss.device)
    run.record("crepa_loss", crepa.ungated)  # unweighted and ungated, for the step's event (a step of weight 0: none)
    return loss + w * term
