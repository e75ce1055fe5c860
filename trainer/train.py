"""The training loop: build, (resume,) train, validate, checkpoint, summarise.

    run(cfg, run_dir, resume=None) -> exit code (0 ok, 1 failure, 3 stopped on a signal)

Order of model construction (torchtitan's): build (on the meta device for very
large FSDP models) -> kernels.patch -> FP8 linear layers (precision.fp8) ->
activation checkpointing -> torch.compile of the blocks -> DDP / FSDP2 ->
materialise and init -> the weights of a --resume checkpoint, or else of
checkpoint.init_from's Hugging Face directory (trainer/hf). The loop makes no host sync per step except at the log
interval (loss and grad norm fetched there).
"""
from __future__ import annotations

import contextlib
import datetime
import time
from pathlib import Path

import torch

from core import names, runfiles
from trainer import distributed, fp8, guards, health, metrics, numeric, optim, saved_activations
from trainer.config import SYNTHETIC, TrainConfig
from trainer.data.check import check_data
from core.errors import UserError
from trainer.guards import GuardSkip
from trainer.models import IGNORE_INDEX, Transformer, flops_per_token, linear_cross_entropy
from trainer.models import moe, multi_token
from trainer.plan import ParamCount


class TrainError(UserError):
    """A problem the user can fix (missing kernels package, data that does not fit, ...)."""


EXIT_OK, EXIT_FAILED = 0, 1
LARGE_MODEL = 100_000_000   # parameters: building one takes long enough to say so first


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is the whole story (no traceback for the user); each carries its exit
    status (2 for what the user can fix; numeric.NumericFault: 5)."""
    from trainer.checkpoint import CheckpointError
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.hf import InitError
    from trainer.profiling import ProfileSettingsError
    return (ConfigError, DataError, CheckpointError, distributed.DistributedError, TrainError,
            ProfileSettingsError, fp8.Fp8Error, InitError, numeric.NumericFault)


# --------------------------------------------------------------------------- data

def make_loader(cfg: TrainConfig, split: str, info: distributed.DistInfo, shuffle: bool = True):
    """The loader of `split`: data.path's, or one stream of data.blend's datasets (always shuffled)."""
    if not cfg.data.blend:
        return _dataset_loader(cfg, cfg.data.path, split, info, shuffle)
    from trainer.data import BlendLoader
    return BlendLoader([(s.name, s.path, s.weight) for s in cfg.data.blend], split, cfg.data.seq_len,
                       cfg.data.batch_size, info.layout.dp_rank, info.layout.dp, cfg.train.seed,
                       vocab_size=cfg.model.vocab_size)


def _dataset_loader(cfg: TrainConfig, path: str, split: str, info: distributed.DistInfo, shuffle: bool = True):
    from trainer.data import TokenLoader
    return TokenLoader(path, split, cfg.data.seq_len, cfg.data.batch_size,
                       info.layout.dp_rank, info.layout.dp, cfg.train.seed, shuffle=shuffle,
                       vocab_size=cfg.model.vocab_size, documents=cfg.data.document_mask)


def make_rows(cfg: TrainConfig, loader, info: distributed.DistInfo):
    """What turns each batch into the model's input (trainer/sequence.py): documents cut by the loader's
    BOS/EOS ids with data.document_mask; without it each row goes through as it is. Under context or
    tensor parallelism each rank then takes its tokens of the rows."""
    from trainer.sequence import Rows, SequenceShard
    cut = loader.document_tokens() if cfg.data.document_mask else None
    at = info.layout
    shard = SequenceShard(at.cp, at.cp_rank, at.tp, at.tp_rank, at.cp_group) if at.model_ranks > 1 else None
    return Rows(cut, cfg.data.position_reset, causal_when_whole=not cfg.train.compile, shard=shard)


def attention_kernel(cfg: TrainConfig, device: torch.device) -> str:
    """train.attention as it runs on `device`: auto is FlexAttention on a GPU, SDPA's mask elsewhere."""
    choice = cfg.train.attention
    if choice == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if choice == "flex" and device.type != "cuda":
        raise TrainError(f"train.attention flex needs a GPU: torch {torch.__version__.split('+')[0]}'s "
                         "FlexAttention has no backward on the CPU; use train.attention=sdpa (or auto)")
    return choice


# --------------------------------------------------------------------------- model

def apply_kernels(model: Transformer) -> Transformer:
    try:
        import kernels
    except ImportError as exc:
        raise TrainError(f"--kernels: the fused kernels are not available ({exc}); "
                         "install the kernels package with Triton, or run without --kernels") from None
    if not getattr(kernels, "__anvil__", False):
        raise TrainError(f"--kernels: `import kernels` found {getattr(kernels, '__file__', kernels)}, not Anvil's "
                         "kernels/ (Hugging Face's package of the same name shadows it): pip uninstall kernels "
                         "in this environment, or run from the checkout so that its folder comes first")
    return kernels.patch(model) or model


def build_model(cfg: TrainConfig, info: distributed.DistInfo, log):
    """Returns (model, train_model): the plain module (checkpoints, eval) and what to call."""
    fp8.check_supported(cfg, info.device)  # before building: a CPU run fails at once (exit 2)
    if cfg.parallel.async_tp and info.device.type != "cuda":
        raise TrainError("parallel.async_tp needs GPUs (symmetric memory over the tp group); "
                         "set parallel.async_tp=false on this machine")
    use_fsdp = cfg.parallel.strategy == "fsdp" and info.distributed
    meta = use_fsdp and cfg.parallel.meta_init
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    with torch.device("meta" if meta else info.device):
        model = Transformer(cfg.model)
    if cfg.precision.params == "bf16":
        model.to(torch.bfloat16)
        model.model.rotary_emb.reset_parameters()  # RoPE frequencies stay fp32
    if cfg.train.kernels:
        model = apply_kernels(model)
        log.info("kernels: fused kernels patched in (kernels.patch)")
    model.fp8_state = None  # read by the loop: FSDP float8 scales after each optimizer step
    if fp8.enabled(cfg):
        model.fp8_state = fp8.convert(model, cfg.precision.fp8, fsdp=use_fsdp, device=info.device,
                                      compile=cfg.train.compile,
                                      fuse_inputs=cfg.train.kernels and cfg.precision.fp8_fused,
                                      stash=fp8.stashes(cfg), lm_head=cfg.precision.fp8_lm_head)
        log.info(model.fp8_state.describe())
    for layer in model.model.layers:
        layer.activation_checkpoint = cfg.train.activation_checkpoint
    model.model.attention_kernel = attention_kernel(cfg, info.device)
    if cfg.train.float8_activations:
        saved_activations.check_device(info.device)   # float8 casts: a GPU with FP8 (or the CPU)
        if cfg.train.activation_checkpoint == "full":
            log.warning("train.float8_activations with activation_checkpoint full: nothing to store, full "
                        "keeps only each layer's input (a graph input, left as it is)")
    saved_activations.configure(cfg.train.float8_activations, cfg.train.float8_activations_min_mib, info.device)
    if cfg.train.compile:
        for layer in model.model.layers:
            layer.compile()  # in place: parameter names keep no _orig_mod prefix
        if model.loss_fn is linear_cross_entropy:  # fuses the fp32 upcast into the CE
            model.loss_fn = torch.compile(linear_cross_entropy)
        log.info("torch.compile: decoder blocks and loss wrapped (the first step compiles them)")
    train_model = distributed.wrap(model, cfg, info) if (use_fsdp or info.distributed) else model
    if meta:
        model.to_empty(device=info.device)
        model.init_weights()
    return model, train_model


def autocast_context(cfg: TrainConfig, info: distributed.DistInfo):
    """bf16 autocast unless FSDP's mixed-precision policy or bf16 weights already cover it."""
    dtype = distributed.compute_dtype(cfg, info.device)
    fsdp = cfg.parallel.strategy == "fsdp" and info.distributed
    if dtype == torch.float32 or fsdp or cfg.precision.params == "bf16":
        return contextlib.nullcontext
    return lambda: torch.autocast(info.device.type, dtype=dtype)


# --------------------------------------------------------------------------- eval

@torch.no_grad()
def evaluate(model, cfg: TrainConfig, info, autocast) -> tuple[float, dict[str, float]]:
    """Mean token loss over the first val_batches batches of the val split (all ranks), and {}.
    For a blend, that of each source's val split ({name: loss}) and the mixed loss: the sources'
    losses weighted by the blend's shares, the expected loss of a sample drawn as training draws them."""
    if not cfg.data.blend:
        return _val_loss(model, _dataset_loader(cfg, cfg.data.path, "val", info, shuffle=False), cfg, info,
                         autocast), {}
    from trainer.data.blend import shares
    by_source = {s.name: _val_loss(model, _dataset_loader(cfg, s.path, "val", info, shuffle=False), cfg, info,
                                   autocast) for s in cfg.data.blend}
    weights = shares([s.weight for s in cfg.data.blend])
    return sum(w * by_source[s.name] for w, s in zip(weights, cfg.data.blend)), by_source


def _val_loss(model, loader, cfg: TrainConfig, info, autocast) -> float:
    n_batches = min(cfg.train.val_batches, max(1, len(loader)))
    total = torch.zeros(2, dtype=torch.float64, device=info.device)
    rows = make_rows(cfg, loader, info)
    model.eval()
    for _ in range(n_batches):
        x, y = next(loader)
        x, y, layout = rows(x.to(info.device), y.to(info.device))
        with autocast():
            total[0] += model(x, y, layout).double()
        total[1] += (y != IGNORE_INDEX).sum()
    model.train()
    if info.distributed:
        torch.distributed.all_reduce(total)
    return (total[0] / total[1]).item()


# --------------------------------------------------------------------------- loop

def run(cfg: TrainConfig, run_dir: Path | str, resume: str | None = None, log=None) -> int:
    from trainer import ranklog
    from core import signals
    from trainer import checkpoint

    run_dir = Path(run_dir)
    started = time.time()
    rank, local_rank, _ = distributed.rank_layout()
    if log is None:
        log = ranklog.setup(run_dir, rank=rank, local_rank=local_rank, name="anvil.trainer")
    health.prepare_env(cfg, run_dir)  # flight recorder on: must precede the process group
    info = distributed.init(cfg)
    try:
        return _train(cfg, run_dir, resume, info, log, started, checkpoint, signals)
    except fp8.Fp8Error as exc:  # precision.fp8 where it cannot run: its own exit status, 2
        log.error(f"error: {exc}")
        return exc.exit_code
    finally:
        distributed.shutdown(info)


def _train(cfg, run_dir, resume, info, log, started, checkpoint, signals) -> int:
    data_label = check_data(cfg)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    log.info(f"rank {info.rank}/{info.world_size} on {info.device}"
             + (f" ({torch.cuda.get_device_name(info.device)})" if info.device.type == "cuda" else "")
             + f", backend {info.backend or 'none'}, torch {torch.__version__}")

    planned = ParamCount.of(cfg.model).total
    if planned >= LARGE_MODEL:   # seconds to minutes of initialisation with nothing on the console otherwise
        log.info(f"building model {cfg.model.name}: {planned:,} parameters on {info.device}"
                 + (" (on the meta device, then materialised shard by shard)" if cfg.parallel.strategy == "fsdp"
                    and info.distributed and cfg.parallel.meta_init else "") + "; a model this size takes a while")
    model, train_model = build_model(cfg, info, log)
    moe.configure(model, cfg.data.grad_accum)
    experts = bool(moe.moe_layers(model))
    predicts_ahead = cfg.model.mtp_depth > 0   # multi-token prediction: its loss is logged too
    n_params = model.num_params()
    fpt = flops_per_token(cfg.model, model.num_params(exclude_embedding=True), cfg.data.seq_len)
    strategy = cfg.parallel.strategy if info.distributed else "single process"
    if info.layout.model_ranks > 1:
        at = info.layout
        strategy += f" over data {at.dp} x cp {at.cp} x tp {at.tp}"
    log.info(f"model {cfg.model.name}: {n_params:,} parameters, {fpt / 1e9:.3f} GFLOP/token; "
             f"{strategy}, compute {distributed.compute_dtype(cfg, info.device)}, "
             f"params {cfg.precision.params}, fp8 {cfg.precision.fp8}, activation checkpointing "
             f"{cfg.train.activation_checkpoint}")

    optimizer = optim.build_optimizer(model, cfg.optim, info.device, kernels=cfg.train.kernels)
    scheduler = optim.build_scheduler(optimizer, cfg.schedule, cfg.train.steps)
    loader = make_loader(cfg, "train", info)
    if cfg.data.path == SYNTHETIC:
        log.warning("data: SYNTHETIC random tokens: throughput figures only, the loss means nothing")
    rows = make_rows(cfg, loader, info)
    log.info(f"data: {data_label}; {loader.describe()}; micro batch {cfg.data.batch_size} x "
             f"{cfg.data.seq_len}, grad accum {cfg.data.grad_accum}, global batch "
             f"{cfg.data.batch_size * cfg.data.grad_accum * info.layout.dp * cfg.data.seq_len:,} tokens"
             + (f"; attention inside documents ({model.model.attention_kernel}"
                + (", positions restart per document)" if cfg.data.position_reset else ")")
                if cfg.data.document_mask else ""))

    ckpt_dir = run_dir / cfg.checkpoint.dir
    config_dict = cfg.to_dict()
    # prior_wall / prior_segments: the wall time and the number of earlier segments (runs that
    # this one resumes, up to their checkpoint); the summary's wall_s is this segment's alone
    step, tokens_seen, prior_wall, prior_segments = 0, 0, 0.0, 0
    init_from = None   # the Hugging Face directory the run's weights started from (checkpoint.init_from)
    checkpointer = checkpoint.Checkpointer(ckpt_dir, keep_last=cfg.checkpoint.keep_last, config=config_dict,
                                           async_save=cfg.checkpoint.async_save, log=log,
                                           write_threads=cfg.checkpoint.write_threads,
                                           timeout=datetime.timedelta(minutes=cfg.parallel.timeout_minutes))
    # A requeued job restarts with the same --resume: its own newer checkpoints come first, and
    # a damaged one gives way to the one before it (an explicit step_N does not: exit 2).
    state = checkpoint.load_first_intact(checkpoint.candidates(resume, ckpt_dir), model=model, optimizer=optimizer,
                                         scheduler=scheduler, loader=loader, config=config_dict)
    if state is not None:
        step = state["step"]
        tokens_seen = int(state["extra"].get("tokens_seen", 0))
        prior_wall = float(state["extra"].get("wall_s", 0.0))
        prior_segments = int(state["extra"].get("segments", 1))  # older checkpoints: one segment
        init_from = state["extra"].get("init_from")
        log.info(f"resumed from {state['path']} at step {step}"
                 + (" (its weights, not checkpoint.init_from's)" if cfg.checkpoint.init_from else ""))
    elif cfg.checkpoint.init_from:   # after materialising, before training; optimizer and step start fresh
        from trainer.hf import load_weights
        init_from = load_weights(model, cfg.checkpoint.init_from, log)
    elif resume == "auto":
        log.info("resume auto: no checkpoint yet, starting fresh")

    def save(at_step: int, wait: bool = False) -> None:
        """Synchronous, or staged and written in the background (wait: the write too)."""
        with watchdog.busy("checkpoint"):
            checkpointer.save(at_step, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                              wait=wait, extra={"tokens_seen": tokens_seen,
                                                "wall_s": prior_wall + time.time() - started,
                                                "segments": prior_segments + 1, "init_from": init_from})

    met = metrics.Metrics(run_dir, is_main=info.is_main, log=log, device=info.device,
                          world_size=info.world_size, total_steps=cfg.train.steps,
                          flops_per_token=fpt, tensorboard=cfg.logging.tensorboard,
                          progress=cfg.logging.progress, gpu_stats=cfg.logging.gpu_stats)
    if state is not None:
        met.resumed(step, state["path"])
    if met.peak_tflops is None and info.device.type == "cuda":
        log.info(f"MFU: n/a ({names.GPU_PEAK_TFLOPS} not set by the environment profile)")
    from trainer.profiling import StepProfiler
    profiler = StepProfiler.from_env(run_dir, info.rank)  # names.PROFILE_STEPS (inv profile.train)
    stopper = signals.install()
    stopper.failing = checkpointer.failed   # a background write that failed stops every rank, together
    autocast = autocast_context(cfg, info)
    fsdp = cfg.parallel.strategy == "fsdp" and info.distributed
    ddp = info.distributed and not fsdp
    accum = cfg.data.grad_accum
    status = "ok"
    train_model.train()
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)

    straggler = health.StragglerDetector.from_config(cfg, run_dir, info, log).watch(model)
    watchdog = health.HangWatchdog.from_config(cfg, run_dir, info, log).start(step)
    interval_start, interval_tokens, interval_steps = time.perf_counter(), 0, 0
    first_step = step
    if profiler is not None:
        profiler.step_done(step)    # a window from step 1 (or one a resumed run starts inside) starts here
    guard_skip = GuardSkip(guards.wanted(cfg.train.compile, cfg.train.skip_guards, experts))
    readings = metrics.DeferredScalars(info.device)
    numeric_guard = numeric.NumericGuard.from_config(cfg)
    pin = info.device.type == "cuda"

    def log_reading(reading, started: float) -> float:
        """One log line from a DeferredScalars reading (None: nothing pending); the next interval's start."""
        if reading is None:
            return started
        values, at = reading
        mean_loss, gnorm = values[:2]
        load = values[4:] if predicts_ahead else values[2:]
        met.train_step(at["step"], loss=mean_loss, lr=at["lr"], grad_norm=gnorm, tokens=at["tokens"],
                       interval_tokens=at["interval_tokens"], interval_steps=at["interval_steps"],
                       interval_s=time.perf_counter() - started, by_source=at["by_source"], at=at["time"],
                       mtp_loss=multi_token.read_loss(values[2:4]) if predicts_ahead else None)
        if experts:
            met.moe_step(at["step"], moe.read_load(model, load))
        if mean_loss != mean_loss:  # NaN: stop rather than burn GPU hours
            raise TrainError(f"loss is NaN at step {at['step']}; lower optim.lr or check the data")
        return time.perf_counter()

    if cfg.train.compile:
        log.info(f"step {step + 1} compiles the model (torch.compile) before it trains: minutes for a large "
                 "model, once")
    def forward_backward(micro, step_tokens: int):
        """The step's micro-batches forward and backward (gradients summed); their summed loss."""
        loss_sum = torch.zeros((), device=info.device)
        for i, (x, y) in enumerate(micro):
            last = i == accum - 1
            if pin:   # a pageable copy may wait for the stream; the host runs a step ahead of it
                x, y = x.pin_memory(), y.pin_memory()
            x, y, row_layout = rows(x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True))
            if fsdp:
                model.set_requires_gradient_sync(last)
            sync = train_model.no_sync() if ddp and not last else contextlib.nullcontext()
            with sync:
                with autocast():
                    loss = train_model(x, y, row_layout)
                # step_tokens are the whole rows' (each of cp x tp ranks computes its share of them); the
                # cp ranks' gradients add up, where FSDP2 / DDP average over data x cp ranks: x cp
                (loss * info.layout.cp / step_tokens).backward()
            loss_sum += loss.detach()
        return loss_sum

    def mean_loss(loss_sum, step_tokens: int) -> torch.Tensor:
        """The step's mean token loss over all ranks (the ranks that share rows each hold a part of it)."""
        return distributed.all_reduce_mean(loss_sum / step_tokens, info) * info.layout.model_ranks

    def readings_of(loss_sum, step_tokens: int, grad_norm) -> tuple[float, float, float]:
        """(mean loss of all ranks, gradient norm, this rank's own mean loss), read on the host."""
        own = loss_sum / step_tokens
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm   # (FSDP: a DTensor)
        return (float(mean_loss(loss_sum, step_tokens)), float(norm), float(own))

    def faulty_ranks(changed: bool) -> list[int]:
        """The ranks whose own loss changed between a step's two runs (a collective)."""
        flags = torch.zeros(info.world_size, device=info.device)
        flags[info.rank] = float(changed)
        if info.distributed:
            torch.distributed.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def rerun(micro, step_tokens: int, first: tuple[float, float, float], why: str) -> bool:
        """A step whose numbers failed the guard, run again from the same weights: True when the fault came
        back (the batch's: skip its update), else NumericFault (the hardware's)."""
        optimizer.zero_grad(set_to_none=True)
        log.warning(f"step {step + 1}: {why}; running it again from the same weights")
        loss_sum = forward_backward(micro, step_tokens)
        second = readings_of(loss_sum, step_tokens, optim.clip_grad_norm(model.parameters(), cfg.optim.grad_clip,
                                                                          optimizer))
        again = numeric_guard.fault(second[0], second[1])
        # (the gradient norm is all ranks': a NaN in one rank's gradients reaches every rank's)
        own_changed = numeric_guard.fault(first[2], 0.0) is not None and numeric_guard.fault(second[2], 0.0) is None
        blamed = faulty_ranks(own_changed)
        if again is not None:
            return True
        if info.rank in blamed or (not blamed and info.is_main):   # (no rank's own loss changed: the gradients)
            numeric.report_fault(run_dir, info.rank, step + 1, first[:2], second[:2], info.device)
        distributed.barrier(info)
        raise numeric.NumericFault(
            f"step {step + 1}: {why}, but not when run again from the same weights (loss {second[0]:.4g}): "
            f"the hardware is suspect, rank(s) {', '.join(map(str, blamed)) or 'unknown'} "
            f"({names.LOGS_DIR}/{names.FAULT_REPORTS})")

    try:
        while step < cfg.train.steps:
            cursor = loader.cursor
            with straggler.data_time():
                micro = [next(loader) for _ in range(accum)]
            # Scale by the step's token count so accumulation equals one big batch.
            step_tokens = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)
            skipping = guard_skip.active
            with guard_skip.step():
                loss_sum = forward_backward(micro, step_tokens)
            if guard_skip.active and not skipping:
                log.info(f"step {step + 1} compiled nothing: the steps after it skip torch.compile's guard "
                         "checks (train.skip_guards)")
            grad_norm = optim.clip_grad_norm(model.parameters(), cfg.optim.grad_clip, optimizer)
            skip_update = False
            if numeric_guard.every_step:   # health.on_nonfinite=rerun: before the optimizer touches the weights
                first = readings_of(loss_sum, step_tokens, grad_norm)
                why = numeric_guard.fault(first[0], first[1])
                if why is None:
                    numeric_guard.passed(first[0])
                else:
                    with guard_skip.step():
                        skip_update = rerun(micro, step_tokens, first, why)
                    met.skipped(step + 1, why, numeric.sample_window(loader, cursor, loader.cursor))
            if not skip_update:
                optimizer.step()
                moe.update_balance_bias(model)   # DeepSeek-V3's balancing bias, from this step's load
                fp8.after_optimizer_step(model, model.fp8_state)
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            step += 1
            if step == first_step + 1 and cfg.train.compile:
                log.info(f"step {step}: compiled and ran in {time.perf_counter() - interval_start:.1f} s "
                         "(torch.compile); the steps after it run compiled")
                if cfg.train.float8_activations:
                    stashed = model.fp8_state.fused_inputs.count("swiglu_float8_stash") if model.fp8_state else 0
                    log.info(saved_activations.describe(cfg.train.float8_activations_min_mib, stashed))
            watchdog.beat(step)
            tokens_seen += step_tokens * info.layout.dp
            interval_tokens += step_tokens * info.layout.dp
            interval_steps += 1
            met.progress(step)
            if profiler is not None:
                profiler.step_done(step)
            if step == first_step + 1 and cfg.checkpoint.interval:
                checkpointer.prepare(model, optimizer)   # staging memory faulted in on a thread, ahead of the first save

            # The previous log step's loss and grad norm: its kernels ran while this step's were queued.
            interval_start = log_reading(readings.take(), interval_start)
            if (step % cfg.train.log_interval == 0 or step == cfg.train.steps) and not skip_update:   # (a NaN)
                readings.put([mean_loss(loss_sum, step_tokens), grad_norm]
                             + ([multi_token.collect_loss(model)] if predicts_ahead else [])
                             + ([moe.collect_load(model)] if experts else []),
                             step=step, lr=lr, tokens=tokens_seen, interval_tokens=interval_tokens,
                             interval_steps=interval_steps, by_source=loader.tokens_by_source(),
                             time=time.time())
                interval_tokens, interval_steps = 0, 0
            if step == cfg.train.steps:
                interval_start = log_reading(readings.take(), interval_start)

            if (cfg.train.val_interval and cfg.train.val_batches and step < cfg.train.steps
                    and step % cfg.train.val_interval == 0):
                interval_start = log_reading(readings.take(), interval_start)   # logs stay in step order
                with watchdog.busy("validation"):
                    met.val_step(step, *evaluate(model, cfg, info, autocast))
                interval_start = time.perf_counter()  # eval time is not training time
            if stopper.should_stop(step):
                interval_start = log_reading(readings.take(), interval_start)   # (a NaN raises before the save)
                if stopper.failed:
                    with watchdog.busy("checkpoint"):
                        checkpointer.wait()   # raises the background write's error (CheckpointWriteError)
                log.warning(f"{stopper.reason}: stopping after step {step}, checkpointing")
                save(step, wait=True)
                status = stopper.status
                break
            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 and step < cfg.train.steps:
                log_reading(readings.take(), interval_start)   # a NaN raises before the save
                save(step)
                interval_start = time.perf_counter()
            straggler.step(step)  # every health.straggler_interval steps: compare ranks (collective)

        if status == "ok":
            if cfg.train.val_batches:
                with watchdog.busy("validation"):
                    met.val_step(step, *evaluate(model, cfg, info, autocast))
            if cfg.checkpoint.save_final:
                save(step, wait=True)
        with watchdog.busy("checkpoint"):
            checkpointer.wait()   # an interval save still writing (save_final off)
    except BaseException:
        try:   # a step that failed after a log step: that step's line is still written
            log_reading(readings.take(), interval_start)
        except Exception:
            pass
        raise
    finally:
        checkpointer.close()      # after an error: lets a write in flight finish
        watchdog.stop()
        straggler.close()
        stopper.restore()   # (stop signals ignored to the end after a stop was asked for: see Stopper.restore)
        met.close()
        if profiler is not None:
            profiler.close()

    summary = met.summary(status=status, params=n_params, world_size=info.world_size,
                          device=str(info.device) if info.device.type == "cpu"
                          else torch.cuda.get_device_name(info.device),
                          data=data_label, **metrics.wall_times(time.time() - started, prior_wall,
                                                                prior_segments),
                          sources=loader.source_summary(),
                          # the step and tokens reached, not those of the last log line (a stop between them)
                          steps=step, tokens=tokens_seen,
                          checkpoint=str(checkpointer.last_saved) if checkpointer.last_saved else None,
                          flops_per_token=fpt, config=cfg.name,
                          **({"init_from": init_from} if init_from else {}))   # where the weights started
    if info.is_main:
        runfiles.write_summary(run_dir, summary)
        log.info("summary\n" + metrics.summary_table(summary))
    return stopper.exit_code if status in ("preempted", "interrupted") else EXIT_OK
