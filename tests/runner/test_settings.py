"""The runner settings' defaults are written once (runtime.settings.DEFAULTS): invoke.yaml shows the same
keys and values, and an empty value in it means the default."""
from __future__ import annotations

from pathlib import Path

import yaml

from runtime import settings
from helpers.program import REPO



def test_invoke_yaml_shows_the_defaults_and_nothing_else():
    shown = yaml.safe_load((REPO / "invoke.yaml").read_text())["anvil"]
    assert list(shown) == list(settings.DEFAULTS), "invoke.yaml's anvil keys, in order, are DEFAULTS'"
    differ = {k: (shown[k], v) for k, v in settings.DEFAULTS.items() if shown[k] != v}
    assert not differ, f"invoke.yaml and runtime/settings.py DEFAULTS differ: {differ}"


def test_the_defaults_are_what_settings_hold_and_an_empty_value_means_the_default(tmp_path):
    plain = settings.from_mapping({}, tmp_path)
    emptied = settings.from_mapping({k: "" for k in ("runs_dir", "runtime", "slurm_mode", "container_python",
                                                      "hooks_dir")}, tmp_path)
    for made in (plain, emptied):
        assert made.runs_dir == tmp_path / settings.DEFAULTS["runs_dir"]
        assert str(made.runtime) == settings.DEFAULTS["runtime"]
        assert made.slurm_mode == settings.DEFAULTS["slurm_mode"]
        assert made.container_python == settings.DEFAULTS["container_python"]
        assert made.hooks_dir == tmp_path / settings.DEFAULTS["hooks_dir"]
    assert plain.hook_timeout == settings.DEFAULTS["hook_timeout"]
    assert plain.connect_timeout == settings.DEFAULTS["connect_timeout"]
