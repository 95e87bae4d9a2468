"""Run by tests/test_checkpointing.py under `accelerate launch` (configs/accelerate/cpu_2proc.yaml): a few DDP
training steps of the synchronized BN-family norms with and without gradient checkpointing, each process on its own
batches. Writes, per process, how far the checkpointed run is from the plain one and the checkpointed model's
running statistics (the test compares them across processes)."""

import copy
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs

from model import NormLabConfig, NormLabForSequenceClassification

STEPS = 3


def batch(step, rank):
    """A right-padded batch of 3 sequences, different on every process and step."""
    g = torch.Generator().manual_seed(10 * step + rank)
    lengths = torch.tensor([7, 4 + rank, 2 + step])
    attention_mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(1, 60, (3, 8), generator=g) * attention_mask
    return input_ids, attention_mask, torch.tensor([0, 1, 2])


def train(accelerator, model, checkpointed):
    """STEPS SGD steps; returns the losses, the (averaged) gradients of each step and the unwrapped model."""
    if checkpointed:
        model.activation_checkpointing_enable()  # transformers' default: non-reentrant torch.utils.checkpoint
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, grads = [], []
    for step in range(STEPS):
        input_ids, attention_mask, labels = batch(step, accelerator.process_index)
        torch.manual_seed(100 * step + accelerator.process_index)  # the same dropout masks in both runs
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        accelerator.backward(loss)
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, accelerator.unwrap_model(model)


def main(out_dir):
    # no buffer broadcast from process 0: the running statistics agree only if the norms keep them in sync
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    torch.set_num_threads(1)
    result = {}
    for norm in ("masked_batchnorm", "powernorm"):
        torch.manual_seed(0)
        config = NormLabConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=32, num_labels=3, norm=norm,
                               powernorm_warmup_steps=2)  # PowerNorm's last step normalizes with running psi^2
        base = NormLabForSequenceClassification(config)
        plain_losses, plain_grads, plain = train(accelerator, copy.deepcopy(base), False)
        ckpt_losses, ckpt_grads, ckpt = train(accelerator, copy.deepcopy(base), True)
        plain_state, ckpt_state = plain.state_dict(), ckpt.state_dict()
        result[norm] = {
            "loss_diff": max(abs(a - b) for a, b in zip(plain_losses, ckpt_losses)),
            "grad_diff": max((a - b).abs().max().item() for a, b in zip(plain_grads, ckpt_grads)),
            "state_diff": max((plain_state[k].double() - v.double()).abs().max().item()
                              for k, v in ckpt_state.items()),
            "running": {k: v.tolist() for k, v in ckpt_state.items() if "running" in k or "ema_gz" in k
                        or "num_batches_tracked" in k},
        }
    Path(out_dir, f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
