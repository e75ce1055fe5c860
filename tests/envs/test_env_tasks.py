"""inv env.*: the installed `inv` run as a user runs it; assertions on what it prints, and bad input as one
line (exit 2)."""
from __future__ import annotations

import json
import os
import re
import subprocess

from helpers.program import SHELL_CHOICES, inv, one_line_error


def test_show_mi300x_lists_rocm_variables_with_sources(checked_inv):
    out = checked_inv("env.show", "--gpu", "MI300X", "--json").stdout
    data = json.loads(out)
    assert data["machine"]["model"] == "MI300X" and data["layers"][:3] == ["base", "vendor:rocm", "model:mi300x"]
    scratch = data["vars"]["HSA_NO_SCRATCH_RECLAIM"]
    assert scratch["value"] == "1" and scratch["source"] == "vendor:rocm" and "Primus" in scratch["ref"]
    assert "ROCm docs" in data["vars"]["TORCH_NCCL_HIGH_PRIORITY"]["ref"]
    assert data["vars"]["ANVIL_GPU_PEAK_TFLOPS"]["value"] == "1307.4"
    table = checked_inv("env.show", "--gpu", "MI300X").stdout
    assert "RCCL_MSCCL_ENABLE" in table and "model:mi300x" in table and "HIP_FORCE_DEV_KERNARG" in table


def test_explain_lumi_socket_ifname(checked_inv):
    out = checked_inv("env.explain", "NCCL_SOCKET_IFNAME", "--gpu", "MI250X", "--site", "lumi").stdout
    assert out.startswith("NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3  [site:lumi]")
    assert "1. base:" in out and "2. site:lumi: hsn0,hsn1,hsn2,hsn3" in out and "LUMI AI guide" in out
    missing = checked_inv("env.explain", "NO_SUCH_VAR", "--gpu", "H100", check=False)
    assert missing.returncode == 2 and "no layer sets NO_SUCH_VAR" in missing.stderr


def test_export_sourced_by_bash_gives_the_values(checked_inv, tmp_path):
    target = tmp_path / "anvil.env"
    checked_inv("env.export", "--gpu", "MI250X", "--site", "lumi", "--env", "WEIRD=a b 'c' $HOME;x", "-o",
                str(target))
    shell = subprocess.run(["bash", "-c", f"source {target} && printf '%s|%s|%s' \"$WEIRD\" "
                            "\"$NCCL_SOCKET_IFNAME\" \"$ANVIL_GPU_PEAK_TFLOPS\""],
                           capture_output=True, text=True, timeout=10, env={"PATH": os.environ["PATH"]})
    assert shell.stdout == "a b 'c' $HOME;x|hsn0,hsn1,hsn2,hsn3|191.5"


def test_diff_two_profiles(checked_inv):
    data = json.loads(checked_inv("env.diff", "-a", "MI300X", "-b", "H100", "--json").stdout)
    rows = {r["name"]: r for r in data["rows"]}
    assert rows["ANVIL_GPU_ARCH"]["a"] == "gfx942" and rows["ANVIL_GPU_ARCH"]["b"] == "sm_90"
    assert rows["NCCL_NVLS_ENABLE"]["a"] is None and rows["NCCL_NVLS_ENABLE"]["b_source"] == "vendor:cuda"
    assert "no differences" in checked_inv("env.diff", "-a", "MI300X", "-b", "MI325X").stdout  # same compute die
    table = checked_inv("env.diff", "-a", "MI300X", "-b", "B200").stdout
    assert re.search(r"ANVIL_GPU_PEAK_TFLOPS\s+1307.4  \[model:mi300x\]\s+2250  \[model:b200\]\s+\*", table)


def test_config_env_block_is_a_layer(checked_inv, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("env:\n  NCCL_DEBUG: INFO\n  MY_FLAG: 1\n")
    data = json.loads(checked_inv("env.show", "--gpu", "H100", "--config", str(config), "--json").stdout)
    assert data["vars"]["NCCL_DEBUG"]["source"] == "config" and data["vars"]["MY_FLAG"]["value"] == "1"
    config.write_text("env: [broken\n")
    bad = checked_inv("env.show", "--config", str(config), check=False)
    assert bad.returncode == 2 and str(config) in bad.stderr


def test_user_errors_are_one_message(checked_inv):
    unknown = checked_inv("env.show", "--gpu", "MI999", check=False)
    assert unknown.returncode == 2 and "known models: MI210, MI250X, MI300X" in unknown.stderr
    bad_env = checked_inv("env.show", "--env", "NOEQUALS", check=False)
    assert bad_env.returncode == 2 and "KEY=VALUE" in bad_env.stderr


def test_detect_says_no_gpu(checked_inv):
    assert "no GPU on this machine" in checked_inv("env.detect").stdout
    assert json.loads(checked_inv("env.detect", "--json").stdout)["vendor"] == "cpu"


# ---- env.explain as a user types it, in a fresh folder: any case, else one line and exit 2

def test_explain_matches_a_name_in_any_case(tmp_path):
    proc = inv(tmp_path, "env.explain", "nccl_socket_ifname", "--gpu", "MI250X", "--site", "lumi", unset=SHELL_CHOICES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3  [site:lumi]")


def test_explain_unknown_name_is_one_line_with_suggestions(tmp_path):
    one_line_error(inv(tmp_path, "env.explain", "FOO_BAR", unset=SHELL_CHOICES), "no layer sets FOO_BAR",
                   "inv env.show")
    one_line_error(inv(tmp_path, "env.explain", "nccl_socket_ifnam", "--gpu", "H100", unset=SHELL_CHOICES),
                   "no layer sets nccl_socket_ifnam", "did you mean NCCL_SOCKET_IFNAME")
    one_line_error(inv(tmp_path, "env.explain", "HSA_NO_SCRATCH_RECLAIM", "--gpu", "H100", unset=SHELL_CHOICES),
                   "no layer sets HSA_NO_SCRATCH_RECLAIM", "set by vendor:rocm", "--gpu")
