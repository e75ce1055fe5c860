"""Compiled blocks without their guard checks, once training has stopped compiling.

Every call of a torch.compile'd block first evaluates its guards: the checks
that the code compiled earlier still fits this call (shapes, dtypes, grad mode,
the metadata of tensor subclasses, module state). With FP8 weights under FSDP2
the weights are tensor subclasses whose metadata dynamo compares in Python,
about 1 ms per block call; the GPU waits through it at every block boundary of
the forward pass (llama3_8b FP8 on two H200s: 30 ms of a 707 ms step, the
largest share of the step's idle time, BENCHMARKS.md).

A training step repeats the same calls on tensors of the same shapes. So once a
whole step has run without a single cache miss in dynamo, the steps after it
run under torch.compiler.set_stance(skip_guard_eval_unsafe=True). Dynamo then
checks only the "differentiating" guards: those on the call's input tensors
(not parameters) and any guard that has failed before, which is what tells a
validation pass under no_grad (an entry of its own) from a training step. What
it no longer checks each call is the weights and module state, which a
training step does not change in ways that would need other code. A call that
no entry fits (an input of another shape or dtype) still misses, and under the
stance torch stops with an error rather than run code compiled for other
inputs; the loop's batches all have one shape, and validation runs outside the
stance, so it compiles what it needs with every guard in force.

`train.skip_guards: false` keeps every guard on every call. A mixture-of-experts
model keeps them too, whatever the setting: how many tokens each expert gets
changes from step to step, so a later step can need code no earlier step
compiled (deepseek_v2_lite on one H100 stopped at such a step under the
stance, BENCHMARKS.md).
"""
from __future__ import annotations

import contextlib


def _cache_misses() -> int:
    """Frames dynamo has tried to compile in this process (each cache miss counts once)."""
    from torch._dynamo.utils import counters
    return int(counters["frames"]["total"])


def wanted(compile: bool, skip_guards: bool, experts: bool) -> bool:
    """Whether a run skips guards once a step compiled nothing: compiled, asked for, and its shapes
    fixed from step to step (a mixture of experts routes a different number of tokens to each expert)."""
    return compile and skip_guards and not experts


class GuardSkip:
    """Wraps each training step: guards on until a step compiles nothing, then skipped."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.active = False

    def step(self):
        """Context for one training step (forward, backward, activation recompute)."""
        if not self.enabled:
            return contextlib.nullcontext()
        if self.active:
            import torch
            return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
        return self._watched()

    @contextlib.contextmanager
    def _watched(self):
        before = _cache_misses()
        yield
        self.active = _cache_misses() == before   # nothing compiled: every call of a step is cached
