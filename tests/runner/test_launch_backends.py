"""The backends of train.launch, one by one (runtime/backends/): the command line each starts, how it
resumes, its stop signal, and its log lines read into records.

The log lines are as torchtitan 0.2.2 and Megatron-LM print them: torchtitan's MetricsProcessor.log
(torchtitan/components/metrics.py: colours on, and off with --metrics.disable_color_printing; torchrun's
"[rank0]:" prefix) and Megatron-LM's training_log (megatron/training/training.py, the timestamp with and
without microseconds as in core_v0.16 and core_r0.9), its evaluate_and_print_results and report_memory.
"""
from __future__ import annotations

import importlib.util
import re
import signal
from pathlib import Path

import pytest

from runtime import backends
from runtime.backends import UNREADABLE, Checkpoint, Options
from runtime.backends import megatron, torchtitan
from runtime.backends.base import BackendError, json_line, regex_parser

TITAN_COLOURED = ("[titan] 2025-10-14 12:00:01,234 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.25260  "
                  "\x1b[38;2;180;60;0mgrad_norm:  3.9512  \x1b[38;2;54;234;195mmemory:  1.17GiB(1.48%)  "
                  "\x1b[34mtps: 2,405  \x1b[36mtflops: 0.17  \x1b[35mmfu: 0.02%\x1b[39m")
TITAN_PLAIN = ("[rank0]:[titan] 2025-10-14 12:00:05,000 - root - INFO - step: 10  loss:  7.91340  grad_norm:  1.2034  "
               "memory:  1.25GiB(1.58%)  tps: 31,022  tflops: 2.22  mfu: 0.22%")
TITAN_VALIDATE = ("[titan] 2025-10-14 12:00:06,000 - root - INFO - \x1b[33mvalidate step: 10  \x1b[32mloss:  7.8000  "
                  "\x1b[38;2;54;234;195mmemory:  1.25GiB(1.58%)  \x1b[34mtps: 60,123\x1b[39m")
MEGATRON_ITERATION = (" [2025-10-14 12:00:00.123456] iteration        2/      20 | consumed samples:           16 | "
                      "elapsed time per iteration (ms): 2000.0 | throughput per GPU (TFLOP/s/GPU): 98.5 | learning "
                      "rate: 1.500000E-05 | global batch size:     8 | lm loss: 1.086453E+01 | loss scale: 1.0 | "
                      "grad norm: 4.123 | number of skipped iterations:   0 | number of nan iterations:   0 |")
MEGATRON_OLD = (" [2024-06-01 12:00:00] iteration       10/     100 | consumed samples:          320 | elapsed time "
                "per iteration (ms): 123.4 | learning rate: 1.000000E-04 | global batch size:    32 | lm loss: "
                "5.123400E+00 | load_balancing_loss: 1.020000E+00 | loss scale: 1.0 | grad norm: 0.912 | number of "
                "skipped iterations:   0 | number of nan iterations:   0 |")
MEGATRON_MEMORY = ("[Rank 1] (after 2 iterations) memory (MB) | allocated: 215.55 | max allocated: 2048.00 | "
                   "reserved: 2500.00 | max reserved: 2500.00")
MEGATRON_VALIDATION = (" validation loss at iteration 10 on validation set | lm loss value: 9.876543E+00 | lm loss PPL: "
                       "1.947384E+04 | ")


def test_torchtitan_lines_become_records():
    parse = backends.get("torchtitan").parser([], world_size=2)
    assert parse(TITAN_COLOURED) == {"kind": "train", "step": 1, "loss": 12.2526, "grad_norm": 3.9512,
                                     "tokens_per_s": 4810.0, "tokens_per_s_per_device": 2405.0, "tflops": 0.17,
                                     "mfu": 0.0002, "gpu_mem_reserved_gib": 1.17}
    assert parse(TITAN_PLAIN)["step"] == 10 and parse(TITAN_PLAIN)["tokens_per_s"] == 62044.0
    assert parse(TITAN_VALIDATE) == {"kind": "val", "step": 10, "val_loss": 7.8}
    assert parse(TITAN_PLAIN.replace("loss:  7.91340", "loss:      nan")) == UNREADABLE
    for other in ("[titan] 2025-10-14 12:00:00,000 - root - INFO - Training starts at step 1",
                  "[titan] 2025-10-14 12:00:00,000 - root - INFO - Loading the checkpoint from /x/step-10.", ""):
        assert parse(other) is None


def test_megatron_lines_become_records_on_the_last_rank():
    backend = backends.get("megatron")
    argv = ["python", "pretrain_gpt.py", "--seq-length", "1024"]
    assert backend.metrics_rank(argv, 8) == 7
    parse = backend.parser(argv, world_size=4, peak_tflops=989.0)
    record = parse(MEGATRON_ITERATION)
    assert record == pytest.approx({"kind": "train", "step": 2, "loss": 10.86453, "lr": 1.5e-05, "grad_norm": 4.123,
                                    "step_time_s": 2.0, "tokens_per_s": 4096.0, "tokens_per_s_per_device": 1024.0,
                                    "tflops": 98.5, "mfu": 98.5 / 989.0})
    with_memory = parse(MEGATRON_MEMORY)     # the memory report after iteration 2: iteration 2's record again
    assert with_memory == {**record, "gpu_mem_gib": 2.0}
    old = parse(MEGATRON_OLD)
    assert (old["step"], old["loss"], old["lr"]) == (10, 5.1234, 1e-4) and "tflops" not in old
    assert parse(MEGATRON_VALIDATION) == {"kind": "val", "step": 10, "val_loss": 9.876543}
    assert parse(MEGATRON_ITERATION.replace(" lm loss: 1.086453E+01 |", "")) == UNREADABLE   # a nan loss is left out
    assert parse(" > building train, validation, and test datasets ...") is None


def test_json_and_regex_metric_lines():
    assert json_line('{"step": 3, "loss": 2.5, "tokens_per_s": 100, "mfu": 0.4, "mem_gib": 1.5, "lr": 0.001}') == \
        {"kind": "train", "step": 3, "loss": 2.5, "tokens_per_s": 100, "mfu": 0.4, "gpu_mem_gib": 1.5, "lr": 0.001}
    assert json_line('{"step": 4, "val_loss": 2.0}') == {"kind": "val", "step": 4, "val_loss": 2.0}
    assert json_line('{"step": 3, "loss": "nan"}') == UNREADABLE
    assert json_line('{"step": 3, "loss": 2.') == UNREADABLE
    assert json_line('{"event": "checkpoint"}') is None and json_line("step 3 loss 2.5") is None
    parse = regex_parser(r"it (?P<step>\d+) loss=(?P<loss>\S+)(?: tps=(?P<tokens_per_s>\S+))?")
    assert parse("it 7 loss=1.25 tps=1,000") == {"kind": "train", "step": 7, "loss": 1.25, "tokens_per_s": 1000.0}
    assert parse("it 7 loss=oops") == UNREADABLE and parse("nothing") is None
    for bad in ("(", "loss=(?P<loss>.*)"):
        with pytest.raises(BackendError):
            regex_parser(bad)


def _megatron_checkout(tmp_path: Path) -> Path:
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron").mkdir(parents=True)
    (checkout / "pretrain_gpt.py").write_text("")
    return checkout


def test_megatron_starts_the_checkout_script_with_its_signal_handler_save_and_load(tmp_path):
    backend = backends.get("megatron")
    checkout = _megatron_checkout(tmp_path)
    plan = backend.plan(["pretrain_gpt.py", "--num-layers", "2"], Options(megatron=str(checkout), cwd=tmp_path))
    assert plan.argv == [str(checkout / "pretrain_gpt.py"), "--num-layers", "2"] and plan.mounts == [str(checkout)]
    run = tmp_path / "run"
    argv = ["python", *plan.argv]
    fresh = backend.command(argv, run, None)
    assert fresh == [*argv, "--exit-signal-handler", "--save", str(run / "checkpoints")] and "--load" not in fresh
    assert backend.stop_signal_of(argv) == signal.SIGTERM and backend.stops_with_zero
    assert backend.stop_signal_of([*argv, "--exit-signal", "SIGUSR2"]) == signal.SIGUSR2

    saved = run / "checkpoints"
    for step in (10, 20):
        (saved / f"iter_{step:07d}").mkdir(parents=True)
    (saved / "latest_checkpointed_iteration.txt").write_text("20\n")
    newest = backend.latest(saved)
    assert newest == Checkpoint(saved / "iter_0000020", 20) and backend.find(argv, run) == newest
    resumed = backend.command([*argv, "--load", "/elsewhere"], run, newest)
    assert resumed[-2:] == ["--load", str(saved)] and "/elsewhere" not in resumed and "--ckpt-step" not in resumed
    older = backend.command(argv, run, backend.at(saved / "iter_0000010"))
    assert older[-4:] == ["--load", str(saved), "--ckpt-step", "10"]
    (saved / "latest_checkpointed_iteration.txt").write_text("release")
    assert backend.latest(saved) is None
    own = backend.checkpoint_dir([*argv, "--save", "/data/ckpt"], run)
    assert own == Path("/data/ckpt")


def test_torchtitan_starts_its_trainer_with_the_config_in_the_run_directory(tmp_path):
    backend = backends.get("torchtitan")
    config = tmp_path / "debug_model.toml"
    config.write_text('[job]\ndescription = "debug"\n[training]\nsteps = 10\n')
    plan = backend.plan(["--training.steps", "4"], Options(config="debug_model.toml", cwd=tmp_path))
    assert plan.argv == ["-m", "torchtitan.train", "--job.config_file", str(config), "--training.steps", "4"]
    assert plan.configs == {"torchtitan.toml": config} and "last periodic checkpoint" in plan.notes[0]
    python = backend.plan([], Options(config="llama3:llama3_debugmodel", cwd=tmp_path))
    assert python.argv == ["-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel"]
    assert backend.stop_signal_of([]) == signal.SIGTERM and not backend.stops_with_zero

    run, earlier = tmp_path / "run", tmp_path / "earlier"
    argv = ["python", *plan.argv]
    fresh = backend.command(argv, run, None)
    assert fresh == [*argv, "--job.dump_folder", str(run), "--checkpoint.enable"]
    for step, complete in ((10, True), (20, False)):
        (earlier / "checkpoint" / f"step-{step}").mkdir(parents=True)
        if complete:
            (earlier / "checkpoint" / f"step-{step}" / ".metadata").write_bytes(b"")
    found = backend.find(argv, earlier)
    assert found == Checkpoint(earlier / "checkpoint" / "step-10", 10)
    assert backend.command(argv, run, found)[-3:] == ["--checkpoint.initial_load_path", str(found.path),
                                                      "--checkpoint.no_initial_load_model_only"]
    own = Checkpoint(run / "checkpoint" / "step-30", 30)   # its own folder torchtitan loads by itself
    assert "--checkpoint.initial_load_path" not in backend.command(argv, run, own)


def test_command_finds_the_highest_numbered_checkpoint(tmp_path):
    backend = backends.get("command")
    for name in ("step_3", "step_10", ".tmp_step_12", "step_11.tmp", "notes"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert backend.latest(tmp_path / "checkpoints") == Checkpoint(tmp_path / "checkpoints" / "step_10", 10)
    assert backend.find([], tmp_path) == backend.latest(tmp_path / "checkpoints")
    assert backend.plan(["python", "-u", "x.py"], Options(cwd=tmp_path)).argv == ["python", "-u", "x.py"]
    (tmp_path / "train.py").write_text("")
    assert backend.plan(["python", "train.py", "--lr", "1"], Options(cwd=tmp_path)).argv == \
        [str(tmp_path / "train.py"), "--lr", "1"]
    assert backend.stop_signal_of([]) is None


def test_what_a_backend_cannot_start_is_refused_in_its_words(tmp_path):
    """Checked before any run directory (test_train_launch.py: as inv says it, one line)."""
    checkout = _megatron_checkout(tmp_path)
    (checkout / "pretrain_gpt.py").unlink()
    (checkout / "pretrain_bert.py").write_text("")
    (tmp_path / "bad.toml").write_text("[job\n")
    cases = [("command", ["missing.py"], Options(), ["missing.py: no such file"]),
             ("megatron", ["pretrain_gpt.py"], Options(megatron=str(tmp_path / "none")), ["no such folder"]),
             ("megatron", ["pretrain_gpt.py"], Options(megatron=str(tmp_path)), ["not a Megatron-LM checkout"]),
             ("megatron", ["pretrain_gpt.py"], Options(megatron=str(checkout)),
              ["pretrain_gpt.py: not in the Megatron-LM checkout", "pretrain_bert.py"]),
             ("torchtitan", [], Options(config="bad.toml"), ["torchtitan cannot read it: invalid TOML"])]
    for name, argv, options, fragments in cases:
        options.cwd = tmp_path
        with pytest.raises(BackendError) as refused:
            backends.get(name).plan(argv, options)
        assert all(f in str(refused.value) for f in fragments), (name, str(refused.value))


def test_command_refuses_torchrun_as_the_program(tmp_path):
    """train.launch starts the ranks itself: torchrun after -- would start ranks inside each rank."""
    backend = backends.get("command")
    for argv in (["torchrun", "--nproc_per_node", "8", "x.py"], ["/opt/venv/bin/torchrun", "x.py"],
                 ["python", "-m", "torch.distributed.run", "x.py"], ["python3.11", "-u", "-mtorch.distributed.launch"],
                 ["python", "-W", "ignore", "-m", "torch.distributed.run", "x.py"]):
        with pytest.raises(BackendError, match="starts the ranks itself"):
            backend.plan(argv, Options(cwd=tmp_path))
    (tmp_path / "train.sh").write_text("")
    (tmp_path / "train.py").write_text("")
    for argv in (["python", "-m", "mypackage.train"], ["python", "-c", "-m torch.distributed.run"],
                 ["./train.sh", "-m", "torch.distributed.run"]):
        assert backend.plan(argv, Options(cwd=tmp_path)).argv[-1] == argv[-1]
    assert backend.plan(["python", "train.py", "-m", "torch.distributed.run"], Options(cwd=tmp_path)).argv[1:] == \
        ["-m", "torch.distributed.run"]


def test_backends_are_one_module_each_found_by_themselves():
    assert list(backends.BACKENDS) == ["command", "megatron", "torchtitan"]
    assert {name: type(b).__module__ for name, b in backends.BACKENDS.items()} == \
        {name: f"runtime.backends.{name}" for name in backends.BACKENDS}
    assert megatron.BACKEND is backends.get("megatron") and torchtitan.BACKEND is backends.get("torchtitan")
    with pytest.raises(backends.UnknownBackend, match=re.escape("expected command | megatron | torchtitan")):
        backends.get("deepspeed")


#: The marker in docs/extending.md before the backend that page shows.
BACKEND_MARK = "<!-- the mytrainer backend: tests/runner/test_launch_backends.py takes this block -->"


def test_the_backend_of_extending_md_is_one_module(tmp_path):
    text = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    block = text.split(BACKEND_MARK, 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]
    (tmp_path / "mytrainer.py").write_text(block + "\n")
    spec = importlib.util.spec_from_file_location("mytrainer_of_the_docs", tmp_path / "mytrainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    backend = module.BACKEND
    assert isinstance(backend, backends.Backend) and backend.name == "mytrainer"
    (tmp_path / "train.py").write_text("")
    plan = backend.plan(["train.py", "--batch_size", "8"], Options(cwd=tmp_path))
    assert plan.argv == [str(tmp_path / "train.py"), "--batch_size", "8"]
    with pytest.raises(BackendError):
        backend.plan([], Options(cwd=tmp_path))
    run = tmp_path / "run"
    (run / "out").mkdir(parents=True)
    for step in (100, 200):
        (run / "out" / f"ckpt_{step}.pt").write_bytes(b"")
    found = backend.find(plan.argv, run)
    assert found == Checkpoint(run / "out" / "ckpt_200.pt", 200)
    assert backend.command(plan.argv, run, found)[-4:] == ["--out_dir", str(run / "out"), "--resume_from",
                                                           str(found.path)]
    parse = backend.parser(plan.argv, 1)
    assert parse("iter 100: loss 2.3456, time 120.00ms, mfu 35.12%") == \
        pytest.approx({"kind": "train", "step": 100, "loss": 2.3456, "step_time_s": 0.12, "mfu": 0.3512})
    assert parse("step 100 saved") is None and parse("iter 7: loss nan, time 1.00ms, mfu 1.00%") == UNREADABLE
    assert backend.stop_signal_of(plan.argv) == signal.SIGTERM
