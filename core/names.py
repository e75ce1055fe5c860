"""Every name Anvil's processes share: the ANVIL_* environment variables and the files of a run
directory. One spelling each, here; everything else imports it.

    os.environ.get(names.HOST)                  # not "ANVIL_HOST"
    run_dir / names.METRICS                     # not "metrics.jsonl"

Each variable carries a one-line meaning and who sets it ("user": you may; "anvil": Anvil sets it
for the processes it starts; "test": the test suite only). The table in docs/variables.md is made
from VARIABLES (`python -m core.names`), and a test holds the two together. Standard library only:
./bootstrap reads this file before any package is installed.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    meaning: str
    set_by: str = "user"        # user | anvil | test


VARIABLES: dict[str, Variable] = {}


def _variable(name: str, meaning: str, set_by: str = "user") -> str:
    assert name.startswith(PREFIX) and name not in VARIABLES, name
    VARIABLES[name] = Variable(name, meaning, set_by)
    return name


PREFIX = "ANVIL_"
#: Invoke's own variables for the runner settings (anvil.<key> in invoke.yaml): INVOKE_ANVIL_<KEY>.
SETTINGS_PREFIX = "INVOKE_ANVIL_"


def setting_variable(key: str) -> str:
    """The environment variable that overrides the runner setting anvil.<key>."""
    return SETTINGS_PREFIX + key.upper()


# ---- set by you -------------------------------------------------------------------------------
PYTHON = _variable("ANVIL_PYTHON", "./bootstrap: the interpreter .venv is made from (default: the one running it)")
TORCH_SPEC = _variable("ANVIL_TORCH_SPEC", "./bootstrap: the pip requirement for torch when none is installed")
GPU = _variable("ANVIL_GPU", "act as this GPU model and count (MI300X, H100:8): profiles, plans and dry runs "
                "for a machine you are not on")
ALLOW_UNKNOWN_GPU = _variable("ANVIL_ALLOW_UNKNOWN_GPU", "1: a GPU without an Anvil profile is a warning in "
                              "preflight, not a failure")
GPU_PEAK_TFLOPS = _variable("ANVIL_GPU_PEAK_TFLOPS", "the dense bf16 peak MFU is measured against (set by the "
                            "GPU's profile; set it for a GPU Anvil has none for)")
GPU_ARCH = _variable("ANVIL_GPU_ARCH", "the GPU's architecture (gfx942, sm_90), set by its profile; kernels and "
                     "caches key on it")
CACHE_DIR = _variable("ANVIL_CACHE_DIR", "Anvil's cache (TunableOp results, compiled kernels); default "
                      "$XDG_CACHE_HOME/anvil")
RUN_KEY = _variable("ANVIL_RUN_KEY", "the file of your run key, which seals your runs as yours (default "
                    "$XDG_CONFIG_HOME/anvil/run-key)")
TASKS_PATH = _variable("ANVIL_TASKS_PATH", "more folders of task collections (a site's own tasks), "
                       "os.pathsep-separated")
LOG_RANK = _variable("ANVIL_LOG_RANK", "which rank's log lines reach the console (a number, or all)")
AGENT_GRACE = _variable("ANVIL_AGENT_GRACE", "seconds the node agent waits for its ranks after a stop signal "
                        "before it kills them (default 10)")
PROGRESS_INTERVAL = _variable("ANVIL_PROGRESS_INTERVAL", "seconds between plain progress lines of data.prepare "
                              "(default 5)")
GPU_WATCH_S = _variable("ANVIL_GPU_WATCH_S", "seconds between the node agent's readings of its GPUs (clocks, "
                        "power, temperature, ECC, Xid; logs/gpu-<node>.jsonl); 0 = off (default 10)")
SIGNAL_CHECK_EVERY = _variable("ANVIL_SIGNAL_CHECK_EVERY", "steps between the ranks' agreement on a stop signal "
                               "(default: chosen from the step time)")
CUBLASLT = _variable("ANVIL_CUBLASLT", "0: the LM head's weight-gradient GEMMs use torch.mm instead of "
                            "the cuBLASLt kernel chosen by timing")
GROUPED_GEMM_TUNE = _variable("ANVIL_GROUPED_GEMM_TUNE", "0: the MoE grouped GEMM runs its architecture's first "
                              "tile configuration instead of the one chosen by timing")
FLCE_CHUNK_FACTOR = _variable("ANVIL_FLCE_CHUNK_FACTOR", "the fused LM head's chunk size as a multiple of "
                              "Liger's (default 4; 1 = Liger's memory)")
FLCE_FUSED_CAST = _variable("ANVIL_FLCE_FUSED_CAST", "0: the fused LM head casts its gradient in a pass of its "
                            "own (for comparison)")

# ---- set by Anvil for the processes it starts -------------------------------------------------
HOST = _variable("ANVIL_HOST", "this host as the launcher reached it (the -H name, the Slurm node name)", "anvil")
NODE_RANK = _variable("ANVIL_NODE_RANK", "this node's place among the task's nodes", "anvil")
NODE_COUNT = _variable("ANVIL_NNODES", "how many nodes the task runs on", "anvil")
NODE_RUNS_DIR = _variable("ANVIL_NODE_RUNS_DIR", "where a node's own part of a fanned-out task records its "
                          "run", "anvil")
NODE_RUNTIME = _variable("ANVIL_NODE_RUNTIME", "how a node runs its part of a fanned-out task", "anvil")
NODE_LOCAL = _variable("ANVIL_NODE_LOCAL", "the variables each node computes for itself (its network "
                       "interface, ...), comma-separated", "anvil")
RUN_DIR = _variable("ANVIL_RUN_DIR", "the run directory, for hooks and the node agent", "anvil")
LAUNCHER_PID = _variable("ANVIL_LAUNCHER_PID", "the process that started the node agent; the agent stops its "
                         "ranks when it dies", "anvil")
PROGRESS_TTY = _variable("ANVIL_PROGRESS_TTY", "1: the launching terminal shows live progress lines", "anvil")
REPLAY_OF = _variable("ANVIL_REPLAY_OF", "the run a replay re-runs", "anvil")
REPLAY_TRUSTED = _variable("ANVIL_REPLAY_TRUSTED", "1: the replay was given --trust-run; key: the run is "
                           "sealed with the user's run key", "anvil")
#: The replay's own variables: never taken from a run directory.
REPLAY_PREFIX = "ANVIL_REPLAY_"
TASK = _variable("ANVIL_TASK", "hooks: the task they run around (train.pretrain)", "anvil")
PHASE = _variable("ANVIL_PHASE", "hooks: pre or post", "anvil")
RANK = _variable("ANVIL_RANK", "hooks: the node rank they run on", "anvil")
OUTCOME = _variable("ANVIL_OUTCOME", "post hooks: how the task ended (ok, failed, interrupted, ...)", "anvil")
OUTCOME_ERROR = _variable("ANVIL_OUTCOME_ERROR", "post hooks: the task's error line, if it failed", "anvil")
HOOK_SESSION = _variable("ANVIL_HOOK_SESSION", "hooks: marks every process a hook starts, so that a hook past "
                         "its timeout is killed with all of them, those that left its session (setsid) too", "anvil")
PROFILE_STEPS = _variable("ANVIL_PROFILE_STEPS", "profile.train: the steps to profile (START:END)", "anvil")
PROFILE_RANKS = _variable("ANVIL_PROFILE_RANKS", "profile.train: the ranks to profile", "anvil")
PROFILE_TOOL = _variable("ANVIL_PROFILE_TOOL", "profile.train --tool: the vendor profiler the ranks run under",
                         "anvil")
PROFILE_TOOL_KERNELS = _variable("ANVIL_PROFILE_TOOL_KERNELS", "profile.train --kernels: the kernels the "
                                 "vendor profiler is pointed at", "anvil")
PROFILE_TOOL_ARGS = _variable("ANVIL_PROFILE_TOOL_ARGS", "profile.train: more options for the vendor profiler "
                              "(shell-quoted)", "anvil")
RESUME = _variable("ANVIL_RESUME", "train.launch: 1 when the program is to resume (a requeued job, --resume): from "
                   "the checkpoint in ANVIL_RESUME_FROM", "anvil")
RESUME_FROM = _variable("ANVIL_RESUME_FROM", "train.launch: the checkpoint the program resumes from (set with "
                        "ANVIL_RESUME)", "anvil")
CHECKPOINT_DIR = _variable("ANVIL_CHECKPOINT_DIR", "train.launch: the folder the program saves its checkpoints in "
                           "(RUN/checkpoints for --backend command)", "anvil")

# ---- the test suite's ---------------------------------------------------------------------------
TEST_CHECKPOINT_DELAY_S = _variable("ANVIL_TEST_CHECKPOINT_DELAY_S", "a checkpoint save waits this long after "
                                    "its files are written (to kill it mid-write)", "test")
TEST_FAULT = _variable("ANVIL_TEST_FAULT", "the fault the tests' injection module makes", "test")
TEST_FAULT_RANK = _variable("ANVIL_TEST_FAULT_RANK", "the rank the tests' fault injection acts in", "test")
TEST_FAULT_HOST = _variable("ANVIL_TEST_FAULT_HOST", "the host whose ranks the tests' fault injection acts in",
                            "test")
TEST_FAULT_TIMES = _variable("ANVIL_TEST_FAULT_TIMES", "how many processes the tests' fault fires in", "test")
TESTNET_PREFIX = _variable("ANVIL_TESTNET_PREFIX", "the /16 the test clusters take their subnets from "
                           "(default 10.213)", "test")

#: The tasks that train: stop signals end them as the trainer's (3: requeue me; 130), their runs end with
#: summary.json and metrics.jsonl (train.launch: the runner's summary of the backend's metrics).
TRAINING_TASKS = ("train.pretrain", "profile.train", "train.launch")

# ---- a run directory (runtime/runs/rundir.py lays it out) ---------------------------------------
METADATA = "metadata.json"          # task, name, argv, start, end, status, hosts, ...
COMMAND = "command.txt"             # the command line, masked
ENV_RECORD = "env.json"             # the resolved environment with each value's source, masked
ENVIRON = "environ.json"            # the whole process environment, masked
MACHINE = "machine.json"            # the GPUs and the system (envs.detect)
VERSIONS = "versions.json"          # python, torch, triton, driver, ROCm/CUDA, Anvil's commit
GIT = "git.json"                    # the checkout's commit and state
GIT_DIFF = "git.diff"
PIP_FREEZE = "pip-freeze.txt"
RESULT = "result.json"              # what the task returned
SUMMARY = "summary.json"            # the trainer's end-of-run summary
METRICS = "metrics.jsonl"           # the trainer's records, one JSON object a line
REPORT_HTML = "report.html"         # snapshot.report's page
FANOUT_REPORT = "report.json"       # a fanned-out task's merged table, and
FANOUT_TEXT = "report.txt"          # as text
PREFLIGHT = "preflight.json"
TOPOLOGY = "topology.json"
BASELINE = "baseline.json"
GEMM = "gemm.json"
COLLECTIVES = "collectives.json"
KERNELS = "kernels.json"
CONFIGS_DIR = "configs"             # the configs as used
TRAIN_CONFIG = "train.yaml"         # the training config, in CONFIGS_DIR
LOGS_DIR = "logs"                   # RUNNER_LOG, LAUNCHER_LOG, rank<R>.log, agent-<node>.json
RUNNER_LOG = "runner.log"
LAUNCHER_LOG = "launcher.log"
CHECKPOINTS_DIR = "checkpoints"
HOOKS_DIR = "hooks"                 # hook outputs
HOSTS_DIR = "hosts"                 # a fanned-out task's per-host runs and results
NODES_DIR = "nodes"                 # which hosts passed and failed (runtime/runs/nodes.py):
PASSING_HOSTS = "pass.txt"          #   one host a line
FAILING_HOSTS = "fail.txt"          #   one host a line
FAILURES = "fail.json"              #   each failing host's reasons (sealed)
PROFILE_DIR = "profile"             # profile.train's traces and breakdowns, and
PROFILE_SUMMARY = "summary.json"    # their summary, in PROFILE_DIR


RANK_LOGS = "rank*.log"             # in LOGS_DIR, every rank's log
HANG_REPORTS = "hang-rank*.json"    # in LOGS_DIR, the hang watchdog's reports
GPU_LOGS = "gpu-*.jsonl"            # in LOGS_DIR, each node agent's GPU readings (runtime/launch/gpuwatch.py)
FAULT_REPORTS = "fault-rank*.json"  # in LOGS_DIR, the ranks a rerun step blamed (trainer/numeric.py)
ATTEMPTS_DIR = "attempts"           # in LOGS_DIR, each failed attempt's agent, hang and fault reports

# ---- between the runner and a Python hook's own interpreter (runtime/runs/hooks.py), in its folder
HOOK_REQUEST = "request.json"       # which hook, with what context
HOOK_RESULT = "result.json"         # what it returned, or its error
HOOK_LOG = "log.jsonl"              # its log records, relayed to the run's log


def rank_log(rank: int) -> str:
    return f"rank{rank}.log"


def hang_report(rank: int) -> str:
    return f"hang-rank{rank}.json"


def fault_report(rank: int) -> str:
    return f"fault-rank{rank}.json"


def gpu_log(node_rank: int) -> str:
    return f"gpu-{node_rank}.jsonl"


def agent_report(node_rank: int) -> str:
    return f"agent-{node_rank}.json"


def markdown_table() -> str:
    """The variables as docs/variables.md shows them."""
    rows = ["| variable | set by | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.set_by} | {v.meaning} |" for v in VARIABLES.values()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
