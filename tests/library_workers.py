"""Worker functions of the library-API tests (run in fresh gloo processes by run_local_world)."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist


def _mesh(shape, names=None):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


def _placements(spec):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in spec:
        if p == "R":
            out.append(Replicate())
        elif p.startswith("SS"):
            d, f = p[3:-1].split(",")
            out.append(_StridedShard(int(d), split_factor=int(f)))
        else:
            out.append(Shard(int(p[2:-1])))
    return out


def full_values(shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """A ``torch.arange`` per key (distinct across keys), as DCP's resharding tests use."""
    out, base = {}, 0
    for key in sorted(shapes):
        n = math.prod(shapes[key])
        out[key] = (torch.arange(n, dtype=torch.float32) + base).reshape(shapes[key])
        base += n
    return out


def save_on_mesh(rank: int, path: str, mesh_shape, specs: dict, extra_plain: bool, use_async: bool) -> None:
    """Save arange tensors as DTensors of ``specs`` ({key: (shape, placements)}) on a mesh, plus plain values."""
    from torch.distributed.tensor import distribute_tensor

    import moeckpt

    mesh = _mesh(mesh_shape)
    full = full_values({k: s for k, (s, _) in specs.items()})
    sd: dict = {
        "model": {
            k: distribute_tensor(full[k], mesh, _placements(p), src_data_rank=None) for k, (_, p) in specs.items()
        }
    }
    if extra_plain:
        sd["step"] = 7
        sd["scalar"] = torch.tensor(3.5)
        sd["optim"] = {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": sorted(specs)}]}
    if use_async:
        moeckpt.async_save(sd, path).wait()
    else:
        moeckpt.save(sd, path)


def load_on_mesh(rank: int, path: str, mesh_shape, specs: dict, out_dir: str) -> None:
    """Load into DTensors of ``specs`` on another mesh; write whether every local tensor equals the full one's."""
    from torch.distributed.tensor import distribute_tensor

    import moeckpt

    mesh = _mesh(mesh_shape)
    full = full_values({k: s for k, (s, _) in specs.items()})
    sd = {
        "model": {
            k: distribute_tensor(torch.full(full[k].shape, -1.0), mesh, _placements(p), src_data_rank=None)
            for k, (_, p) in specs.items()
        },
        "step": 0,
        "scalar": torch.tensor(0.0),
        "optim": {"param_groups": [{"lr": 0, "betas": (0, 0), "params": []}]},
    }
    stats = moeckpt.LoadStats()
    values = moeckpt.load(sd, path, stats=stats)
    ok = {}
    for k, d in sd["model"].items():
        ok[k] = bool(torch.equal(d.full_tensor(), full[k]))
    report = {
        "ok": ok,
        "step": sd["step"],
        "scalar": float(sd["scalar"]),
        "values": values,
        "lr": sd["optim"]["param_groups"][0]["lr"],
        "bytes_read": stats.bytes_read,
        "bytes_needed": stats.bytes_needed,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


# -- FSDP2 + TP training ------------------------------------------------------------------------------------------


class TinyMLP(torch.nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 24) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


def _build(dp: int, tp: int):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = TinyMLP()
    if tp > 1:
        mesh = _mesh((dp, tp), ("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=_mesh((dp,), ("dp",)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _batch(step: int, rank_in_dp: int, dp: int):
    # The global batch of a step is fixed; each dp rank takes its share, so any dp sees the same samples.
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    per = 8 // dp
    return x[rank_in_dp * per : (rank_in_dp + 1) * per]


def _train(model, opt, steps, start, dp, dp_rank):
    losses = []
    for step in range(start, start + steps):
        x = _batch(step, dp_rank, dp)
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / dist.get_world_size())
    return losses


def fsdp_train(rank: int, dp: int, tp: int, out_dir: str, path: str, mode: str) -> None:
    """``mode``: ``save`` trains steps 0-5, saving (in the background, while training goes on) after step 2;
    ``resume`` loads that checkpoint and trains steps 3-5."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import moeckpt

    model, opt = _build(dp, tp)
    dp_rank = rank // tp
    losses: list[float] = []
    if mode == "save":
        losses = _train(model, opt, 3, 0, dp, dp_rank)
        msd, osd = get_state_dict(model, opt)
        handle = moeckpt.async_save({"model": msd, "optim": osd, "step": 3}, path)
        losses += _train(model, opt, 3, 3, dp, dp_rank)  # the tensors change while the save persists
        handle.wait()
    else:
        # A first step allocates the optimizer state the load fills (as torchtitan does at resume).
        msd, osd = get_state_dict(model, opt)
        if not osd["state"]:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            saved_lr = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = 0.0
            opt.step()
            opt.zero_grad()
            for g, lr in zip(opt.param_groups, saved_lr):
                g["lr"] = lr
            msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "step": 0}
        moeckpt.load(sd, path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        losses = _train(model, opt, 3, sd["step"], dp, dp_rank)
    if rank == 0:
        with open(os.path.join(out_dir, f"{mode}-{dp}x{tp}.json"), "w") as f:
            json.dump(losses, f)


# -- torch DCP through moeckpt.dcp -------------------------------------------------------------------------------


def dcp_save_on_mesh(rank: int, path: str, mesh_shape, specs: dict, writer: str) -> None:
    """``dcp.save`` arange DTensors through ``moeckpt.dcp.StorageWriter`` (``writer="moeckpt"``) or DCP's own
    FileSystemWriter (``"dcp"``), or ``moeckpt.save`` (``"library"``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    import moeckpt
    import moeckpt.dcp

    mesh = _mesh(mesh_shape)
    full = full_values({k: s for k, (s, _) in specs.items()})
    sd = {
        "model": {
            k: distribute_tensor(full[k], mesh, _placements(p), src_data_rank=None) for k, (_, p) in specs.items()
        },
        "step": 7,
    }
    if writer == "moeckpt":
        dcp.save(sd, storage_writer=moeckpt.dcp.StorageWriter(path))
    elif writer == "dcp":
        dcp.save(sd, checkpoint_id=path)
    else:
        moeckpt.save(sd, path)


def dcp_load_on_mesh(rank: int, path: str, mesh_shape, specs: dict, out_dir: str, reader: str) -> None:
    """Load into DTensors on another mesh with ``dcp.load`` through ``moeckpt.dcp.StorageReader`` (``reader=
    "moeckpt"``) or with ``moeckpt.load`` (``"library"``); report whether every tensor equals the full one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    import moeckpt
    import moeckpt.dcp

    mesh = _mesh(mesh_shape)
    full = full_values({k: s for k, (s, _) in specs.items()})
    sd = {
        "model": {
            k: distribute_tensor(torch.full(full[k].shape, -1.0), mesh, _placements(p), src_data_rank=None)
            for k, (_, p) in specs.items()
        },
        "step": 0,
    }
    if reader == "moeckpt":
        dcp.load(sd, storage_reader=moeckpt.dcp.StorageReader(path))
    else:
        moeckpt.load(sd, path)
    ok = {k: bool(torch.equal(d.full_tensor(), full[k])) for k, d in sd["model"].items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"ok": ok, "step": sd["step"]}, f)


def save_golden_state(rank: int, path: str) -> None:
    """The state of tests/formats/test_golden_v2.py as four ranks of a 2 x 2 mesh hold it, saved with moeckpt.save."""
    from torch.distributed.tensor import distribute_tensor

    import moeckpt

    from .formats.test_golden_v2 import _full

    mesh = _mesh((2, 2))
    full = _full()
    sd = {
        "model": {
            "w": distribute_tensor(full["model.w"], mesh, _placements(["SS(0,2)", "S(0)"]), src_data_rank=None),
            "b": distribute_tensor(full["model.b"], mesh, _placements(["S(0)", "R"]), src_data_rank=None),
        },
        "optim": {"state": {"w": {"step": full["optim.state.w.step"].clone()}}},
        "step": 3,
    }
    moeckpt.save(sd, path, step=3)


def repeated_saves(rank: int, root: str, out: str) -> None:
    """Saves of one structure with changing values, then of another structure, then disagreeing ranks: each
    checkpoint must hold exactly what was saved, and a disagreement must fail every rank naming the key."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import moeckpt
    from moeckpt.formats.errors import MoeckptError

    w = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    mesh = init_device_mesh("cpu", (2,))
    # a sharded parameter that requires grad, updated in place between the saves, as a trainer's is
    d = torch.nn.Parameter(DTensor.from_local(w[2 * rank : 2 * rank + 2].clone(), mesh, [Shard(0)]))
    results: dict = {}
    for step in (1, 2):
        with torch.no_grad():
            d.to_local().copy_(w[2 * rank : 2 * rank + 2] * 10 * step)
        sd = {"w": w * step, "d": d, "step": step, "opt": {"lr": 0.1 * step}}
        moeckpt.save(sd, os.path.join(root, f"a{step}"), step=step)
    # the same structure once more, and then a new tensor: the plan must follow the state dict, not a cache
    moeckpt.save({"w": w, "b": torch.ones(3), "step": 3}, os.path.join(root, "b"), step=3)
    for name, sd in {
        "value": {"w": w, "step": rank},  # a value that differs between ranks
        "kind": {"w": w, "x": (torch.zeros(2) if rank == 0 else 5)},  # a tensor on one rank, a value on another
    }.items():
        try:
            moeckpt.save(sd, os.path.join(root, f"bad-{name}"))
            results[name] = None
        except MoeckptError as e:
            results[name] = [type(e).__name__, str(e)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
