"""The run record: run directories, snapshots, hooks, history, replay, failure diagnosis."""
