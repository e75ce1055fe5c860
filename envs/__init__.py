"""GPU detection and layered environment profiles.

    machine = envs.detect()                 # or envs.detect("MI300X")
    resolved = envs.resolve(machine, site="lumi", overrides=["NCCL_DEBUG=INFO"])
    resolved.environ()                      # {name: value} to export
    resolved.vars["NCCL_SOCKET_IFNAME"].history

No torch import anywhere in this package: `inv --list` stays fast.
"""
from envs.configenv import load_config_env
from envs.detect import detect, gpu_status, synthesize
from envs.errors import EnvError
from envs.export import diff, shell_script
from envs.machine import Gpu, GpuStatus, Machine
from envs.resolve import Change, ResolvedEnv, Var, compute_here, resolve

__all__ = ["Change", "EnvError", "Gpu", "GpuStatus", "Machine", "ResolvedEnv", "Var", "detect", "diff",
           "gpu_status", "load_config_env", "resolve", "shell_script", "synthesize"]
