"""The `inv` program: Invoke's task runner with Fabric's host flags.

A "superset" Fabric program (reference/invoke_fabric_slurm.md §1.6): no
bundled namespace, so it discovers tasks.py and reads invoke.yaml exactly as
stock Invoke does, and adds -H/-i/-S/-t.
"""
from fabric import Config as FabricConfig
from fabric.main import Fab
from invoke import Executor


class AnvilConfig(FabricConfig):
    # invoke.yaml / INVOKE_* like stock Invoke, plus Fabric's connection settings.
    prefix = "invoke"
    file_prefix = "invoke"
    env_prefix = "INVOKE"

    @staticmethod
    def global_defaults():
        defaults = FabricConfig.global_defaults()
        # Fabric looks for fabfile.py; we are an Invoke task runner first.
        defaults["tasks"]["collection_name"] = "tasks"
        return defaults


program = Fab(
    name="Anvil",
    version="0.1.0",
    executor_class=Executor,
    config_class=AnvilConfig,
    binary="inv",
    binary_names=["inv", "anvil"],
)


def main():
    program.run()
