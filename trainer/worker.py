"""``python -m trainer.worker``: one training rank.

Launch contract (see :mod:`ringmaster.rank.launch`): torchrun's environment, plus
``RINGMASTER_JOB_SPEC`` (or ``--config JOB.toml``), ``RINGMASTER_JOB_ID``,
``RINGMASTER_WORKDIR`` and ``RINGMASTER_CONTROL_SOCKET``. Exit status: 0 when the job
completed or was stopped (its final checkpoint durable), 2 for a bad spec (one line on
stderr, before joining the process group), 143 on SIGTERM, 1 on any other failure (one
line when checkpoints exist that this run cannot resume, or when a numeric fault cannot be
rewound, see :mod:`trainer.numeric`); each of these is also left in the rank's exit record
for its node agent (:func:`ringmaster.rank.launch.exit_record`). Ranks of simulated nodes also read
rehearsal knobs (``RINGMASTER_SIM_KNOBS``, :mod:`trainer.sim_knobs`).

Hooks for tests and benchmarks only: ``RINGMASTER_TEST_PERSIST_DELAY_S`` (seconds each
persist waits after writing its shard, before the manifest), ``RINGMASTER_TEST_PERSIST_GATE``
(a path: each persist waits for that file to exist before it serialises anything),
``RINGMASTER_TEST_TRACE``
(a directory for per-rank step traces with sample ids), ``RINGMASTER_BENCH_NO_CONTROL=1``
(no step-boundary control word, to measure its cost),
``RINGMASTER_BENCH_DDP_STAGE_ALL=1`` (every DDP rank stages the whole state, the baseline
its share is measured against) and ``RINGMASTER_TEST_COMPILE_BACKEND`` (a cheaper
torch.compile backend, ``aot_eager``, for CPU tests of ``train.compile``). The node's
compile cache is ``RINGMASTER_COMPILE_CACHE`` (see :mod:`trainer.compile`).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from ringmaster.rank import stacks, termination, tiers
from ringmaster.rank.agent_link import AgentLink
from ringmaster.rank.beat import Beat
from ringmaster.rank.checkpoint import Checkpointer
from ringmaster.rank.control import StepControl
from ringmaster.rank.coordination import Coordination
from ringmaster.rank.launch import Launch, SpecError, exit_record, read_launch, torch_threads
from ringmaster.rank.log import Log
from ringmaster.rank.session import ResumeError, Session
from ringmaster.rundir import STACKS_SIGNAL
from trainer import preflight_bw
from trainer.batch_size import choose_micro_batch, forward_backward
from trainer.build import build_model, compile_model
from trainer.data import SYNTHETIC, Batches, Layout
from trainer.engine import DDPEngine, Engine
from trainer.flops import Mfu, device_peak, model_flops_per_token
from trainer.loop import Hooks, Outcome, Trainer
from trainer.model import count_params
from trainer.numeric import NumericFault
from trainer.precision import count_float8_linears
from trainer.presets import ModelConfig, get_preset
from trainer.probe import StepProbe
from trainer.sim_knobs import SimKnobsReader

# Explicit, and long: a rank legitimately waits in a collective while a peer stages a
# large checkpoint. Pauses never hold a collective open (see ringmaster.rank.control).
PG_TIMEOUT = timedelta(minutes=30)


def _model_config(launch: Launch) -> ModelConfig:
    train = launch.spec.train
    cfg = get_preset(train.model)
    if train.seq_len > cfg.max_seq_len:
        raise SpecError(
            f"train.seq_len={train.seq_len} exceeds {train.model!r}'s max of {cfg.max_seq_len}"
        )
    return cfg


def _batches(launch: Launch, cfg: ModelConfig) -> Batches:
    train = launch.spec.train
    source = train.data if train.data == SYNTHETIC else str(launch.resolve(train.data))
    try:
        return Batches(
            source,
            seq_len=train.seq_len,
            vocab_size=cfg.vocab_size,
            seed=train.seed,
            layout=Layout(train.micro_batch_size, launch.world_size),
            rank=launch.rank,
        )
    except OSError as exc:
        raise SpecError(f"train.data={train.data!r}: {exc.strerror}") from None


def _hooks(env: Mapping[str, str]) -> Hooks:
    trace = env.get("RINGMASTER_TEST_TRACE")
    gate = env.get("RINGMASTER_TEST_PERSIST_GATE")
    return Hooks(
        persist_delay_s=float(env.get("RINGMASTER_TEST_PERSIST_DELAY_S", "0")),
        persist_gate=Path(gate) if gate else None,
        trace_dir=Path(trace) if trace else None,
        control_word=env.get("RINGMASTER_BENCH_NO_CONTROL") != "1",
        ddp_share=env.get("RINGMASTER_BENCH_DDP_STAGE_ALL") != "1",
    )


def _init_process_group(launch: Launch, device: torch.device) -> Coordination:
    """Join the job's process group (env://, as torchrun sets it up) and create the gloo
    group checkpoints coordinate over."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launch.world_size == 1 and launch.master_port == 0:
        # A lone process without a rendezvous (a quick local run): an in-memory store.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=PG_TIMEOUT
        )
    else:
        dist.init_process_group(backend, init_method="env://", timeout=PG_TIMEOUT)
    return Coordination.over_gloo(PG_TIMEOUT)


def _engine(
    launch: Launch, model: torch.nn.Module, device: torch.device, coord: Coordination, hooks: Hooks
) -> Engine:
    train = launch.spec.train
    args = (model, train, train.precision, device)
    if train.engine == "deepspeed":
        from trainer.engine_deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(*args, launch.rank, launch.world_size, coord.group)
    if train.engine == "fsdp":
        from trainer.engine_fsdp import FSDPEngine

        return FSDPEngine(*args, checkpoint_group=coord.group)
    return DDPEngine(*args, checkpoint_group=coord.group, share=hooks.ddp_share)


def _with_micro_batch(launch: Launch, size: int) -> Launch:
    """``launch`` with ``train.micro_batch_size`` replaced (engines, data and the loop all
    read the size from the spec)."""
    train = msgspec.structs.replace(launch.spec.train, micro_batch_size=size)
    spec = msgspec.structs.replace(launch.spec, train=train)
    return dataclasses.replace(launch, spec=spec)


def run(
    launch: Launch,
    cfg: ModelConfig,
    batches: Batches,
    hooks: Hooks,
    log: Log,
    beat: Beat | None = None,
) -> Outcome:
    train = launch.spec.train
    device = torch.device(f"cuda:{launch.local_rank}" if torch.cuda.is_available() else "cpu")
    coord = _init_process_group(launch, device)
    log("process_group", backend=dist.get_backend(), world=launch.world_size)
    link = None
    if launch.rank == 0 and launch.control_socket is not None:
        link = AgentLink(launch.control_socket, launch.job_id).start()
    checkpointer: Checkpointer | None = None
    try:
        if train.preflight_bandwidth:  # before the model: a refused node wastes no build
            checked = preflight_bw.check(
                launch.rank,
                launch.world_size,
                launch.local_world_size,
                device,
                coord.group,
                os.environ,
                launch.spec.policy.min_bandwidth_ratio,
                log,
            )
            if checked is not None and link is not None:
                link.send(checked)
        torch.manual_seed(train.seed)  # identical initial weights on every rank
        model = build_model(train, cfg, device, log)
        log("model_built")
        params = count_params(model)  # before ZeRO-3 partitions the parameters away
        if train.auto_micro_batch:  # before the engine: ZeRO-3 cannot run the bare model
            attempt = forward_backward(
                model.to(device), train.seq_len, cfg.vocab_size, train.precision, device
            )
            size = choose_micro_batch(train.micro_batch_size, device, attempt, log)
            if size != train.micro_batch_size:
                launch = _with_micro_batch(launch, size)
                train = launch.spec.train
                batches = _batches(launch, cfg)
        compiled = compile_model(model, train, device, os.environ, log)  # after the probe
        engine = _engine(launch, model, device, coord, hooks)
        log(
            "model",
            preset=train.model,
            engine=engine.name,
            params=params,
            precision=train.precision,
            fp8_recipe=train.fp8_recipe,
            float8_linears=count_float8_linears(model),
            compiled=compiled,
            activation_checkpointing=model.activation_checkpointing,
            world=launch.world_size,
            threads=torch.get_num_threads(),
        )
        checkpointer = tiers.checkpointer(
            launch,
            coord,
            engine.name,
            device,
            os.environ,
            log,
            persist_delay_s=hooks.persist_delay_s,
            persist_gate=hooks.persist_gate,
        )
        control = StepControl(
            launch.rank, device, link, enabled=hooks.control_word, notice=termination.noticed
        )
        mfu = Mfu(model_flops_per_token(cfg, train.seq_len), device_peak(device), launch.world_size)
        knobs = SimKnobsReader.from_env(os.environ, lambda why: log("sim_knobs", warning=why))
        session = Session(
            launch.rank,
            launch.world_size,
            control,
            link,
            beat or Beat(None),
            log,
            framework="builtin",
            checkpoint_every=launch.spec.checkpoint.every_steps,
        )
        trainer = Trainer(
            launch.spec,
            engine,
            batches,
            session,
            log,
            hooks,
            mfu=mfu,
            compiled=compiled,
            probe=StepProbe(engine.module, device, knobs),
        )
        session.attach(checkpointer, engine, trainer.position)
        trainer.resume()
        outcome = trainer.run()
        checkpointer.close()
        engine.close()
        return outcome
    finally:
        if checkpointer is not None:  # also when failing: staged copies hold RAM
            checkpointer.discard_staging()
        if link is not None:
            link.close()
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """The rank; its exit status, also left in its exit record (so is a failure's)."""
    termination.record_exit_in(exit_record(os.environ))
    try:
        code = _main(argv)
    except Exception:
        termination.record_exit(1)  # the interpreter prints the traceback and exits 1
        raise
    return termination.record_exit(code)


def _main(argv: Sequence[str] | None) -> int:
    env = os.environ
    try:
        launch = read_launch(env, sys.argv[1:] if argv is None else argv)
        cfg = _model_config(launch)
        batches = _batches(launch, cfg)
        hooks = _hooks(env)
    except (SpecError, ValueError) as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return 2
    termination.install()
    torch.set_num_threads(torch_threads(env, launch.local_world_size))
    # Stacks on demand, read by the node agent's hang watch from stderr (the rank's log):
    # a thread that answers holding the GIL, and faulthandler on STACKS_SIGNAL (C-level,
    # for a main thread wedged holding the GIL) as the fallback.
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    stacks.serve_from_env(env, launch.rank)
    beat = Beat.from_env(env, launch.rank).start()
    log = Log(launch.rank, launch.attempt)
    log("started", pid=os.getpid())
    try:
        run(launch, cfg, batches, hooks, log, beat)
    except (ResumeError, NumericFault) as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return 1
    finally:
        beat.stop()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything that matters is done: the final checkpoint is durable, the agent link has
    # flushed and the process group is gone. Skip interpreter teardown, where leftover
    # gloo and torch threads were seen to abort a rank that had finished cleanly
    # ("terminate called without an active exception"), turning success into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
