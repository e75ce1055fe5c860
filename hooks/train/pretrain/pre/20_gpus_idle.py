"""Before training: no other process is computing on this node's GPUs (skipped on a CPU machine).

A leftover rank from a crashed run holds memory and SMs; the new run then
OOMs or runs at half speed with no error pointing at the cause.
"""
import os


def hook(ctx):
    import envs

    machine = envs.detect()
    if not machine.has_gpu:
        ctx.log.info("no GPU on this machine: nothing to check")
        return
    status = envs.gpu_status(machine)
    if status is None:
        ctx.log.warning("no probe reports GPU processes here (pyrsmi/nvidia-ml-py/rocm-smi/nvidia-smi): not checked")
        return
    busy = sorted(set(status.pids) - {os.getpid()})
    if busy:
        raise RuntimeError(f"the GPUs are busy: process(es) {', '.join(map(str, busy))} already compute on them "
                           f"(seen by {status.source}); stop them, or pass --no-hooks to start anyway")
    ctx.log.info("%d GPU(s) idle (%s)", len(status.devices), status.source)
