"""--kernels with data.document_mask: the patched model (fused RMSNorm, RoPE on per-row position tables,
SwiGLU, fused loss) gives the unpatched model's loss and gradients on a row of several documents whose
positions restart per document (positions that run on take the one [T, D] table the other kernel tests
cover). One layer, 15 tokens: Triton's interpreter on the CPU is slow."""

from helpers.kernels import DEVICE, fresh_seed  # noqa: I001

import torch

import kernels
from trainer.config import ModelConfig
from trainer.models import Transformer
from trainer.sequence import Rows

BOS, EOS, VOCAB = 1, 2, 96
FUSED_TOL = dict(atol=2e-5, rtol=2e-4)   # fp32 end to end: only the order of sums differs


def test_patched_model_keeps_loss_and_grads_inside_documents():
    seed = fresh_seed()
    model = Transformer(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                    vocab_size=VOCAB)).to(DEVICE)
    gen = torch.Generator().manual_seed(seed)
    row = torch.cat([torch.cat((torch.tensor([BOS]), torch.randint(3, VOCAB, (n,), generator=gen),
                                torch.tensor([EOS]))) for n in (4, 2, 5)])
    x, y, layout = Rows((BOS, EOS), position_reset=True)(row[None, :-1].to(DEVICE), row[None, 1:].to(DEVICE))
    assert layout.documents.max() == 2 and layout.positions.max() < 7

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(x, y, layout)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_ref, grads_ref = loss_and_grads()
    kernels.patch(model)
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, loss_ref, **FUSED_TOL)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, **FUSED_TOL, msg=lambda m, n=name: f"grad {n}: {m}")
