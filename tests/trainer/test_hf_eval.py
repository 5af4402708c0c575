"""`moeckpt eval` and transformers agree on the loss of the same data (issue 6)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("preset,layout", [("zaya-tiny", ("2", "2", "2")), ("qwen3moe-tiny", ("1", "2", "2"))])
def test_eval_loss_equals_transformers_loss(tmp_path, moeckpt_cli, preset, layout):
    from moeckpt.trainer.data import TokenDataset, default_text_path
    from moeckpt.trainer.evaluate import EvalConfig, evaluate

    tp, ep, dp = layout
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    assert moeckpt_cli("init", ckpt, "--model", preset, "--tp", tp, "--ep", ep, "--dp", dp, "--seed", "4")[0] == 0
    assert moeckpt_cli("export-hf", ckpt, hf)[0] == 0

    seq, batch, batches = 32, 4, 2
    ours = evaluate(
        EvalConfig(checkpoint=ckpt, data=default_text_path(), seq_len=seq, batch_size=batch, batches=batches, cpu=True)
    )

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    data = TokenDataset(default_text_path(), seq_len=seq)
    losses = []
    with torch.no_grad():
        for b in range(batches):
            samples = data.get(list(range(b * batch, (b + 1) * batch)))  # seq + 1 tokens each, file order
            losses.append(float(model(input_ids=samples, labels=samples).loss))  # transformers shifts the labels
    theirs = sum(losses) / len(losses)
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
