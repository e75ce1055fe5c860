"""Vendor probes: read what a vendor library, tool or sysfs says about the GPUs.

Parsers take their input (a library module, a command's output, a root
directory standing in for "/") so tests run them on real-format samples.
"""
