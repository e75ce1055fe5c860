"""Input made to stall Anvil does not: the secret masker is linear at megabytes, and YAML that
expands or nests without bound is refused in one line before anything is built."""
from __future__ import annotations

import subprocess
import sys

import pytest

from core import safe_yaml
from core.secrets import MASK, Masker
from helpers.program import REPO, inv, one_line_error, runs

BOMB = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
                 + [f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]) + "\n"


def _in_subprocess(code: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; a quadratic masker would take hours, not `timeout`."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("text", ["'a' * 10_000_000", "'https://' + 'a' * 10_000_000",
                                  "('x://' + 'b' * 100) * 100_000", "'postgres://u:' + 'p' * 10_000_000"],
                         ids=["long word", "long url", "many schemes", "long password"])
def test_the_masker_reads_megabytes_in_one_pass(text):
    done = _in_subprocess(f"from core.secrets import Masker\nm = Masker(['supersecretvalue', 'pw1'])\n"
                          f"out = m.text({text})\nprint(len(out))", timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_masker_still_masks_what_it_did_and_short_secrets_as_words():
    masker = Masker(["supersecretvalue", "pw1", "true"])
    text = "url https://user:hunter2@host/x pw=pw1, pw1x and xpw1 stay; supersecretvalue; true stays"
    assert masker.text(text) == (f"url https://user:{MASK}@host/x pw={MASK}, pw1x and xpw1 stay; {MASK}; "
                                 f"true stays")


def test_a_config_with_a_value_of_megabytes_starts(tmp_path):
    config = tmp_path / "big.yaml"
    config.write_text((REPO / "configs" / "tiny.yaml").read_text() + f"\nname: {'n' * 10_000_000}\n")
    done = inv(tmp_path, "train.pretrain", "--config", config, "--set", "data.path=synthetic", "--dry-run",
               timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


def test_safe_yaml_refuses_an_alias_bomb_and_deep_nesting_but_reads_aliases():
    with pytest.raises(safe_yaml.YAMLTooLarge, match="aliases expand to more than 1,000,000 values"):
        safe_yaml.load(BOMB)
    with pytest.raises(safe_yaml.YAMLTooLarge, match="nested too deeply"):
        safe_yaml.load("[" * 50_000 + "]" * 50_000)
    assert safe_yaml.load("base: &b {lr: 0.1}\nrun: *b\n") == {"base": {"lr": 0.1}, "run": {"lr": 0.1}}


@pytest.mark.parametrize("task", ["train.pretrain", "train.plan"])
def test_an_alias_bomb_config_is_one_line_and_nothing_runs(tmp_path, task):
    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB)
    line = one_line_error(inv(tmp_path, task, "--config", config, timeout=120), "bomb.yaml", "invalid YAML")
    assert "alias bomb" in line and not runs(tmp_path)
