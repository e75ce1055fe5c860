"""--tune-gemm: TunableOp's environment as a layer (its results file in a cache keyed by GPU model, torch and CUDA/ROCm
build), env.explain showing it, the run recording which file it used (and keeping a copy), and a replay reading the
same file."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import envs
from envs import computed
from helpers.program import anvil_context, run_inv
from runtime.jobs import tuning
from runtime.runs.run import RunSpec, execute


def fake_torch(tmp_path, version="2.11.0+cu130", cuda="'13.0'", hip="None"):
    pkg = tmp_path / "torch"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text(f"from typing import Optional\n__version__ = '{version}'\ndebug = False\n"
                                    f"cuda: Optional[str] = {cuda}\nhip: Optional[str] = {hip}\n")
    return lambda name: SimpleNamespace(origin=str(pkg / "__init__.py"))


def test_the_cache_key_is_gpu_model_torch_and_its_cuda_or_rocm(tmp_path):
    cuda = computed.torch_build(fake_torch(tmp_path))
    assert cuda == {"version": "2.11.0+cu130", "cuda": "13.0"}
    h200 = envs.detect("H200")
    assert computed.tunableop_key(h200, cuda) == "H200-torch2.11.0+cu130-cuda13.0"
    rocm = computed.torch_build(fake_torch(tmp_path, "2.11.0+rocm7.1", "None", "'7.1.25424-4179531dcd'"))
    assert computed.tunableop_key(envs.detect("MI300X"), rocm) == "MI300X-torch2.11.0+rocm7.1-rocm7.1.25424-4179531dcd"
    cpu = envs.Machine(vendor="cpu", model=None, name="no GPU", arch=None, count=0, memory_gib=None)
    assert computed.tunableop_key(cpu, cuda) is None          # no GPU, nothing to tune
    assert computed.torch_build(lambda name: None) == {}


def test_tune_gemm_adds_the_tuning_layer_with_its_file_in_the_keyed_cache(tmp_path):
    context = {"environ": {"ANVIL_CACHE_DIR": str(tmp_path / "cache")}}
    tuned = envs.resolve(gpu="H200", tune_gemm=True, context=context)
    assert "tuning:tunableop" in tuned.layers
    filename = tuned.vars["PYTORCH_TUNABLEOP_FILENAME"]
    key = computed.tunableop_key(tuned.machine, computed.torch_build())
    assert filename.value == str(tmp_path / "cache" / "tunableop" / key / "tunableop_results%d.csv")
    assert filename.source == "tuning:tunableop" and key in filename.reason
    assert tuned.environ()["PYTORCH_TUNABLEOP_ENABLED"] == "1" and tuned.environ()["PYTORCH_TUNABLEOP_TUNING"] == "1"
    plain = envs.resolve(gpu="H200", context=context)
    assert not any(name.startswith("PYTORCH_TUNABLEOP") for name in plain.vars)
    # a later layer wins as anywhere: read the file, tune nothing new
    frozen = envs.resolve(gpu="H200", tune_gemm=True, context=context, overrides=["PYTORCH_TUNABLEOP_TUNING=0"])
    assert frozen.vars["PYTORCH_TUNABLEOP_TUNING"].value == "0"
    home = envs.resolve(gpu="H200", tune_gemm=True, context={"environ": {"HOME": str(tmp_path)}})
    assert home.vars["PYTORCH_TUNABLEOP_FILENAME"].value.startswith(str(tmp_path / ".cache" / "anvil" / "tunableop"))


def test_env_explain_shows_the_results_file_and_says_where_it_comes_from(tmp_path):
    env = {"ANVIL_CACHE_DIR": str(tmp_path)}
    proc = run_inv("env.explain", "pytorch_tunableop_filename", "--gpu", "H200", "--tune-gemm", env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"PYTORCH_TUNABLEOP_FILENAME={tmp_path}/tunableop/H200-torch" in proc.stdout
    assert "tuning:tunableop" in proc.stdout and "reused by every later run with the same key" in proc.stdout
    without = run_inv("env.explain", "PYTORCH_TUNABLEOP_FILENAME", "--gpu", "H200", env=env)
    assert without.returncode == 2 and "see it with --tune-gemm" in without.stderr


RESULTS = ("Validator,PT_VERSION,2.11.0\nValidator,CUDA_VERSION,13.0\n"
           "GemmTunableOp_BFloat16_TN,tn_2048_16384_2048_ld_2048_2048_2048,Gemm_Cublaslt_17,0.201\n"
           "GemmTunableOp_BFloat16_NN,nn_2048_16384_8192_ld_2048_8192_2048,Default,0.512\n")


def _kept(run):
    with tuning.kept(run):
        pass
    return run.path


def _ctx(tmp_path):
    return anvil_context(tmp_path / "runs", hooks_dir=tmp_path / "no-hooks")


def test_a_run_records_the_results_file_it_used_and_keeps_a_copy(tmp_path):
    pattern = str(tmp_path / "cache" / "tunableop" / "H200-key" / "tunableop_results%d.csv")
    env = {"PYTORCH_TUNABLEOP_ENABLED": "1", "PYTORCH_TUNABLEOP_FILENAME": pattern}

    def body(run):
        # what TunableOp does at the process's exit: one file per device ordinal
        code = "import os, sys; p = os.environ['PYTORCH_TUNABLEOP_FILENAME'].replace('%d', '0'); " \
               "os.makedirs(os.path.dirname(p), exist_ok=True); open(p, 'w').write(sys.argv[1])"
        with tuning.kept(run):
            subprocess.run([sys.executable, "-c", code, RESULTS], env=run.env, check=True)
        return run.path

    run = execute(_ctx(tmp_path), RunSpec(task="demo.tune", env=env, hooks=False), body)
    record = json.loads((run / "metadata.json").read_text())["tunableop"]
    assert record["file"] == pattern and record["cache"] == "H200-key"
    assert record["before"] == {} and record["after"]["tunableop_results0.csv"]["gemms"] == 2
    assert record["after"]["tunableop_results0.csv"]["not_default"] == 1
    assert (run / "tunableop" / "tunableop_results0.csv").read_text() == RESULTS
    env_json = json.loads((run / "env.json").read_text())["vars"]
    assert env_json["PYTORCH_TUNABLEOP_FILENAME"]["value"] == pattern


def test_a_replay_reads_the_same_results_file_and_restores_it_when_the_cache_lost_it(tmp_path, monkeypatch):
    pattern = str(tmp_path / "cache" / "tunableop_results%d.csv")
    env = {"PYTORCH_TUNABLEOP_ENABLED": "1", "PYTORCH_TUNABLEOP_FILENAME": pattern}
    cached = Path(pattern.replace("%d", "0"))
    cached.parent.mkdir(parents=True)
    cached.write_text(RESULTS)
    first = execute(_ctx(tmp_path), RunSpec(task="demo.tune", env=env, hooks=False), _kept)
    cached.unlink()        # the cache was cleared since (or the replay runs where it never was)
    seen = {}

    def body(run):
        with tuning.kept(run):
            seen["file"] = run.env["PYTORCH_TUNABLEOP_FILENAME"]
            seen["content"] = cached.read_text()
        return run.path

    monkeypatch.setenv("ANVIL_REPLAY_OF", str(first))
    replay = execute(_ctx(tmp_path), RunSpec(task="demo.tune", env={"PYTORCH_TUNABLEOP_ENABLED": "1",
                                                                    "PYTORCH_TUNABLEOP_FILENAME": "elsewhere%d.csv"},
                                             hooks=False), body)
    assert seen == {"file": pattern, "content": RESULTS}       # the recorded file, put back from the run's copy
    record = json.loads((replay / "metadata.json").read_text())["tunableop"]
    assert record["restored_from_replayed_run"] == ["tunableop_results0.csv"]
    assert record["before"]["tunableop_results0.csv"]["gemms"] == 2


def test_without_tunableop_nothing_is_recorded(tmp_path):
    run = execute(_ctx(tmp_path), RunSpec(task="demo.plain", env={}, hooks=False), _kept)
    assert "tunableop" not in json.loads((run / "metadata.json").read_text())


@pytest.mark.slow
def test_train_pretrain_tune_gemm_records_the_file_and_its_replay_uses_it(tmp_path, dataset):
    env = {"ANVIL_CACHE_DIR": str(tmp_path / "cache")}
    args = ["train.pretrain", "--tune-gemm", "--gpu", "H200", "--nproc", "2", "--set", f"data.path={dataset}", "--set",
            "data.seq_len=32", "--set", "model.n_layers=1", "--set", "train.steps=2", "--set", "train.val_interval=0",
            "--set", "checkpoint.save_final=false", "--env", "OMP_NUM_THREADS=1"]
    proc = run_inv(*args, runs=tmp_path / "runs", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    record = json.loads((run / "metadata.json").read_text())["tunableop"]
    assert record["file"].startswith(str(tmp_path / "cache" / "tunableop" / "H200-torch"))
    replay = run_inv("snapshot.replay", run, runs=tmp_path / "runs", env=env)
    assert replay.returncode == 0, replay.stderr[-3000:]
    (second,) = [p for p in (tmp_path / "runs").iterdir() if p != run]
    again = json.loads((second / "env.json").read_text())["vars"]["PYTORCH_TUNABLEOP_FILENAME"]
    assert again["value"] == record["file"] and again["source"].startswith("replay:")
