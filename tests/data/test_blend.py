"""Blends of prepared datasets (data.blend): Megatron's greedy rule, deterministic and proportional;
BlendLoader's batches, per-source epochs, exact resume on the same and another world size; config
errors as one line; per-source and mixed validation, token shares and dataset.json in a real run;
`inv data.inspect --config` of a blend."""
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import DEFAULT_CONFIG, ConfigError, load
from trainer.data import BlendLoader, DataError, TokenLoader, prepare
from trainer.data import blend as blend_mod
from trainer.data.blend import assign, blend_counts, shares

from helpers.corpus import STDLIB, take
from helpers.program import ONE_THREAD, inv, sets

SEQ = 32


def stdlib_files(start: int, stop: int) -> list[Path]:
    return sorted(STDLIB.glob("*.py"))[start:stop]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Three byte-tokenized datasets of different sizes (big, mid, small) and one with its own BPE."""
    root = tmp_path_factory.mktemp("blend")
    out = {}
    for name, (start, stop) in {"big": (0, 24), "mid": (24, 32), "small": (32, 35)}.items():
        prepare(stdlib_files(start, stop), root / name, val_fraction=0.2, workers=1, progress=False)
        out[name] = root / name
    prepare(stdlib_files(35, 40), root / "bpe", tokenizer="bpe", vocab_size=300, workers=1, progress=False)
    out["bpe"] = root / "bpe"
    return out


def blend(datasets, names=("big", "small"), weights=(0.7, 0.3), **kwargs) -> BlendLoader:
    sources = [(name, datasets[name], weight) for name, weight in zip(names, weights)]
    kwargs = {"split": "train", "seq_len": SEQ, "batch_size": 4, "rank": 0, "world_size": 1, "seed": 3} | kwargs
    return BlendLoader(sources, **kwargs)


# ---- the rule ----------------------------------------------------------------------------------

def test_each_sample_goes_to_the_source_with_the_largest_deficit():
    """Megatron's rule, as its helpers.cpp states it: argmax of weight*(i+1) - count, ties to the first."""
    weights = shares([5, 3, 2])
    picked, counts = assign(weights, [0, 0, 0], 0, 1000)
    expected, seen = [], np.zeros(3)
    for i in range(1000):
        s = int(np.argmax(np.array(weights) * (i + 1) - seen))
        expected.append(s)
        seen[s] += 1
    assert picked.tolist() == expected and counts == seen.astype(int).tolist()
    assert assign(shares([1, 1]), [0, 0], 0, 4)[0].tolist() == [0, 1, 0, 1]   # a tie: the first source


@pytest.mark.parametrize("k, within", [(2, 0.5), (3, 1.0)])
def test_realised_counts_stay_within_a_sample_of_the_weights(k, within):
    rng = random.Random(k)
    for _ in range(40):
        raw = [rng.random() ** 3 + 1e-3 for _ in range(k)]
        weights = shares(raw)
        picked, _ = assign(weights, [0] * k, 0, 3000)
        counts = np.cumsum(np.eye(k, dtype=np.int64)[picked], axis=0)   # counts after each sample
        ideal = np.outer(np.arange(1, 3001), weights)
        assert np.abs(counts - ideal).max() <= within + 1e-9, raw


def test_the_rule_continues_from_any_point_as_if_never_stopped():
    weights = shares([0.2, 0.5, 0.3])
    whole, _ = assign(weights, [0, 0, 0], 0, 500)
    head, counts = assign(weights, [0, 0, 0], 0, 137)
    tail, _ = assign(weights, counts, 137, 363)
    assert np.array_equal(np.concatenate([head, tail]), whole)


def test_blend_counts_are_exact_up_to_a_limit_then_rounded(monkeypatch):
    exact, is_exact = blend_counts([3, 1, 1], 1001)
    assert is_exact and exact == assign(shares([3, 1, 1]), [0, 0, 0], 0, 1001)[1] and sum(exact) == 1001
    monkeypatch.setattr(blend_mod, "EXACT_SAMPLES", 1000)
    rounded, is_exact = blend_counts([3, 1, 1], 1001)
    assert not is_exact and sum(rounded) == 1001
    assert all(abs(a - b) <= 1 for a, b in zip(rounded, exact))
    with pytest.raises(DataError, match="positive weights"):
        shares([1, 0])


# ---- BlendLoader ---------------------------------------------------------------------------------

def test_batches_are_the_picked_sources_windows(datasets):
    loader = blend(datasets, names=("big", "mid", "small"), weights=(5, 3, 2), batch_size=6)
    alone = {name: TokenLoader(datasets[name], "train", SEQ, 1, 0, 1, seed=3) for name in ("big", "mid", "small")}
    picked, _ = assign(shares([5, 3, 2]), [0, 0, 0], 0, 60)
    seen = {name: 0 for name in alone}
    for step in range(10):
        x, y = next(loader)
        assert x.shape == y.shape == (6, SEQ) and torch.equal(x[:, 1:], y[:, :-1])
        for row, s in enumerate(picked[step * 6:(step + 1) * 6]):
            name = ("big", "mid", "small")[s]
            want = torch.from_numpy(alone[name].rows(np.array([seen[name]])))[0]   # its own k-th sample
            seen[name] += 1
            assert torch.equal(x[row], want[:-1]) and torch.equal(y[row], want[1:])
    assert loader.tokens_by_source() == {name: n * SEQ for name, n in seen.items()}
    assert sum(loader.tokens_by_source().values()) == 60 * SEQ


def test_a_small_source_with_a_large_weight_repeats_in_a_new_order_each_epoch(datasets):
    loader = blend(datasets, weights=(0.5, 0.5), batch_size=8)
    small = loader.sources[1]
    steps = 2 * small.windows // 4 + 2   # about two epochs of the small source (it gets half of 8 per step)
    take(loader, steps)
    summary = loader.source_summary()
    assert summary["small"]["epochs"] > 2 > 1 > summary["big"]["epochs"]
    assert summary["small"]["token_share"] == pytest.approx(0.5) and summary["small"]["weight"] == 0.5
    n = small.windows
    first, second = small.window_ids(np.arange(n)), small.window_ids(np.arange(n, 2 * n))
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(n))   # every window once per epoch
    assert not np.array_equal(first, second)


def test_deterministic_and_ranks_split_the_global_batch(datasets):
    a = take(blend(datasets, batch_size=6), 5)
    b = take(blend(datasets, batch_size=6), 5)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    other_seed = take(blend(datasets, batch_size=6, seed=4), 5)
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, other_seed))
    ranks = [take(blend(datasets, batch_size=2, rank=r, world_size=3), 5) for r in range(3)]
    for step in range(5):   # 3 ranks x 2 = the same global batch as 1 rank x 6, in rank order
        assert torch.equal(torch.cat([ranks[r][step][0] for r in range(3)]), a[step][0])


def test_exact_resume_on_the_same_world(datasets):
    expected = [take(blend(datasets, batch_size=3, rank=r, world_size=2), 12) for r in range(2)]
    for r in range(2):
        first = blend(datasets, batch_size=3, rank=r, world_size=2)
        take(first, 7)
        state = json.loads(json.dumps(first.state_dict()))   # plain, JSON-able
        assert state["cursor"] == 42 and sum(state["counts"]) == 42
        resumed = blend(datasets, batch_size=3, rank=r, world_size=2)
        resumed.load_state_dict(state)
        for got, want in zip(take(resumed, 5), expected[r][7:]):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    whole = blend(datasets, batch_size=6)
    take(whole, 12)
    assert resumed.tokens_by_source() == whole.tokens_by_source() and sum(whole.counts) == 72


def test_resume_on_another_world_size(datasets):
    two = [blend(datasets, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for loader in two:
        take(loader, 5)
    state = json.loads(json.dumps(two[1].state_dict()))   # any rank's: the position is global
    assert state == two[0].state_dict() and state["cursor"] == 20
    following = torch.cat([next(loader)[0] for loader in two])   # step 6 on 2 ranks: samples 20..23
    one = blend(datasets, batch_size=4)
    one.load_state_dict(state)
    assert torch.equal(next(one)[0], following)
    three = [blend(datasets, batch_size=1, rank=r, world_size=3) for r in range(3)]
    for loader in three:
        loader.load_state_dict(state)
    reference = blend(datasets, batch_size=3)
    reference.load_state_dict(state)
    got = [torch.cat([next(loader)[0] for loader in three]) for _ in range(4)]
    assert all(torch.equal(g, next(reference)[0]) for g in got)   # samples 20..31 in the same order
    assert three[0].tokens_by_source() == reference.tokens_by_source()
    assert torch.equal(got[0][:3], following[:3])


def test_resume_refuses_another_blend_or_a_damaged_state(datasets):
    loader = blend(datasets)
    take(loader, 3)
    state = loader.state_dict()
    big = re.escape(f"big (weight 0.7, {loader.sources[0].stream.tokens:,} tokens)")
    with pytest.raises(DataError, match=rf"^cannot resume the blend's position: it was {big}, small \(weight 0.3, "
                                        rf".*\) when saved, it is big \(weight 0.6, .*, small \(weight 0.4, .* now; "
                                        rf"a run resumes on the blend it started with$"):
        blend(datasets, weights=(0.6, 0.4)).load_state_dict(state)
    with pytest.raises(DataError, match=r"it is big \(weight 0.7, .*\), mid \(weight 0.3"):
        blend(datasets, names=("big", "mid")).load_state_dict(state)
    with pytest.raises(DataError, match="'tokens' loader, this one is 'blend'"):
        blend(datasets).load_state_dict(TokenLoader(datasets["big"], "train", SEQ, 4, seed=3).state_dict())
    with pytest.raises(DataError, match="do not add up to its 12 samples"):
        blend(datasets).load_state_dict(state | {"counts": [12, 1]})


def test_sources_must_share_one_tokenizer(datasets):
    with pytest.raises(DataError, match=r"its tokenizer \(bpe, vocab 300, sha256 [0-9a-f]{12}\) is not "
                                        r".*'s \(byte, vocab 259\); the datasets of a blend must share one"):
        blend(datasets, names=("big", "bpe"))


# ---- config ------------------------------------------------------------------------------------

BLEND = "data.blend=[{path: data/web, weight: 0.7}, {path: data/code, weight: 0.3}]"


@pytest.mark.parametrize("sets, message", [
    ([BLEND], "tiny.yaml with --set data.blend=[{path: data/web, weight: 0.7}, {path: data/code, weight: 0.3}]: "
              "data.blend: expected data.path or data.blend, not both (data.path is 'data/stdlib'; "
              "--set data.path=null drops it)"),
    (["data.path=null", "data.blend=[{path: a/web, weight: 1}, {path: b/web, weight: 2}]"],
     "data.blend[1].name: expected a name unlike data.blend[0]'s, got 'web'; set data.blend[1].name"),
    (["data.path=null", "data.blend=[{path: a/web, weight: 1}, {path: a/web/, weight: 2, name: x}]"],
     "data.blend[1].path: 'a/web/' is already data.blend[0]; a dataset appears once in a blend"),
    (["data.path=null", "data.blend=[{path: a/web}]"], "data.blend[0].weight: expected a positive number"),
    (["data.path=null", "data.blend=[{path: a/web, weight: -1}]"], "data.blend[0].weight: expected a positive"),
    (["data.path=null", "data.blend=[{path: a/web, weight: .inf}]"], "data.blend[0].weight: expected a finite"),
    (["data.path=null", "data.blend=[{path: 'my data', weight: 1}]"],
     "data.blend[0].name: expected a name of letters, digits, '_', '.' and '-' (default: the folder's name), "
     "got 'my data'"),
    (["data.path=null", "data.blend=[{path: synthetic, weight: 1}]"], "synthetic tokens cannot be blended"),
    (["data.path=null", "data.blend=[{path: '', weight: 1}]"], "data.blend[0].path: expected a prepared dataset"),
    (["data.path=null", "data.blend=[{path: a/web, weight: 1, wieght: 2}]"], "unknown key 'data.blend[0].wieght'"),
    (["data.path=null", "data.blend={path: a/web}"], "data.blend: expected a list, each a mapping with keys path, "
                                                     "weight, name"),
])
def test_blend_config_errors_are_one_line(sets, message):
    with pytest.raises(ConfigError) as err:
        load(None, sets)
    text = str(err.value)
    assert message in text and "\n" not in text and text.startswith(str(DEFAULT_CONFIG)), text
    assert "--set data." in text   # the --set that brought the value is named, not just the file


def test_blend_config_in_a_file(tmp_path):
    from trainer.config import dump
    path = tmp_path / "mix.yaml"
    path.write_text("data:\n  blend:\n    - {path: data/web, weight: 7}\n    - {path: data/code, weight: 3, "
                    "name: py}\n")
    cfg = load(path)
    assert cfg.data.path is None and [(s.name, s.weight) for s in cfg.data.blend] == [("web", 7.0), ("py", 3.0)]
    assert cfg.data.datasets() == ["data/web", "data/code"]
    again = tmp_path / "again.yaml"
    again.write_text(dump(cfg))
    assert load(again) == cfg   # the run's config.yaml reads back
    path.write_text("data:\n  path: data/stdlib\n  blend:\n    - {path: data/web, weight: 7}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: data.blend: expected data.path or data.blend, not both"):
        load(path)
    assert load(None).data.path == "data/stdlib"   # data.path=null alone: tests/data/test_hostile_corpus_config.py


# ---- a real run -----------------------------------------------------------------------------------

def blend_sets(datasets, big=0.7, small=0.3):
    return ["data.path=null", f"data.blend=[{{path: {datasets['big']}, weight: {big}}}, "
                              f"{{path: {datasets['small']}, weight: {small}, name: tiny_src}}]"]


def test_training_on_a_blend_logs_each_source_and_the_mix(tmp_path, datasets):
    from trainer import train
    torch.set_num_threads(1)
    cfg = load(DEFAULT_CONFIG, [*blend_sets(datasets), "data.seq_len=32", "data.batch_size=4", "train.steps=10",
                                "train.log_interval=5", "train.val_interval=5", "train.val_batches=2",
                                "checkpoint.interval=0", "checkpoint.save_final=false", "logging.progress=false",
                                "schedule.warmup_steps=2"])
    assert train.run(cfg, tmp_path / "run") == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in lines if r["kind"] == "val"]
    assert [v["step"] for v in vals] == [5, 10]
    for v in vals:
        assert v["val_loss"] == pytest.approx(0.7 * v["val_loss/big"] + 0.3 * v["val_loss/tiny_src"], rel=1e-12)
        assert v["val_loss/big"] != v["val_loss/tiny_src"]
    trains = [r for r in lines if r["kind"] == "train"]
    expected = assign(shares([0.7, 0.3]), [0, 0], 0, 40)[1]   # 10 steps x 4 samples
    assert trains[-1]["tokens/big"] == expected[0] * 32 and trains[-1]["tokens/tiny_src"] == expected[1] * 32
    assert trains[-1]["tokens/big"] + trains[-1]["tokens/tiny_src"] == trains[-1]["tokens"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_loss"] == vals[-1]["val_loss"] and summary["data"].startswith("blend of big 70.0%")
    assert summary["sources"]["tiny_src"]["token_share"] == expected[1] / 40
    assert summary["sources"]["tiny_src"]["val_loss"] == vals[-1]["val_loss/tiny_src"]
    assert summary["sources"]["big"]["weight"] == pytest.approx(0.7)
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert f"val_loss {vals[-1]['val_loss']:.4f} (mixed; big {vals[-1]['val_loss/big']:.4f}, tiny_src" in log
    assert "of the tokens (weight 30.0%)" in log   # the summary table's row per source


def test_check_data_refuses_a_missing_source_or_another_tokenizer(tmp_path, datasets):
    from trainer.data.check import check_data
    cfg = load(DEFAULT_CONFIG, ["data.path=null", f"data.blend=[{{path: {datasets['big']}, weight: 1}}, "
                                                  f"{{path: {tmp_path / 'none'}, weight: 1}}]"])
    with pytest.raises(DataError, match=r"^data.blend\[1\].path '.*none': no prepared dataset there"):
        check_data(cfg)
    cfg = load(DEFAULT_CONFIG, ["data.path=null", f"data.blend=[{{path: {datasets['big']}, weight: 1}}, "
                                                  f"{{path: {datasets['bpe']}, weight: 1}}]"])
    with pytest.raises(DataError, match=r"^data.blend\[1\].path '.*bpe': its tokenizer \(bpe, vocab 300"):
        check_data(cfg)


def test_inv_train_pretrain_on_a_blend_records_every_source(tmp_path, datasets):
    """Through the installed inv: dataset.json lists each source's manifest fingerprint; a missing
    source is one line before any run directory exists."""
    import hashlib
    run_sets = [*blend_sets(datasets), "data.seq_len=32", "data.batch_size=4", "train.steps=3",
                "train.val_batches=1", "checkpoint.interval=0", "logging.progress=false",
                "logging.tensorboard=false", "logging.gpu_stats=false"]

    def pretrain(*more):
        return inv(tmp_path, "train.pretrain", *sets(*run_sets, *more), env=ONE_THREAD)

    proc = pretrain()
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    recorded = json.loads((run / "dataset.json").read_text())
    assert [s["name"] for s in recorded["blend"]] == ["big", "tiny_src"]
    for source, name in zip(recorded["blend"], ("big", "small")):
        manifest = (datasets[name] / "manifest.json").read_bytes()
        assert source["manifest_sha256"] == hashlib.sha256(manifest).hexdigest()
        assert source["path"] == str(datasets[name]) and source["tokens"] == json.loads(manifest)["tokens"]
    assert [s["share"] for s in recorded["blend"]] == pytest.approx([0.7, 0.3])
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["sources"]) == {"big", "tiny_src"}

    missing = pretrain(f"data.blend=[{{path: {datasets['big']}, weight: 1}}, {{path: {tmp_path}/gone, weight: 1}}]")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-3000:]
    (line,) = [ln for ln in missing.stderr.splitlines() if "gone" in ln]
    assert f"data.blend[1].path '{tmp_path}/gone': no prepared dataset there" in line
    assert list((tmp_path / "runs").iterdir()) == [run]


def test_inv_data_inspect_shows_a_blends_shares_and_repeats(tmp_path, datasets):
    config = tmp_path / "mix.yaml"
    config.write_text(f"data:\n  seq_len: 64\n  batch_size: 8\n  blend:\n"
                      f"    - {{path: {datasets['big']}, weight: 3}}\n"
                      f"    - {{path: {datasets['small']}, weight: 1, name: few}}\ntrain:\n  steps: 200\n")

    def inspect(*args):
        proc = inv(tmp_path, "data.inspect", "--config", config, *args)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    report = json.loads(inspect("--world", "2", "--json"))
    assert report["samples"] == 200 * 8 * 2 and report["steps"] == 200 and report["exact"]
    big, few = report["sources"]
    assert (big["samples"], few["samples"]) == (2400, 800) and few["realised_share"] == 0.25
    assert few["epochs"] == few["samples"] / few["windows"] > 1 and big["epochs"] == 2400 / big["windows"]
    text = inspect("--world", "2")
    assert "3,200 samples of 64+1" in text and "25.00%" in text
    assert f"note: few repeats, {few['epochs']:.2f} epochs of its {few['windows']:,} windows: its share of the " \
           f"run (25.0%) is larger than its share of the data" in text
    both = inv(tmp_path, "data.inspect", "--config", config, "--path", datasets["big"])
    assert both.returncode == 2 and both.stderr.strip().endswith("give one (--config reads data.path or "
                                                                 "data.blend from the training config)")
