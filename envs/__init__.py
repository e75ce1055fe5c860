"""GPU detection and layered environment profiles."""
