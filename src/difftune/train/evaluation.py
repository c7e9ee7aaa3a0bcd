"""CLIP evaluation (`evaluation_type: clip`): validation samples scored against their prompts.

The score is torchmetrics' CLIPScore: 100 x the cosine of the image and text embeddings, at least 0,
per sample; a video scores the mean over `VIDEO_FRAMES` evenly spaced frames. Each evaluation writes one
"evaluation" event (the mean, and each sample's score by name), which the trackers and the web UI's
chart read.

When: with `eval_steps_interval: 0` and no `eval_epoch_interval`, the samples of each validation
(`after_validation`, called by train/validation.py); otherwise every N optimizer steps and/or every N epochs
(`evaluate`, when train/triggers.py says so), which samples the first `num_eval_images` validation requests
without writing files, or scores a validation's samples of the same step (the last step's evaluation follows the
final validation for that).

The CLIP model is loaded once (at the first evaluation, so a run that never evaluates never loads it),
kept in CPU memory, and visits the accelerator only while it scores: it never joins training memory.
"""

from __future__ import annotations

from contextlib import suppress
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from difftune.train.fsdp import unsharded
from difftune.train.optimizers import eval_weights

if TYPE_CHECKING:
    from difftune.models.base import SampleRequest
    from difftune.train.setup import Run

VIDEO_FRAMES = 4
METRIC = "clip_score"


class ClipScorer:
    """transformers' CLIPModel + CLIPProcessor from a hub id or folder. `image_features` and
    `text_features` are the two towers; `__call__` is the score."""

    def __init__(self, source: str):
        from transformers import CLIPModel, CLIPProcessor

        self.model = CLIPModel.from_pretrained(source).eval().requires_grad_(False)
        self.processor = CLIPProcessor.from_pretrained(source)

    @staticmethod
    def _pooled(out: Any) -> torch.Tensor:
        return out.pooler_output if hasattr(out, "pooler_output") else out  # transformers 5: an output object

    def image_features(self, images: list[Image.Image], device: torch.device) -> torch.Tensor:
        pixels = self.processor(images=[i.convert("RGB") for i in images], return_tensors="pt")["pixel_values"]
        return self._pooled(self.model.get_image_features(pixel_values=pixels.to(device)))

    def text_features(self, prompts: list[str], device: torch.device) -> torch.Tensor:
        tokens = self.processor(text=prompts, return_tensors="pt", padding=True, truncation=True,
                                max_length=self.model.config.text_config.max_position_embeddings)
        return self._pooled(self.model.get_text_features(input_ids=tokens["input_ids"].to(device),
                                                         attention_mask=tokens["attention_mask"].to(device)))

    @torch.no_grad()
    def __call__(self, images: list[Image.Image], prompts: list[str], device: torch.device) -> list[float]:
        """One score per (image, prompt) pair."""
        self.model.to(device)
        try:
            image = torch.nn.functional.normalize(self.image_features(images, device).float(), dim=-1)
            text = torch.nn.functional.normalize(self.text_features(prompts, device).float(), dim=-1)
            return (100 * (image * text).sum(-1)).clamp(min=0).cpu().tolist()
        finally:
            self.model.to("cpu")  # between evaluations the accelerator holds only training


def load_scorer(cfg: Any) -> ClipScorer:
    return ClipScorer(cfg.evaluation_clip_model)


def preload(cfg: Any, main: bool) -> ClipScorer | None:
    """evaluation_type 'clip': the scorer, loaded before the caches fill (on process 0, which evaluates). Loaded at
    the first evaluation instead, a model that cannot be loaded (offline, a typo) ended the run there, before the
    checkpoint of that step. It waits on the CPU between evaluations either way."""
    if cfg.evaluation_type != "clip" or not main:
        return None
    from difftune.models.hub import ComponentError

    try:
        return load_scorer(cfg)
    except (OSError, ValueError) as e:  # transformers: OSError for a missing or unreachable repository
        raise ComponentError(f"evaluation_clip_model {cfg.evaluation_clip_model!r} (SimpleTuner's "
                             "pretrained_evaluation_model_name_or_path) cannot be loaded "
                             f"({str(e).splitlines()[0][:200]}); give a CLIP model folder or a reachable hub id, or "
                             "set evaluation_type none") from e


def frames_of(result: Image.Image | list[Image.Image]) -> list[Image.Image]:
    """The images a sample is scored on: itself, or a few evenly spaced frames of a video."""
    if not isinstance(result, list):
        return [result]
    n = min(VIDEO_FRAMES, len(result))
    return [result[round(i * (len(result) - 1) / max(1, n - 1))] for i in range(n)]


def sample_name(request: SampleRequest) -> str:
    size = f"{request.width}x{request.height}" + (f"@{request.frames}" if request.frames else "")
    return f"{request.name or 'validation'}-{size}"


def scored(requests: list[SampleRequest], limit: int | None) -> list[SampleRequest]:
    """The requests an evaluation scores: those with a prompt (not the unconditional sample), the first `limit`."""
    chosen = [r for r in requests if r.prompt]
    return chosen if limit is None else chosen[:limit]


def score(run: Run, results: list[tuple[SampleRequest, Any]]) -> float | None:
    """Score (request, image or frames) pairs, write the "evaluation" event; returns the mean."""
    keep = {id(r) for r in scored([r for r, _ in results], run.cfg.num_eval_images)}
    results = [(r, out) for r, out in results if id(r) in keep]
    if not results:
        return None
    if run.evaluator is None:
        run.evaluator = load_scorer(run.cfg)
    scores = {}
    for request, out in results:
        frames = frames_of(out)
        values = run.evaluator(frames, [request.prompt] * len(frames), run.accelerator.device)
        scores[sample_name(request)] = sum(values) / len(values)
    mean = sum(scores.values()) / len(scores)
    run.events.emit("evaluation", step=run.state.step, metric=METRIC, value=mean, scores=scores,
                    message=f"CLIP score at step {run.state.step}: {mean:.2f} (mean of {len(scores)})")
    return mean


def after_validation(run: Run, results: list[tuple[SampleRequest, Any]], reusable: bool) -> None:
    """Without a schedule (eval_steps_interval 0, no eval_epoch_interval), each validation's samples are scored.
    With one, the samples are kept for an evaluation due at the same step when they are what it would sample
    (`reusable`: the live weights, each request's own seed): sampling them twice doubled that step's sampling."""
    cfg = run.cfg
    if cfg.evaluation_type != "clip":
        return
    if cfg.eval_steps_interval == 0 and not cfg.eval_epoch_interval:
        score(run, results)
    elif reusable:
        run.validated = (run.state.step, results)


def evaluate(run: Run) -> None:
    """Score the requests an evaluation scores: this step's validation samples when it just made them, else
    sampled here (no files written); process 0 alone."""
    from difftune.train.validation import SamplingAbandoned, sample_requests

    validated, run.validated = run.validated, None
    with eval_weights(run), unsharded(run):  # schedule-free: its averaged weights; FSDP: the weights whole
        if run.ranks.main:
            if validated is not None and validated[0] == run.state.step:
                score(run, validated[1])
            else:
                with suppress(SamplingAbandoned):  # a stop signal came: the run stops after this step
                    score(run, sample_requests(run, scored(run.validation, run.cfg.num_eval_images)))
    run.ranks.barrier()

