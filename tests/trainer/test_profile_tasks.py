"""`inv profile.compare` on recorded traces, and `inv profile.train --tool`: the vendor profiler around the chosen
ranks (a stand-in `ncu` on PATH that records how it was called and runs the rank), a missing or wrong tool in one
line, and the tools' command lines."""
import json
import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

from runtime.jobs import profiling
from runtime.launch import tools
from trainer.profiling import trace
from trainer.profiling.breakdown import breakdown

from helpers.program import anvil_context, inv, one_line_error, run_inv, runs

TRACES = Path(__file__).resolve().parent / "traces"


def profiled_run(runs: Path, name: str, doc: dict, steps: int = 1, ranks=(0,), config=None) -> Path:
    """A run directory as profile.train leaves it: metadata, the config as used, the ranks' breakdown files."""
    run = runs / f"2026-11-25T10-00-0{len(list(runs.glob('*'))) if runs.exists() else 0}_profile.train_{name}"
    (run / "profile").mkdir(parents=True)
    (run / "configs").mkdir()
    (run / "metadata.json").write_text(json.dumps({"task": "profile.train", "name": name, "status": "ok",
                                                   "world_size": 8, "config_sources": {"train.yaml": "x.yaml"}}))
    (run / "configs" / "train.yaml").write_text(json.dumps(config or {"train": {"kernels": False}}))
    for rank in ranks:
        (run / "profile" / f"rank{rank}.breakdown.json").write_text(json.dumps(
            {"rank": rank, "steps": [3, 3 + steps], "wall_ms": None, "breakdown": breakdown(doc, steps)}))
    return run


@pytest.fixture(scope="module")
def a100():
    return trace.load(TRACES / "a100_dlrm_step.trace.json.gz")


def test_compare_puts_two_profiles_side_by_side_with_the_difference(tmp_path, a100):
    events = trace.gpu_events(a100)
    first, last = min(float(e["ts"]) for e in events), max(float(e["ts"]) for e in events)
    # B: the same step without the kernels of its first quarter (less GEMM, less of everything)
    later = trace.excerpt(a100, first + (last - first) / 4, last + 1)
    a = profiled_run(tmp_path / "runs", "base", a100)
    b = profiled_run(tmp_path / "runs", "change", later)
    proc = run_inv("profile.compare", str(a), b.name, runs=tmp_path / "runs")   # a path, or a name under runs/
    assert proc.returncode == 0, proc.stderr
    lines = {line.split("  ")[0]: line for line in proc.stdout.splitlines()}
    assert f"A = {a.name}, B = {b.name}" in proc.stdout
    bd_a, bd_b = breakdown(a100, 1), breakdown(later, 1)
    gemm_a, gemm_b = (next(r["ms"] for r in bd["rows"] if r["category"] == "gemm") for bd in (bd_a, bd_b))
    assert f"{gemm_a:.2f}" in lines["GEMM"] and f"{gemm_b - gemm_a:+.2f}" in lines["GEMM"]
    assert "communication total" in proc.stdout and lines["step"].split()[-2].startswith("-")   # B's step is shorter
    as_json = json.loads(run_inv("profile.compare", str(a), str(b), "--json", runs=tmp_path / "runs").stdout)
    assert as_json["diff_ms"]["gemm"] == pytest.approx(gemm_b - gemm_a, abs=2e-3)
    assert as_json["a"]["run"] == a.name and as_json["rank"] == "0"


def test_compare_refuses_what_it_cannot_compare_in_one_line(tmp_path, a100):
    a = profiled_run(tmp_path / "runs", "base", a100, ranks=(0,))
    b = profiled_run(tmp_path / "runs", "other", a100, ranks=(8,))
    empty = tmp_path / "runs" / "2026-11-25T11-00-00_train.pretrain_x"
    empty.mkdir()
    (empty / "metadata.json").write_text("{}")
    for args, said in [((str(a), str(b)), "no rank in common"),
                       ((str(a), str(a), "--rank", "3"), "--rank 3: profiled in both runs are ranks 0"),
                       ((str(a), str(tmp_path / "nowhere")), "no such run directory"),
                       ((str(a), str(empty)), "no profile in it")]:
        proc = run_inv("profile.compare", *args, runs=tmp_path / "runs")
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_the_summary_holds_each_rank_with_its_advice(tmp_path, a100):
    run = profiled_run(tmp_path / "runs", "base", a100, ranks=(0, 8),
                       config={"train": {"kernels": True, "compile": False}, "parallel": {"strategy": "fsdp"}})
    summary = profiling.build(run)
    assert set(summary["ranks"]) == {"0", "8"} and summary["settings"]["kernels"] is True
    found = summary["ranks"]["0"]["candidates"]
    assert found and all(c["category"] not in ("gemm", "gemm_fp8") and c["share"] > 0.02 for c in found)
    assert "reshard_after_forward" in next(c["action"] for c in found if c["category"] == "communication")


def test_the_summary_a_run_writes_reads_back_whole(tmp_path, a100):
    """Written through the run (masked, atomic) and read back by profile.compare: nothing in it looks secret."""
    from runtime.runs.run import RunSpec, execute

    def body(run):
        (run.path / "profile").mkdir()
        (run.path / "profile" / "rank0.breakdown.json").write_text(json.dumps(
            {"rank": 0, "steps": [3, 4], "wall_ms": 80.0, "breakdown": breakdown(a100, 1, wall_ms=80.0)}))
        return profiling.summarise(run)

    ctx = anvil_context(tmp_path / "runs", hooks_dir=tmp_path / "no-hooks")
    made = execute(ctx, RunSpec(task="profile.train", hooks=False), body)
    (run,) = (tmp_path / "runs").iterdir()
    again = profiling.load_summary(run)
    assert "<masked>" not in (run / "profile" / "summary.json").read_text()
    assert again["ranks"]["0"]["breakdown"]["rows"] == made["ranks"]["0"]["breakdown"]["rows"]
    assert [c["category"] for c in again["ranks"]["0"]["candidates"]] == \
        [c["category"] for c in made["ranks"]["0"]["candidates"]]
    assert made["chart"] == str(run / "profile" / "breakdown.png") and (run / "profile" / "breakdown.png").stat().st_size


def test_tool_kernels_from_a_profiled_run_are_its_largest_kernels_by_function_name(tmp_path, a100):
    run = profiled_run(tmp_path / "runs", "base", a100)
    regex = profiling.kernel_regex(str(run), top=3)
    assert regex.split("|")[0] == "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t" and len(regex.split("|")) == 3
    assert profiling.function_name("void at::native::vectorized_elementwise_kernel<4, at::native::"
                                   "CUDAFunctor_add<float>, at::detail::Array<char*, 3> >(int, float)") \
        == "vectorized_elementwise_kernel"
    assert profiling.function_name("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN"
    assert profiling.kernel_regex("nvjet|sdpa", 5) == "nvjet|sdpa"
    with pytest.raises(profiling.ProfileError, match="neither a run directory nor a regular expression"):
        profiling.kernel_regex("nvjet(", 5)


def test_ncu_raw_csv_is_read_per_kernel():
    text = ('==PROF== Disconnected\n"ID","Kernel Name","gpu__time_duration.sum","launch__grid_size",'
            '"sm__throughput.avg.pct_of_peak_sustained_elapsed",'
            '"gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"\n'
            '"","","usecond","","%","%"\n'
            '"0","nvjet_tst_128x256","1,234.5","528","88.1","41.0"\n')
    (row,) = profiling.parse_ncu_csv(text)
    assert row["kernel"] == "nvjet_tst_128x256" and row["gpu__time_duration.sum"] == 1234.5
    assert row["sm__throughput.avg.pct_of_peak_sustained_elapsed"] == 88.1


# ---------------------------------------------------------------- vendor tools

def test_each_tool_records_only_the_capture_range(tmp_path):
    nsys = tools.tool_command("nsys", 3, tmp_path)
    assert nsys[:2] == ["nsys", "profile"] and "--capture-range=cudaProfilerApi" in nsys
    assert "--capture-range-end=stop" in nsys and f"--output={tmp_path / 'rank3'}" in nsys
    ncu = tools.tool_command("ncu", 0, tmp_path, kernels="nvjet|sdpa", extra="--set full")
    assert ncu[ncu.index("--profile-from-start") + 1] == "off" and "regex:nvjet|sdpa" in ncu
    assert ncu[ncu.index("--filter-mode") + 1] == "per-launch-config" and ncu[-2:] == ["--set", "full"]
    roc = tools.tool_command("rocprofv3", 1, tmp_path)
    assert roc[:2] == ["rocprofv3", "--selected-regions"] and "--kernel-trace" in roc and roc[-1] == "--"
    counters = tools.tool_command("rocprofv3-counters", 1, tmp_path, kernels="Cijk_")
    assert "--pmc" in counters and counters[counters.index("--kernel-include-regex") + 1] == "Cijk_"
    env = {tools.TOOL_VAR: "nsys", "ANVIL_PROFILE_RANKS": "1"}
    assert tools.wrap(["python"], 0, env, tmp_path) == ["python"]
    assert tools.wrap(["python"], 1, env, tmp_path)[:2] == ["nsys", "profile"]
    assert tools.wrap(["python"], 1, {}, tmp_path) == ["python"]


FAKE_NCU = r'''#!{python}
"""A stand-in for ncu: records its command line and environment, writes the report, runs the program."""
import json, os, subprocess, sys
args = sys.argv[1:]
if args[:1] == ["--import"]:
    print('"ID","Kernel Name","gpu__time_duration.sum","launch__grid_size",'
          '"sm__throughput.avg.pct_of_peak_sustained_elapsed","gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"')
    print('"","","usecond","","%","%"')
    print('"0","fake_gemm_kernel","812.5","1056","91.0","37.5"')
    sys.exit(0)
start = next(i for i, a in enumerate(args) if "python" in os.path.basename(a))
with open(os.environ["FAKE_NCU_LOG"], "a") as log:
    log.write(json.dumps({{"options": args[:start], "rank": os.environ.get("RANK")}}) + "\n")
open(args[args.index("--export") + 1] + ".ncu-rep", "w").write("report")
sys.exit(subprocess.call(args[start:]))
'''


def fake_tool(tmp_path, name="ncu") -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text(FAKE_NCU.format(python=sys.executable))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_NCU_LOG": str(tmp_path / "ncu.log")}


@pytest.mark.slow
def test_profile_train_runs_the_chosen_rank_under_the_tool_for_its_window(tmp_path, dataset):
    env = fake_tool(tmp_path)
    sets = [f"data.path={dataset}", "data.seq_len=32", "data.batch_size=2", "model.n_layers=1",
            "train.val_interval=0", "train.log_interval=1"]
    args = ["profile.train", "--nproc", "2", "--ranks", "1", "--steps", "2:3", "--tool", "ncu",
            "--tool-kernels", "nvjet|_rms_norm", "--env", "OMP_NUM_THREADS=1"]
    for item in sets:
        args += ["--set", item]
    proc = run_inv(*args, env=env, runs=tmp_path / "runs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    calls = [json.loads(line) for line in (tmp_path / "ncu.log").read_text().splitlines()]
    assert [c["rank"] for c in calls] == ["1"]                       # rank 0 ran bare
    options = calls[0]["options"]
    assert options[options.index("--profile-from-start") + 1] == "off"
    assert "regex:nvjet|_rms_norm" in options and options[options.index("--export") + 1] == str(run / "profile" / "rank1")
    window = json.loads((run / "profile" / "rank1.window.json").read_text())
    assert window["tool"] == "ncu" and window["steps"] == [2, 3] and window["wall_ms"] > 0
    assert not (run / "profile" / "rank1.trace.json").exists()     # one profiler at a time
    assert "rank1.ncu-rep" in proc.stdout and "fake_gemm_kernel" in proc.stdout and "91.0" in proc.stdout


def test_a_missing_or_wrong_tool_is_one_line_before_anything_runs(tmp_path):
    path = {"PATH": str(Path(sys.executable).parent)}      # python, and no profiler
    proc = run_inv("profile.train", "--tool", "nsys", "--set", "data.path=synthetic", env=path,
                   runs=tmp_path / "runs")
    assert proc.returncode == 2 and "nsys is not installed here (not on PATH)" in proc.stderr, proc.stderr
    wrong = run_inv("profile.train", "--tool", "ncu", "--gpu", "MI300X", "--set", "data.path=synthetic",
                    runs=tmp_path / "runs")
    assert wrong.returncode == 2 and "--tool ncu profiles CUDA GPUs" in wrong.stderr and "rocprofv3" in wrong.stderr
    unknown = run_inv("profile.train", "--tool", "vtune", runs=tmp_path / "runs")
    assert unknown.returncode == 2 and "--tool 'vtune': expected one of nsys, ncu" in unknown.stderr
    alone = run_inv("profile.train", "--tool-args", "--set full", runs=tmp_path / "runs")
    assert alone.returncode == 2 and "go with --tool" in alone.stderr
    assert not (tmp_path / "runs").exists() and "Traceback" not in proc.stderr + wrong.stderr


def test_the_dry_run_shows_the_tool_command_of_the_first_chosen_rank(tmp_path, dataset):
    proc = run_inv("profile.train", "--dry-run", "--tool", "rocprofv3", "--ranks", "1", "--nproc", "2",
                   "--set", f"data.path={dataset}", runs=tmp_path / "runs")
    assert proc.returncode == 0, proc.stderr
    assert "ANVIL_PROFILE_TOOL=rocprofv3" in proc.stdout
    assert "rank 1 runs under: rocprofv3 --selected-regions --kernel-trace" in proc.stdout


def test_the_agent_refuses_a_missing_tool_before_starting_a_rank(tmp_path, capfd, monkeypatch):
    from runtime.launch.agent import Agent

    monkeypatch.chdir(tmp_path)
    started = tmp_path / "started"
    environ = {tools.TOOL_VAR: "nsys", "ANVIL_PROFILE_RANKS": "0", "PATH": str(tmp_path / "empty"),
               "ANVIL_RUN_DIR": str(tmp_path / "run")}
    agent = Agent(1, 1, 0, "127.0.0.1", 0, [sys.executable, "-c", f"open({str(started)!r}, 'w')"], environ=environ)
    assert agent.run() == 2
    assert "anvil-agent: nsys is not installed here (not on PATH)" in capfd.readouterr().err
    assert json.loads((tmp_path / "run" / "logs" / "agent-0.json").read_text())["exit_code"] == 2
    assert not started.exists()


# ---- bad options, as a user types them in a fresh folder: one line, exit 2, no run directory

PROFILE_OPTION_CASES = [
    ("profile.train --steps abc", "--steps 'abc': expected START:END with 1 <= START < END (end exclusive), e.g. 3:6"),
    ("profile.train --steps 0:3", "--steps '0:3': expected START:END with 1 <= START < END"),
    ("profile.train --ranks ''", "--ranks '': expected global ranks >= 0 such as 0 or 0,8, or all"),
    ("profile.train --ranks 0,-2", "--ranks '0,-2': expected global ranks >= 0"),
    ("profile.train --top 0", "--top: expected a positive number of operators, got 0"),
    ("profile.train --nproc -1", "--nproc: expected a positive number of processes per node"),
]


@pytest.mark.parametrize("command,message", PROFILE_OPTION_CASES, ids=[c for c, _ in PROFILE_OPTION_CASES])
def test_profile_option_is_one_line_and_exit_2(tmp_path, command, message):
    args = shlex.split(command)
    one_line_error(inv(tmp_path, *args, timeout=120), f"{args[0]}: ", message)
    assert runs(tmp_path) == []  # no run directory made
