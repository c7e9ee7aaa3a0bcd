"""Build everything a run needs, as a straight sequence of named steps: `build_run(cfg)`.

Order matters for memory: discover data (no model), load the model, fill the text cache and drop
the text encoder, fill the latent cache and park the VAE, then attach the adapter and optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from difftune.adapters.kinds import Adapter, build_adapter
from difftune.config import RunConfig, TrainConfig
from difftune.data.batches import TrainingData
from difftune.data.repeats import RepeatsPlan
from difftune.data.report import LIST_LIMIT, DataReport
from difftune.models import get_family, is_tiny, tiny_model
from difftune.models.base import Components, Family, SampleRequest
from difftune.models.flops import Flops
from difftune.models.quantize import quantize_text_encoders, quantize_transformer
from difftune.models.sources import ModelSource
from difftune.train import (
    attention,
    crepa,
    eval_loss,
    evaluation,
    hub,
    layersync,
    scripts,
    throughput,
    trackers,
    tread,
    validation_input,
    webhooks,
)
from difftune.train.activation_offload import offload_activations
from difftune.train.caching import Cached, fill_caches
from difftune.train.commands import stop_while
from difftune.train.compile import compile_transformer
from difftune.train.distributed import Ranks, outside, ranks_of
from difftune.train.ema import EMA
from difftune.train.events import Events, failures_reported
from difftune.train.fsdp import Sharded, ram_efficient, shard, transformer_on_meta
from difftune.train.lr_schedule import build_lr_scheduler, learning_rate, warmup_too_long
from difftune.train.memory import record_peak_memory
from difftune.train.objective import TimestepSampling
from difftune.train.offload import BlockStreamer, stream_blocks
from difftune.train.optimizer_offload import host_step
from difftune.train.optimizers import build_optimizer, small_update_advice
from difftune.train.plan import (
    DataError,
    discover_all,
    fetch_sources,
    generate_conditioning,
    plan_buckets,
    size_rules,
)
from difftune.train.throughput import Throughput
from difftune.train.torch_options import apply_torch_options
from difftune.train.windows import WindowError, bucket_sampler, check_windows, total_steps

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    position: dict | None = None  # the sampler's state after the last batch consumed (what a checkpoint saves)
    micro: int = 0  # the micro-batch of the step being trained (round-robin noise levels: train/noise_levels.py)
    checkpointed: int | None = None  # the step of the last checkpoint this run wrote or resumed (not a rolling one)
    validation_memory: bool = False  # the first validation's "memory" event is written (train/memory.py)


@dataclass
class Run:
    cfg: TrainConfig
    accelerator: Accelerator
    family: Family
    comps: Components
    transformer: Any  # prepared (possibly wrapped) module
    adapter: Adapter
    params: list[torch.nn.Parameter]
    optimizer: Any
    lr_scheduler: Any
    data: TrainingData
    validation: list[SampleRequest]
    events: Events
    output_dir: Path
    total_steps: int
    generator: torch.Generator
    ema: EMA | None = None
    sampling: TimestepSampling = field(default_factory=TimestepSampling)
    ranks: Ranks = field(default_factory=Ranks)
    state: TrainState = field(default_factory=TrainState)
    first_frame: bool = False  # image-to-video: each clip's first frame conditions the rest
    streamer: BlockStreamer | None = None  # block streaming (train/offload.py), when on
    fsdp: Sharded | None = None  # FSDP2 (train/fsdp.py), when on with several processes
    evaluator: Any = None  # CLIP evaluation (train/evaluation.py), loaded before the caches fill
    validated: Any = None  # (step, samples) of the last validation's live weights, which an evaluation due then scores
    eval_set: Any = None  # the eval datasets' batches (train/eval_loss.py), when the run has some
    crepa: crepa.Crepa | None = None  # CREPA / REPA (train/crepa.py), when crepa_enabled
    layersync: layersync.LayerSync | None = None  # LayerSync (train/layersync.py), when layersync_enabled
    averaged: list[torch.nn.Parameter] = field(default_factory=list)  # several processes: grads averaged by hand
    tread: tread.Router | None = None  # TREAD's hooks (train/tread.py), when tread_config routes tokens
    hub: Any = None  # push_to_hub's uploader (train/hub.py) on process 0: whether the result reached the hub
    # TFLOP/s, tokens/s, MFU and peak memory of each step (train/throughput.py); loop.optimizer_step adds batches
    throughput: Throughput = field(default_factory=lambda: Throughput(lambda *_: Flops(), full=False))
    # the regularizers' figures of this step's micro-batches (device scalars, read with the losses: no sync each)
    terms: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def record(self, name: str, value: torch.Tensor) -> None:
        """A figure of this micro-batch for the step's event (its mean over the step and the processes)."""
        self.terms.setdefault(name, []).append(value.detach().float().reshape(()))


def resolve_source(cfg: TrainConfig) -> str:
    if cfg.pretrained_model_name_or_path is None and is_tiny(cfg.flavour()):
        return str(tiny_model(cfg.model_family, cfg.flavour()))
    return cfg.model_source()


def model_sources(cfg: TrainConfig) -> ModelSource:
    """Where each part of the model loads from: the main model, and the transformer, VAE, revision and variant of
    config/model_source_keys.py."""
    return cfg.model_sources(resolve_source(cfg))


def _elsewhere(where: ModelSource) -> str:
    parts = [f"transformer from {where.transformer_label()}" if where.transformer_label() != where.model else "",
             f"VAE from {where.vae}" if where.vae else "", f"revision {where.revision}" if where.revision else "",
             f"variant {where.variant}" if where.variant else ""]
    return "".join(f"; {p}" for p in parts if p)


def set_text_length(cfg: TrainConfig, family: Family, comps: Components, source: str) -> None:
    """tokenizer_max_length: checked against what the loaded model takes (the config checked its pipeline's bound)."""
    if cfg.tokenizer_max_length is None:
        return
    limit = family.text_length_limit(comps)
    if cfg.tokenizer_max_length > limit:
        raise DataError(f"tokenizer_max_length {cfg.tokenizer_max_length}: the model at {source} takes prompts of at "
                        f"most {limit} tokens; set tokenizer_max_length to {limit} or less (or remove it for "
                        f"{family.facts.text_length(cfg.flavour())}, the pipeline's default)")
    comps.text_length = cfg.tokenizer_max_length


def build_data(
    run_cfg: RunConfig, family: Family, cached: Cached, events: Events, encode: Any = None,
    ranks: Ranks | None = None,
) -> tuple[TrainingData, RepeatsPlan]:
    """Items with repeats (raised for small datasets by allow_dataset_oversubscription), bucket pruning per
    dataset (data/repeats.py), the sampler and the batch source. With several processes the sampler draws global
    batches (train_batch_size per process) and each takes a slice."""
    ranks = ranks or Ranks()
    cfg = run_cfg.train
    datasets = run_cfg.datasets.images
    lost = sorted({ds.id for ds in datasets} - {c.sample.dataset_id for c in cached.samples})
    if lost:  # the files' reasons here: the data report that names them comes after this point
        shown = [f"\n  {path}: {reason}" for path, reason in cached.failed[:5]]
        more = f"\n  ... and {len(cached.failed) - 5} more (events.jsonl has each)" if len(cached.failed) > 5 else ""
        raise DataError(f"dataset(s) {', '.join(map(repr, lost))} have no file (image or clip) that could be "
                        "decoded" + (":" + "".join(shown) + more if shown else ""))
    # the same plan `difftune check` and discover_all make before any model loads (train/plan.py), now on the
    # files that decoded; it raises when every bucket holds fewer items than one global batch
    try:
        plan = plan_buckets(run_cfg, [c.sample for c in cached.samples], ranks.count)
    except DataError as e:  # files that failed while caching may be why (the data report naming them comes later)
        if not cached.failed:
            raise
        shown = "".join(f"\n  {path}: {reason}" for path, reason in cached.failed[:5])
        more = f"\n  ... and {len(cached.failed) - 5} more (events.jsonl has each)" if len(cached.failed) > 5 else ""
        raise DataError(f"{e}\n{len(cached.failed)} file(s) could not be decoded while caching:{shown}{more}") from e
    sampler, items = bucket_sampler(run_cfg, cached.samples, plan, ranks.count)
    data = TrainingData(
        items, cached.text_caches, sampler, family.collate_text, cfg.caption_dropout_probability, cfg.seed,
        encode=encode, on_skip=lambda message: events.emit("warning", message=message),
        rank=ranks.index, ranks=ranks.count, first_frame=family.facts.first_frame(cfg.flavour()),
        regularisation=frozenset(ds.id for ds in datasets if ds.is_regularisation_data), ondemand=cached.ondemand,
    )
    return data, plan


@dataclass
class Prepared:
    family: Family
    comps: Components
    data: TrainingData
    validation: list[SampleRequest]
    eval_set: Any = None  # dataset_type 'eval' (train/eval_loss.py)


def prepare_data(run_cfg: RunConfig, events: Events, device: torch.device, ranks: Ranks | None = None) -> Prepared:
    """Discover, load the model, fill every cache, free the encoders, build the batch source."""
    ranks = ranks or Ranks()
    cfg = run_cfg.train
    family = get_family(cfg.model_family)
    failed = None
    if ranks.main:  # datasets of type huggingface, csv or aws are downloaded once, by one process; then the
        say = lambda message: events.emit("info", message=message)  # noqa: E731  generated conditioning images
        try:
            fetch_sources(run_cfg, say)
            generate_conditioning(run_cfg, say)
        except DataError as e:
            failed = str(e)
    # the others wait for process 0, and stop with its error rather than with the collective it never joins
    if (failed := ranks.broadcast(failed)) is not None:
        raise DataError(failed)
    # fails before any model loads where no bucket holds one global batch (the plan build_data makes again below)
    found = discover_all(run_cfg, write_metadata=ranks.main, fetch=False, processes=ranks.count, prepared=True)
    for path, reason in (item for d in found for item in d.skipped):
        events.emit("warning", quiet=True, message=f"skipped {path}: {reason}")  # the data report lists them
    events.emit("info", message=f"discovery: {sum(len(d.samples) for d in found)} usable files "
                                f"({sum(d.probed for d in found)} read now, the rest from the metadata cache)")
    validation_input.pick(run_cfg, found)  # no readable validation input image fails before any model loads

    if ranks.main:  # a tiny model is built once, by one process (libraries save weights from process 0 only)
        resolve_source(cfg)
    ranks.barrier()
    where = model_sources(cfg)
    source = where.model
    events.emit("info", message=f"loading {cfg.model_family} from {source}" + _elsewhere(where))
    with transformer_on_meta(cfg, ranks):  # fsdp_cpu_ram_efficient_loading: only process 0 reads its weights
        comps = family.load(where, DTYPES[cfg.weight_dtype_name()], vae_dtype=DTYPES.get(cfg.vae_dtype))
    if family.takes_conditioning(comps) != family.facts.takes_input_image(cfg.flavour()):
        kind = "an image-conditioned (i2i/i2v)" if family.takes_conditioning(comps) else "a text-only"
        raise DataError(
            f"{source} holds {kind} model, but model_flavour {cfg.flavour()!r} says otherwise; "
            f"set model_flavour to a matching flavour of {cfg.model_family}"
        )
    set_text_length(cfg, family, comps, source)  # before any caption is encoded (the text cache's fingerprint)
    park = cfg.offload_during_startup or cfg.enable_model_cpu_offload  # the transformer waits while caches fill
    streamed = bool(cfg.enable_group_offload or cfg.musubi_blocks_to_swap)  # its blocks' weights stay in CPU memory
    # Before it reaches the accelerator (quantize_via 'cpu') and before any adapter wraps its layers.
    quantize_transformer(comps.transformer, cfg.base_model_precision, cfg.quantize_via, device,
                         park=park or streamed, emit=events.emit)
    # Before any caption is encoded (the text cache's fingerprint holds these precisions).
    quantize_text_encoders(comps.text, cfg.text_encoder_precisions(), family.facts.text_encoders, cfg.quantize_via,
                           device, emit=events.emit)
    tread.check(cfg.tread_config, family, comps.transformer)  # a route that does not fit fails now, not after caching
    crepa.check_block(cfg, family, comps.transformer)  # so does a CREPA block out of range or inside a route
    layersync.check_blocks(cfg, family, comps.transformer)  # and a LayerSync block
    # Block streaming keeps the transformer in CPU memory until train/offload.py has taken its blocks' weights;
    # fsdp_cpu_ram_efficient_loading keeps it where it is (process 0's CPU, or meta) until fsdp.shard.
    if not park and not (streamed or ram_efficient(cfg, ranks)):
        # a transformer too large for the accelerator fails now, not after caching
        comps.transformer.to(device)
    record_peak_memory(events, "model load", device)
    # the web UI's Stop: at once, the caches kept (one process: several stop together at the loop's next step)
    with stop_while(Path(cfg.output_dir), "caching", on=ranks.count == 1):
        cached = fill_caches(run_cfg, family, comps, found, size_rules(run_cfg), device, events, ranks)
    record_peak_memory(events, "caching", device)
    apply_torch_options(cfg, comps.vae)  # after caching: cached latents never depend on tiling
    encode = (lambda px: family.encode_images(comps, px)) if cached.on_the_fly else None
    data, repeats = build_data(run_cfg, family, cached, events, encode, ranks)
    eval_set = eval_loss.prepare(run_cfg, family, cached, encode, events)  # held out: never in `data`
    report = DataReport(found, cached.failed, repeats.pruned, data, repeats=repeats.changes)
    events.write(report.render(LIST_LIMIT, "the data_report event in events.jsonl lists them all"))
    events.emit("data_report", quiet=True, text=report.render())
    return Prepared(family, comps, data, cached.validation, eval_set)


def build_run(run_cfg: RunConfig, events: Events | None = None) -> Run:
    cfg = run_cfg.train
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # accelerate keeps mixed precision in a process-wide singleton; a second run in the same process
    # (the web UI's tests, a notebook) must be able to choose its own. The distributed state is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=not torch.cuda.is_available(),
                              log_with=trackers.log_with(cfg),
                              project_dir=str(trackers.tracker_folder(output_dir, cfg.logging_dir)))
    ranks = ranks_of(accelerator)
    attention.check(cfg, accelerator.device)  # a kernel this device cannot run fails before any model loads
    one = ranks.count == 1  # a tiny flavour is built here by one process alone (several: checked once it loads)
    tread.check_before_load(cfg, one)  # so does a TREAD route past the transformer's last block
    crepa.check_before_load(cfg, one)  # and a CREPA block past it
    layersync.check_before_load(cfg, one)  # and a LayerSync block
    if cfg.lora_type == "lycoris":  # so does a LyCORIS algo this device's autocast cannot serve
        from difftune.adapters.lycoris import check_device, check_preset

        check_device(cfg, accelerator.device)
        check_preset(cfg, build_tiny=ranks.count == 1)  # and an apply_preset that matches no module of the model
    from difftune.adapters.targets import check_targets

    check_targets(cfg, build_tiny=ranks.count == 1)  # and lora_target_modules that name no layer
    if events is None:  # one event log and one progress bar: process 0's
        events = Events(output_dir / "events.jsonl") if ranks.main else Events(None, console=False)
    webhooks.attach(cfg, events, ranks.main)  # webhook_config: the first subscriber, closed last
    if cfg.mixed_precision == "fp16" and accelerator.device.type == "cpu":  # accelerate's CPU autocast is bf16 only
        events.emit("warning", message="mixed_precision 'fp16' has no autocast on the CPU: this run computes in the "
                    f"weights' dtype ({cfg.weight_dtype_name()}); use 'bf16' for mixed precision here, or 'no'")
    with failures_reported(events, "setup"):  # a failure from here on is an "error" event the webhooks send
        hub.check_access(cfg, ranks)  # push_to_hub: the login and the repository, before any model loads
        scorer = evaluation.preload(cfg, ranks.main)  # evaluation_type 'clip': fails now, not at the first evaluation
        run = _build(run_cfg, accelerator, ranks, events)
        run.evaluator = scorer
        return run


def _build(run_cfg: RunConfig, accelerator: Accelerator, ranks: Ranks, events: Events) -> Run:
    cfg = run_cfg.train
    output_dir = Path(cfg.output_dir)
    trackers.attach(cfg, accelerator, events, output_dir, ranks.main)  # report_to: events -> trackers
    prepared = prepare_data(run_cfg, events, accelerator.device, ranks)
    family, comps, data = prepared.family, prepared.comps, prepared.data
    attention.apply(cfg, comps.transformer, accelerator.device, events.emit)  # attention_mechanism

    if not (cfg.enable_group_offload or cfg.musubi_blocks_to_swap or cfg.fsdp_enable):
        # Parked during caching (offload_during_startup): on the accelerator before the adapter attaches, since
        # LyCORIS builds its network on the transformer's device and accelerate moves only the transformer.
        comps.transformer.to(accelerator.device)
    torch.manual_seed(cfg.seed)  # peft draws the initial lora_A from the global RNG: same seed, same run
    adapter = build_adapter(cfg, family, comps.transformer)
    for message in getattr(adapter, "warnings", []):  # LyCORIS's: a preset target that matched nothing, ...
        events.emit("warning", message=f"LyCORIS ({cfg.lycoris_config}): {message}")
    # fsdp_enable: shards the transformer in place (its parameters become DTensors) before the optimizer sees them
    sharded = shard(cfg, comps.transformer, adapter, ranks, accelerator.device, events.emit)
    params = adapter.parameters()
    streamer = stream_blocks(cfg, family.facts.block_stacks, comps.transformer, params, accelerator.device,
                             events.emit)  # enable_group_offload, musubi_blocks_to_swap: blocks visit in turn
    offload_activations(cfg, comps.transformer, accelerator.device, events.emit)  # gradient_checkpointing_backend
    if (advice := small_update_advice(cfg)) is not None:
        events.emit("warning", message=f"full fine-tune of bf16/fp16 weights with optimizer '{cfg.optimizer}' loses "
                                       f"small updates to rounding; use {advice}")
    aligner = crepa.attach(cfg, family, comps, accelerator.device)  # crepa_enabled: its projector trains too
    rate = learning_rate(cfg, ranks.count, events.emit)  # lr_scale, lr_scale_sqrt: the rate that trains
    build = lambda trained: build_optimizer(cfg.optimizer, trained, rate, (cfg.adam_beta1, cfg.adam_beta2),  # noqa: E731
                                            cfg.adam_weight_decay, cfg.adam_epsilon, cfg.optimizer_settings(),
                                            prodigy_steps=cfg.prodigy_steps)
    # optimizer_config above; optimizer_cpu_offload_method 'cpu': built over CPU copies, stepping there
    optimizer = host_step(cfg, params + (aligner.parameters() if aligner else []), build, accelerator.device,
                          events.emit, ranks.count)
    steps = total_steps(cfg, data.sampler.batches_per_epoch())
    try:  # start_epoch/start_step/end_epoch/end_step over the whole run
        check_windows(data.sampler, steps, events.emit)
    except WindowError as e:
        raise DataError(str(e)) from e
    lr_scheduler = build_lr_scheduler(cfg, optimizer, steps, rate)  # lr_end, lr_power, lr_num_cycles: train/lr_schedule.py
    if (too_long := warmup_too_long(cfg, steps)) is not None:
        events.emit("warning", message=too_long)
    # Noise, timesteps, TREAD routes, rollouts: drawn on the accelerator (no host work, no copy), resumable
    generator = torch.Generator(device=accelerator.device).manual_seed(cfg.seed)
    router = tread.attach(cfg.tread_config, family, comps.transformer, generator,
                          family.facts.first_frame(cfg.flavour()))
    # compile / dynamo_backend: after every hook is attached (they stay outside the compiled code), before prepare
    compile_transformer(cfg, family.facts.block_stacks, comps.transformer, events.emit)
    # LyCORIS's network wraps the layers from outside the transformer: DDP, which would wrap a transformer without a
    # trained parameter, is left out, and the loop averages the network's gradients itself
    by_hand = outside(params, comps.transformer) if ranks.count > 1 and sharded is None else []
    if sharded is None and not by_hand:
        transformer, optimizer = accelerator.prepare(comps.transformer, optimizer)
    else:  # FSDP2 is the module's own wrapping: accelerate would add DDP on top; it prepares the optimizer only
        transformer, optimizer = comps.transformer, accelerator.prepare(optimizer)
    ema = EMA(params, cfg.ema_decay, cfg.ema_update_interval, cfg.ema_device) if cfg.use_ema else None
    events.total_steps = steps
    run = Run(
        cfg=cfg, accelerator=accelerator, family=family, comps=comps, transformer=transformer, adapter=adapter,
        params=params,
        optimizer=optimizer, lr_scheduler=lr_scheduler, data=data,
        validation=prepared.validation, events=events, output_dir=output_dir,
        total_steps=steps, generator=generator, ema=ema,
        sampling=TimestepSampling.of(cfg),  # timestep_sampling, flow_use_beta_schedule, flow_custom_timesteps
        ranks=ranks, first_frame=family.facts.first_frame(cfg.flavour()),
        streamer=streamer, fsdp=sharded, crepa=aligner, eval_set=prepared.eval_set, averaged=by_hand, tread=router,
        layersync=layersync.attach(cfg, family, comps.transformer),  # layersync_enabled: its blocks tapped
    )
    if aligner is not None:
        aligner.prepare(accelerator, ranks.count)
    run.throughput = throughput.build(cfg, family, comps.transformer, tread.check(cfg.tread_config, family,
                                      comps.transformer), run.first_frame, accelerator.device, events.emit)
    scripts.attach(run)  # post_checkpoint_script, post_upload_script: before the uploader (closed after it)
    hub.attach(run_cfg, run)  # push_to_hub: checkpoint and final uploads, in the background
    return run
