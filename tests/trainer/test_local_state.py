"""The trainer's local state, what every save snapshots: views made once, yet always the live values."""

from __future__ import annotations

import torch

from moeckpt.reshard.local import join_local
from moeckpt.trainer.train import TrainConfig, Trainer


def _fresh(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The local state made from scratch, as before the views were kept."""
    out = {name: p.detach() for name, p in trainer.model.named_parameters()}
    by_name: dict = {}
    for piece in trainer.optimizer.pieces():
        by_name.setdefault(piece.name, {})[piece.box] = piece.tensor
    for name, entry in trainer.tensors.items():
        if entry.role != "param":
            out[name] = join_local(entry, trainer.groups.layout, trainer.rank, by_name.get(name, {}))
    return out


def test_the_kept_views_follow_every_step_and_a_rollback(tmp_path):
    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"), model="zaya-tiny", steps=3, seq_len=32, global_batch=2, warmup_steps=1, cpu=True
    )
    trainer = Trainer(cfg)
    try:
        first = {k: v.clone() for k, v in trainer.local_state().items()}
        trainer.train_step()
        trainer.save()
        trainer.checkpoints.wait()
        trainer.train_step()
        now, fresh = trainer.local_state(), _fresh(trainer)
        assert set(now) == set(fresh) == set(trainer.tensors)
        for name in now:
            assert torch.equal(now[name], fresh[name]), name
        moved = [n for n in now if not torch.equal(now[n], first[n])]
        assert any(n.startswith("exp_avg/") for n in moved) and any("/" not in n for n in moved)
        trainer.roll_back(float("nan"))  # the checkpoint of step 1 loaded into the same buffers
        now, fresh = trainer.local_state(), _fresh(trainer)
        for name in now:
            assert torch.equal(now[name], fresh[name]), name
        assert trainer.step == 1
    finally:
        trainer.close()
