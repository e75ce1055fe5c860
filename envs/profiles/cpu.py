"""The CPU layer: no GPU on this machine.

The trainer falls back to gloo and float32/bf16 on CPU; none of the GPU
libraries' knobs apply, and with no names.GPU_PEAK_TFLOPS the trainer reports
MFU as n/a. The base layer's gloo interface is all a CPU run needs.
"""
from envs.spec import Profile

PROFILE = Profile("cpu", "vendor", "no GPU (CPU only)", ())
