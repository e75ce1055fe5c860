"""Secret masking (core/secrets.py) and the end-to-end promise: no secret under runs/; the masker is linear
at megabytes of text made to make it stall, and masks them all the same."""
from __future__ import annotations

import subprocess
import sys

import pytest

from core.secrets import MASK, Masker, is_secret_env_name, is_secret_key
from helpers.program import REPO, explain
from helpers.project import in_project

# Text a masker that retried a pattern at every position would take hours over, by what it is made of.
MEGABYTES = {"long word": lambda: "a" * 10_000_000, "long url": lambda: "https://" + "a" * 10_000_000,
             "many schemes": lambda: ("x://" + "b" * 100) * 100_000,
             "long password": lambda: "postgres://u:" + "p" * 10_000_000}
# A fresh interpreter masks in.txt with two secrets (one long, one short: masked as a word of its own),
# writes out.txt and prints the same.
MASK_A_FILE = """import sys
from pathlib import Path
from core.secrets import Masker
folder = Path(sys.argv[1])
out = Masker(["supersecretvalue", "pw1"]).text((folder / "in.txt").read_text())
(folder / "out.txt").write_text(out)
sys.stdout.write(out)
"""


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "PGPASSWORD",
                                  "DATABASE_URL", "SENTRY_DSN", "GITHUB_AUTH", "my_cookie", "SSH_PRIVATE",
                                  "NCCL_SECRET_TOKEN", "SLURM_JOB_PASSWORD"])
def test_secret_env_names(name):
    assert is_secret_env_name(name)


@pytest.mark.parametrize("name", ["NCCL_IB_HCA", "NCCL_IB_PKEY", "HSA_FORCE_FINE_GRAIN_PCIE", "RCCL_MSCCL_ENABLE",
                                  "CUDA_VISIBLE_DEVICES", "TOKENIZERS_PARALLELISM", "MASTER_ADDR", "PATH",
                                  "TORCH_NCCL_ASYNC_ERROR_HANDLING", "MIOPEN_USER_DB_PATH", "ANVIL_GPU_PEAK_TFLOPS"])
def test_harmless_env_names(name):
    assert not is_secret_env_name(name)


def test_config_keys_match_by_word():
    for key in ("hf_token", "api_key", "apiKey", "password", "db.password", "authToken", "secret"):
        assert is_secret_key(key), key
    for key in ("tokenizer", "max_tokens", "keep_last", "monkey_patch", "seq_len", "lr"):
        assert not is_secret_key(key), key


def test_masker_covers_env_configs_argv_urls_and_literals():
    masker = Masker.from_environ({"HF_TOKEN": "hf_abcdefSECRET", "NCCL_IB_HCA": "mlx5_0"})
    assert masker.env({"HF_TOKEN": "x", "NCCL_IB_HCA": "mlx5_0"}) == {"HF_TOKEN": MASK, "NCCL_IB_HCA": "mlx5_0"}
    config = masker.mapping({"data": {"tokenizer": "byte", "hf_token": "t0k3n-value"},
                             "notes": ["see hf_abcdefSECRET"], "lr": 3e-4})
    assert config == {"data": {"tokenizer": "byte", "hf_token": MASK}, "notes": [f"see {MASK}"], "lr": 3e-4}
    argv = masker.argv(["inv", "x", "--token=abc123456", "--api-key", "k-999999", "--no-auth", "--name", "n",
                        "HF_TOKEN=zzzzzzzz", "optim.lr=3e-4", "data.tokenizer=byte", "--env", "WANDB_API_KEY=w"])
    assert argv == ["inv", "x", f"--token={MASK}", "--api-key", MASK, "--no-auth", "--name", "n",
                    f"HF_TOKEN={MASK}", "optim.lr=3e-4", "data.tokenizer=byte", "--env", f"WANDB_API_KEY={MASK}"]
    assert masker.text("pip: git+https://bob:hunter2@git.example.com/x.git") == \
        f"pip: git+https://bob:{MASK}@git.example.com/x.git"
    assert masker.text("echo hf_abcdefSECRET now") == f"echo {MASK} now"
    # Boring or one- and two-character values are never replaced (they would mangle every "1" in a
    # file); a short secret of three to five characters is, where it stands as a word of its own.
    masker.add_values(["1", "true", "abc"])
    assert masker.text("1 true abc abcd xabc") == f"1 true {MASK} abcd xabc"


@pytest.mark.parametrize("payload", MEGABYTES.values(), ids=list(MEGABYTES))
def test_the_masker_reads_megabytes_in_one_pass(tmp_path, payload):
    """Within the timeout (a quadratic masker would take hours), and with the secrets around the megabytes
    masked in what it prints and in the file it writes, the rest unchanged."""
    text = payload()
    (tmp_path / "in.txt").write_text(f"supersecretvalue {text} pw1")
    done = subprocess.run([sys.executable, "-c", MASK_A_FILE, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    expected = f"{MASK} {text} {MASK}"
    for where, masked in (("printed", done.stdout), ("written", (tmp_path / "out.txt").read_text())):
        assert "supersecretvalue" not in masked and "pw1" not in masked, where
        assert masked.startswith(f"{MASK} ") and masked.endswith(f" {MASK}") and masked.count(MASK) == 2, where
        unchanged = masked == expected     # (a plain assert ==: pytest would diff 10 MB strings for minutes)
        assert unchanged, f"{where}: {len(masked):,} characters, not the {len(expected):,} of the text masked"


def test_the_masker_still_masks_what_it_did_and_short_secrets_as_words():
    masker = Masker(["supersecretvalue", "pw1", "true"])
    text = "url https://user:hunter2@host/x pw=pw1, pw1x and xpw1 stay; supersecretvalue; true stays"
    assert masker.text(text) == (f"url https://user:{MASK}@host/x pw={MASK}, pw1x and xpw1 stay; {MASK}; "
                                 f"true stays")

def test_hf_token_leaves_no_trace_under_runs(project):
    """HF_TOKEN=secret: env, command line, config, logs, hook output, result: none keep it."""
    hook = project / "hooks" / "demo" / "hello" / "pre"
    hook.mkdir(parents=True)
    (hook / "10_echo.sh").write_text('echo "hook sees $HF_TOKEN"\necho HOOKED=$HF_TOKEN\n')
    (hook / "20_py.py").write_text("def hook(ctx):\n    print('python hook sees', ctx.env['HF_TOKEN'])\n")
    secret = "secret"
    config = project / "cfg.yaml"
    config.write_text(f"say: {secret}\nwandb_key: w-k-98765\nnote: token is {secret}\n")
    env = {"HF_TOKEN": secret, "WANDB_API_KEY": "w-k-98765", "HTTPS_PROXY": "http://proxyuser:pw4321@proxy:3128"}
    result = in_project(project, "demo.hello", "--config", str(config), "--say", secret, "--env",
                        f"EXTRA_TOKEN={secret}", env=env)
    assert result.returncode == 0, explain(result)
    for leaked in (secret, "w-k-98765", "pw4321"):
        grep = subprocess.run(["grep", "-rl", "-e", leaked, str(project / "runs")], capture_output=True, text=True)
        assert grep.stdout == "", f"{leaked!r} found in: {grep.stdout}"
    assert secret not in result.stderr                  # console log lines are masked too
    run_dir = next((project / "runs").iterdir())
    assert "hook sees <masked>" in (run_dir / "hooks" / "pre.log").read_text()
    assert "child saw <masked>" in (run_dir / "logs" / "child.txt").read_text()
    assert "saying <masked> with token <masked>" in (run_dir / "logs" / "runner.log").read_text()
