"""What tasks call: one function per job (training, benchmarks, preflight, environment)."""
