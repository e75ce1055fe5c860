"""Attention inside documents (data.document_mask), fp32 on the CPU: a packed row gives each document's
logits as that document alone does, in every family's attention; no token's loss changes when another
document of its row does; FlexAttention's block mask and SDPA's boolean mask agree; documents are cut
where the dataset says; training runs with it on."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from core.errors import UserError
from helpers.program import inv, one_line_error
from helpers.training import TINY_RUN
from runtime.jobs import training
from trainer import train as train_module
from trainer.config import DEFAULT_CONFIG, ConfigError, MLAConfig, ModelConfig, MoEConfig, load
from trainer.data import SyntheticLoader
from trainer.models import Transformer
from trainer.models.masking import SequenceLayout, attend
from trainer.sequence import Rows, document_ids, restarting_positions

BOS, EOS, VOCAB = 1, 2, 64
TOL = dict(atol=2e-5, rtol=1e-4)   # fp32; only the order of sums differs
MOE = MoEConfig(n_routed_experts=4, top_k=2, ffn_dim=32)
FAMILIES = {
    "llama": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=VOCAB),
    "qwen3_moe": ModelConfig(family="qwen3_moe", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                             vocab_size=VOCAB, head_dim_size=16, moe=MOE),
    "deepseek_v2": ModelConfig(family="deepseek_v2", dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=96,
                               vocab_size=VOCAB, moe=MoEConfig(n_routed_experts=4, top_k=2, ffn_dim=32,
                                                               n_shared_experts=1, first_k_dense=1),
                               mla=MLAConfig(q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
                                             qk_rope_head_dim=8, v_head_dim=16)),
}


def documents(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    """Documents as a dataset stores them: BOS, `length` tokens, EOS."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.cat((torch.tensor([BOS]), torch.randint(3, VOCAB, (n,), generator=gen), torch.tensor([EOS])))
            for n in lengths]


def layout_of(row: torch.Tensor, reset: bool) -> SequenceLayout:
    return Rows((BOS, EOS), reset)(row, row)[2]


@pytest.mark.parametrize("family, reset", [("llama", True), ("llama", False), ("qwen3_moe", True),
                                           ("deepseek_v2", False)])
def test_a_packed_row_gives_each_document_its_own_logits(family, reset):
    torch.manual_seed(0)
    model = Transformer(FAMILIES[family]).eval()
    docs = documents(5, 11, 3, 7)
    row = torch.cat(docs)[None]
    with torch.no_grad():
        packed = model(row, layout=layout_of(row, reset))[0]
        plain = model(row)[0]
        start = 0
        for doc in docs:
            alone = model(doc[None])[0]
            # RoPE sees only distances, so positions that run on across documents change nothing but rounding
            torch.testing.assert_close(packed[start:start + len(doc)], alone, **TOL)
            start += len(doc)
    # without the mask a later document sees the earlier ones: the comparison above can fail
    assert not torch.allclose(plain[len(docs[0]):], packed[len(docs[0]):], **TOL)


def per_token_losses(model, row: torch.Tensor, layout) -> torch.Tensor:
    x, y = row[:, :-1], row[:, 1:]
    with torch.no_grad():
        logits = model(x, layout=layout)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")


def test_no_token_loss_crosses_a_document_boundary():
    """Changing the words of the first document leaves every loss term of the second unchanged, and changing
    the second leaves every term of the first, its EOS predicting the next BOS included."""
    torch.manual_seed(0)
    model = Transformer(FAMILIES["llama"]).eval()
    first, second = documents(9, 12)
    other_first, other_second = documents(9, 12, seed=1)
    row = torch.cat((first, second))[None]
    cut = len(first)           # inputs 0..cut-1 are the first document's (the last, its EOS, predicts BOS)

    def losses(r, masked=True):
        return per_token_losses(model, r, layout_of(r[:, :-1], False) if masked else None)

    base = losses(row)
    new_first = torch.cat((other_first, second))[None]
    new_second = torch.cat((first, other_second))[None]
    torch.testing.assert_close(losses(new_first)[cut:], base[cut:], atol=0, rtol=0)
    torch.testing.assert_close(losses(new_second)[:cut], base[:cut], atol=0, rtol=0)
    assert not torch.equal(losses(new_first)[:cut - 1], base[:cut - 1])   # the changed document's own do change
    # causal over the row, the second document's losses depend on the first
    assert not torch.allclose(losses(new_first, masked=False)[cut:], losses(row, masked=False)[cut:])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")   # (on the CPU, unfused)
def test_flex_block_mask_and_sdpa_mask_agree_with_each_document_alone():
    """The two kernels, forward on the CPU (FlexAttention's backward needs a GPU): the same output as SDPA's
    causal kernel over each document alone, with documents that straddle FlexAttention's 128-token blocks."""
    torch.manual_seed(0)
    T, H, D = 256, 4, 16
    row = torch.cat(documents(39, 100, 7, 60, 40))[None]
    assert row.shape[1] == T
    docs = document_ids(row, BOS, EOS)
    q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
    expected = torch.zeros(1, H, T, D)
    for d in docs.unique():
        at = (docs[0] == d).nonzero().flatten()
        expected[:, :, at] = F.scaled_dot_product_attention(q[:, :, at], k[:, :, at], v[:, :, at], is_causal=True)
    layout = SequenceLayout(T, docs)
    for kernel in ("flex", "sdpa"):
        got = attend(q, k, v, layout.mask(kernel, torch.device("cpu")))
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m, k=kernel: f"{k}: {m}")


@pytest.mark.parametrize("bos, tokens, expected", [
    (BOS, [7, 1, 5, 2, 1, 6, 2, 1], [0, 0, 0, 0, 1, 1, 1, 2]),   # a window that starts inside a document
    (None, [7, 2, 5, 2, 6], [0, 0, 1, 1, 2]),                    # no BOS: after each EOS
    (2, [2, 5, 2, 2, 6, 7, 2], [0, 0, 0, 1, 1, 1, 1]),            # BOS = EOS (GPT-2's <|endoftext|>)
    (BOS, [5, 1, 6, 1, 2], [0, 0, 0, 0, 0]),                      # a BOS id inside a document cuts nothing
])
def test_documents_begin_where_an_eos_is_followed_by_a_bos(bos, tokens, expected):
    ids = document_ids(torch.tensor([tokens]), bos, EOS)
    assert ids.tolist() == [expected]


def test_positions_restart_at_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert restarting_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


def test_rows_of_one_document_take_the_causal_kernel_on_the_cpu_unless_compiled():
    """A batch of whole documents goes through without a layout; in a batch with some cut rows, SDPA runs
    the others on the causal kernel: the same output as the mask over every row."""
    whole = torch.tensor([[7, 5, 6, 2], [1, 5, 6, 7]])        # no EOS then BOS in any row
    assert Rows((BOS, EOS), causal_when_whole=True)(whole, whole)[2] is None
    assert Rows((BOS, EOS))(whole, whole)[2] is not None      # (under torch.compile: one signature)
    torch.manual_seed(0)
    batch = torch.randint(3, VOCAB, (5, 32))
    batch[1, 9:11] = batch[3, 20:22] = torch.tensor([EOS, BOS])
    split = Rows((BOS, EOS), causal_when_whole=True)(batch, batch)[2].mask("sdpa", torch.device("cpu"))
    assert split.cut.tolist() == [1, 3] and split.whole.tolist() == [0, 2, 4]
    q, k, v = (torch.randn(5, 4, 32, 8) for _ in range(3))
    every_row = Rows((BOS, EOS))(batch, batch)[2].mask("sdpa", torch.device("cpu"))
    torch.testing.assert_close(attend(q, k, v, split), attend(q, k, v, every_row), **TOL)


def test_synthetic_rows_hold_documents():
    loader = SyntheticLoader(512, seq_len=256, batch_size=4, documents=True)
    bos, eos = loader.document_tokens()
    x, _ = next(loader)
    begins = ((x[:, :-1] == eos) & (x[:, 1:] == bos)).sum(1)
    assert (begins >= 1).all() and begins.float().mean() > 2          # about seq_len / 4 tokens a document
    words = x[(x != bos) & (x != eos)]
    assert int(words.max()) < bos                                     # the random tokens are never BOS or EOS
    plain = SyntheticLoader(512, seq_len=256, batch_size=4)
    assert plain.state_dict() != loader.state_dict()                  # a run resumes on the stream it had


def test_training_keeps_attention_inside_documents(tmp_path, short_documents):
    """The trainer in one process on documents shorter than a row (the tiny model, 6 steps): with the mask the
    log says so, the loss falls and validation runs; without it the first step's loss is another."""
    def train(name, *extra):
        sets = [f"data.path={short_documents}", "train.steps=6", "train.log_interval=1", "train.val_interval=0",
                *TINY_RUN, "train.val_batches=1", *extra]
        run_dir = tmp_path / name
        assert train_module.run(load(DEFAULT_CONFIG, sets), run_dir) == 0
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return run_dir, {r["step"]: r["loss"] for r in records if r["kind"] == "train"}

    before = torch.get_num_threads()
    torch.set_num_threads(1)   # one intra-op thread: on a shared 2-core machine OpenMP spin-waits cost 10x
    try:
        run_dir, masked = train("masked", "data.document_mask=true")
        _, causal = train("causal", "data.document_mask=false")
    finally:
        torch.set_num_threads(before)
    assert "attention inside documents (sdpa)" in (run_dir / "logs" / "rank0.log").read_text()
    assert masked[6] < masked[1] - 0.3
    assert masked[1] != causal[1] and masked.keys() == causal.keys()


@pytest.fixture
def no_document_ids(tmp_path, short_documents) -> Path:
    """A copy of short_documents whose manifest records no BOS/EOS ids (unsealed, as one written before
    manifests had their own checksum)."""
    out = tmp_path / "no_ids"
    shutil.copytree(short_documents, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"] = {k: v for k, v in manifest["tokenizer"].items() if k not in ("bos_id", "eos_id")}
    manifest.pop("record_sha256")
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_document_mask_on_a_dataset_without_its_ids_is_one_line_before_launch(tmp_path, no_document_ids):
    proc = inv(tmp_path, "train.pretrain", "--dry-run", "--set", f"data.path={no_document_ids}",
               "--set", "data.document_mask=true", timeout=120)
    one_line_error(proc, "data.document_mask", "records no BOS/EOS ids", "data.document_mask=false")
    assert not (tmp_path / "runs").exists()


def test_document_settings_that_cannot_run_are_refused():
    """position_reset without the mask (the config's check); FlexAttention on the CPU (before launch, and
    in the trainer)."""
    with pytest.raises(ConfigError, match="data.position_reset: expected false unless data.document_mask is true"):
        load(DEFAULT_CONFIG, ["data.position_reset=true", "data.document_mask=false"])
    cfg = load(DEFAULT_CONFIG, ["train.attention=flex", "train.device=cpu"])
    with pytest.raises(UserError, match="train.attention flex needs a GPU"):
        training._needs_a_gpu_here(cfg, SimpleNamespace(has_gpu=False))
    with pytest.raises(train_module.TrainError, match="train.attention flex needs a GPU"):
        train_module.attention_kernel(cfg, torch.device("cpu"))
    assert train_module.attention_kernel(load(DEFAULT_CONFIG, []), torch.device("cpu")) == "sdpa"
