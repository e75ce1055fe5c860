"""What tasks call: one function per job (training, benchmarks, the environment, planning, a task on every
node, the end of runs nobody recorded)."""
