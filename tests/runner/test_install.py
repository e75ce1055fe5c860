"""The installed program, as ./bootstrap leaves it: .venv/bin/inv is Anvil's,
fast to list, completes in a shell; bootstrap itself is idempotent and fails
cleanly. (The full fresh-clone install is too slow for the suite; it is timed
by hand and reported.)
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

COLLECTIONS = ("env", "preflight", "data", "train", "bench", "profile", "snapshot")


def run_command(argv, cwd, env=None, timeout=60):
    return subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_inv_is_anvils_program(inv_bin, repo):
    version = run_command([inv_bin, "--version"], repo)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("Anvil "), version.stdout
    helped = run_command([inv_bin, "--help"], repo)
    assert helped.returncode == 0, helped.stderr
    assert "-H STRING, --hosts=STRING" in helped.stdout      # Fabric's host flags are there
    assert "--identity" in helped.stdout


def test_inv_list_shows_every_collection_without_torch(inv_bin, repo):
    # -X importtime lists every module the installed script imports.
    listed = run_command([repo / ".venv/bin/python", "-X", "importtime", inv_bin, "--list", "--list-format", "json"],
                 repo)
    assert listed.returncode == 0, listed.stderr[-2000:]
    names = {c["name"] for c in json.loads(listed.stdout)["collections"]}
    assert set(COLLECTIONS) <= names
    imported = {line.split("|")[-1].strip() for line in listed.stderr.splitlines() if "|" in line}
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, "inv --list imported torch"


def test_completion(inv_bin, repo):
    script = run_command([inv_bin, "--print-completion-script", "bash"], repo)
    assert script.returncode == 0, script.stderr
    assert "complete -F" in script.stdout and "inv --complete" in script.stdout
    candidates = run_command([inv_bin, "--complete", "--", "inv", "env."], repo)
    assert candidates.returncode == 0, candidates.stderr
    assert {"env.detect", "env.show", "env.explain"} <= set(candidates.stdout.split())
    options = run_command([inv_bin, "--complete", "--", "inv", "env.show", "--"], repo)
    assert "--gpu" in options.stdout.split()


# ---- bootstrap -------------------------------------------------------------------------------

def test_bootstrap_rerun_is_a_no_op(repo):
    stamp = repo / ".venv" / ".anvil-bootstrap.json"
    if not stamp.exists():
        # A .venv made by hand: a rerun would install into it, not check it.
        pytest.skip(".venv was not made by ./bootstrap")
    before = stamp.read_bytes()
    again = run_command([repo / "bootstrap"], repo, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "up to date" in again.stdout
    assert "source .venv/bin/activate" in again.stdout
    assert stamp.read_bytes() == before          # nothing installed again


def test_bootstrap_bad_input_is_one_clear_message(repo):
    bad_python = run_command([repo / "bootstrap"], repo, env={"ANVIL_PYTHON": "/nonexistent/python3"})
    assert bad_python.returncode == 1
    assert "cannot run Python '/nonexistent/python3'" in bad_python.stderr
    assert "Traceback" not in bad_python.stderr + bad_python.stdout
    bad_option = run_command([repo / "bootstrap", "--frobnicate"], repo)
    assert bad_option.returncode == 2
    assert "unknown option(s): --frobnicate" in bad_option.stderr


def _hugging_faces_kernels(python) -> str:
    """Where .venv's Hugging Face `kernels` package is; skipped (failed in CI) where it is not installed."""
    where = run_command([python, "-c", "import importlib.metadata as m; print(m.distribution('kernels').locate_file(''))"],
                "/").stdout.strip()
    if not where:
        if os.environ.get("CI"):
            pytest.fail("the test extra (transformers 5.25+) should have installed Hugging Face's kernels")
        pytest.skip("Hugging Face's kernels is not installed (transformers below 5.25)")
    return where


def test_both_kernels_packages_work_in_one_environment(repo, inv_bin, tmp_path):
    """Hugging Face's `kernels` (transformers 5.25+ requires it) and Anvil's kernels/ share an import name.
    In one environment: `inv train.pretrain --kernels`, run from another folder, patches in Anvil's; a
    transformers program outside the checkout imports Hugging Face's own; and in one process that
    imported Anvil's, transformers builds and runs a model with Hugging Face's names at hand. The
    rerun of ./bootstrap leaves the package it did not install in place."""
    python = repo / ".venv/bin/python"
    where = _hugging_faces_kernels(python)

    trained = run_command([inv_bin, "-r", repo, "train.pretrain", "--kernels", "--set", "data.path=synthetic",
                   *(f"--set={k}" for k in ("train.steps=1", "data.seq_len=16", "data.batch_size=1",
                                            "model.n_layers=1", "train.val_interval=0", "checkpoint.interval=0"))],
                  tmp_path, timeout=600,
                  env={"INVOKE_ANVIL_RUNS_DIR": str(tmp_path / "runs"), "TRITON_INTERPRET": "1"})
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "fused kernels" in (run_dir / "logs" / "rank0.log").read_text()

    program = ("import kernels, transformers\n"
               "assert not hasattr(kernels, '__anvil__'), kernels.__file__\n"
               "from kernels import Mode, get_kernel\n"
               "print(kernels.__file__)\n")
    theirs = run_command([python, "-c", program], tmp_path)
    assert theirs.returncode == 0 and theirs.stdout.startswith(where), theirs.stdout + theirs.stderr

    together = ("import torch, kernels\n"
                "assert kernels.__anvil__ and kernels.NAMESAKE_PROBLEM is None, kernels.NAMESAKE_PROBLEM\n"
                "from transformers import LlamaConfig, LlamaForCausalLM\n"
                "from kernels import Mode\n"
                "model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,\n"
                "    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))\n"
                "kernels.patch(model)\n"
                "print(tuple(model(torch.randint(0, 64, (1, 8))).logits.shape))\n")
    both = run_command([python, "-c", together], repo, env={"TRITON_INTERPRET": "1"}, timeout=300)
    assert both.returncode == 0 and both.stdout.strip().endswith("(1, 8, 64)"), both.stdout + both.stderr[-3000:]

    if (repo / ".venv" / ".anvil-bootstrap.json").exists():
        again = run_command([repo / "bootstrap"], repo, timeout=120)
        assert again.returncode == 0, again.stdout + again.stderr
        assert _hugging_faces_kernels(python) == where and os.path.isdir(where)
