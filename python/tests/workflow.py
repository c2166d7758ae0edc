"""The training workflow of the tests: a small model whose parameters are DTensors (any mesh,
Shard / Replicate, uneven), trained with AdamW, checkpointed with zarrckpt.torch.

The forward pass gathers each parameter (``full_tensor()``) and every rank computes the same
full-batch loss, so gradients and the (elementwise) AdamW update do not depend on how the
parameters are sharded: a run resumed on another number of ranks with another sharding must
match a run that never stopped bit for bit.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

IN, HIDDEN, OUT, BATCH = 10, 37, 6, 8

# Gathering a parameter sharded twice over a 2-D mesh takes two all-gathers (exact, as
# gathers are); DTensor warns about it on every step.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

# Placements per parameter: 4 ranks on a 2 x 2 mesh, and 3 ranks on a 1-D mesh.
PLACEMENTS = {
    4: {
        "w1": [Shard(0), Shard(1)],
        "b1": [Replicate(), Shard(0)],
        "w2": [Shard(1), Replicate()],
        "b2": [Shard(0), Shard(0)],
        "norm": [Replicate(), Replicate()],
    },
    3: {
        "w1": [Shard(1)],
        "b1": [Shard(0)],
        "w2": [Shard(0)],
        "b2": [Replicate()],
        "norm": [Replicate()],
    },
}
MESH = {4: (2, 2), 3: (3,)}


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


class Net(nn.Module):
    def __init__(self, world: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        init = {
            "w1": torch.randn(HIDDEN, IN, generator=g) / IN**0.5,
            "b1": torch.randn(HIDDEN, generator=g) * 0.1,
            "w2": torch.randn(OUT, HIDDEN, generator=g) / HIDDEN**0.5,
            "b2": torch.zeros(OUT),
            "norm": torch.ones(HIDDEN),
        }
        mesh = init_device_mesh("cpu", MESH[world])
        for name, value in init.items():
            setattr(
                self, name, nn.Parameter(distribute_tensor(value, mesh, PLACEMENTS[world][name]))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ full(self.w1).T + full(self.b1)) * full(self.norm)
        return h @ full(self.w2).T + full(self.b2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def train_step(model: Net, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def make(world: int, seed: int) -> tuple[Net, torch.optim.Optimizer]:
    model = Net(world, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
    return model, opt


def full_state(model: Net, opt: torch.optim.Optimizer) -> dict[str, list]:
    """Every parameter and optimizer state tensor, gathered, as lists of float bit patterns."""
    out = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out[n] = full(p.detach()).view(torch.int32).flatten().tolist()
    for p, st in opt.state.items():
        for k, v in st.items():
            t = full(v.detach()) if isinstance(v, torch.Tensor) else torch.tensor(v)
            out[f"{names[id(p)]}.{k}"] = t.float().view(torch.int32).flatten().tolist()
    return out
