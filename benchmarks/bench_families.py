"""A DeepSeek-V3-shaped checkpoint of realistic size through import-hf, reshard and export-hf (issue 31's target).

1. **source**: a DeepSeek-V3 Hugging Face directory (``config.json`` and sharded safetensors in the layout
   transformers itself holds the model in, random bf16 values), the tensors and shapes taken from transformers'
   own ``DeepseekV3ForCausalLM`` built on the meta device, so no byte of the model is held at once;
2. per repetition, each step with the page cache dropped first and timed as a child process, its peak RSS read
   from ``wait4`` (the largest of it and the children it waited for):
   * ``moeckpt import-hf SRC CK1 --tp 1 --ep 2 --dp 4 --dtype bf16`` (parameters, fp32 masters and fresh AdamW
     moments: the training state, ~7x the bf16 bytes);
   * ``moeckpt reshard CK1 CK2 --tp 2 --ep 4 --dp 4`` (a TP split and an EP change of every tensor);
   * ``moeckpt export-hf CK2 OUT``;
   each beside ``cp -r`` of what the step writes (the same bytes, read cold and written, then ``sync``: moeckpt
   fsyncs what it writes), so each ratio is moeckpt's time over cp's for the same bytes;
3. ``moeckpt export-hf --help``, cold: the fixed cost in the export's time (the interpreter importing torch and the
   command) before it reads a byte;
4. the exported tensors are compared with the source's, bit for bit (first repetition), tensor by tensor.

Writes ``families_dsv3.json`` and ``families_dsv3.png`` to ``--out``. The disk holds the source, two
checkpoints, the export and one copy at a time: about 3.3x the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def dsv3_config(layers: int, hidden: int, experts: int, moe_inter: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=moe_inter,
        num_hidden_layers=layers,
        first_k_dense_replace=1,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=1024,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def per_expert(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """transformers 5 holds the routed experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``); checkpoints on the Hub, and what users convert, keep one matrix per expert and projection."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = (shape[1] // 2, shape[2])
                out[f"{base}{e}.up_proj.weight"] = (shape[1] // 2, shape[2])
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(shape[0]):
                out[f"{base}{e}.down_proj.weight"] = (shape[1], shape[2])
        else:
            out[name] = shape
    return out


def write_source(path: str, config, shard_bytes: int) -> dict:
    """The HF directory: config.json, shards of about ``shard_bytes`` and their index, one tensor made at a time."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = per_expert({n: tuple(t.shape) for n, t in model.state_dict().items()})
    del model
    config.torch_dtype = "bfloat16"
    config.to_json_file(os.path.join(path, "config.json"))
    gen = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    held = 0
    for name, shape in shapes.items():
        n = 2 * int(torch.Size(shape).numel())
        if groups[-1] and held + n > shard_bytes:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += n
    weight_map, total = {}, 0
    for k, names in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            t = torch.randn(shapes[name], generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = file
            total += t.numel() * 2
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return {"tensors": len(shapes), "bytes": total, "shards": len(groups), "largest_tensor_bytes": max(
        2 * int(torch.Size(s).numel()) for s in shapes.values())}  # fmt: skip


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


#: runs its arguments as a child and writes that child's peak RSS (KiB, from wait4) to the file named first. A
#: child's peak RSS counts its parent's high-water mark at the exec (Linux keeps the old address space's), so the
#: command must be forked by this small process, not by the benchmark that held the source's tensors.
PEAK_WRAPPER = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); _, s, r = os.wait4(p.pid, 0); "
    "open(sys.argv[1], 'w').write(str(r.ru_maxrss)); sys.exit(os.waitstatus_to_exitcode(s))"
)


def timed(cmd: list[str], settle: float) -> dict:
    """Run ``cmd`` with a cold page cache: wall seconds, CPU seconds and peak RSS (bytes) of it and its children."""
    dropped = drop_caches()
    time.sleep(settle)
    peak_file = f"/tmp/bench_families_peak_{os.getpid()}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", PEAK_WRAPPER, peak_file, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out = proc.stdout.read() if proc.stdout else b""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}):\n{out.decode(errors='replace')[-3000:]}")
    return {
        "s": round(wall, 3),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_bytes": int(open(peak_file).read()) * 1024,
        "cache_dropped": dropped,
    }


def copy_reference(src: str, work: str, settle: float) -> dict:
    """``cp -r`` of ``src`` then ``sync``, cold: the time the same bytes take to be read and written."""
    dst = os.path.join(work, "copy")
    shutil.rmtree(dst, ignore_errors=True)
    row = timed(["bash", "-c", f"cp -r '{src}' '{dst}' && sync"], settle)
    shutil.rmtree(dst, ignore_errors=True)
    return row


def same_tensors(a_dir: str, b_dir: str) -> tuple[bool, int]:
    """Whether every tensor of ``a_dir`` is in ``b_dir`` with the same bits (one tensor in memory at a time)."""
    from safetensors import safe_open

    def where(d: str) -> dict[str, str]:
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            return json.load(f)["weight_map"]

    wa, wb = where(a_dir), where(b_dir)
    if set(wa) != set(wb):
        return False, 0
    checked = 0
    for name in sorted(wa):
        with safe_open(os.path.join(a_dir, wa[name]), "pt") as fa, safe_open(os.path.join(b_dir, wb[name]), "pt") as fb:
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
            if (
                ta.shape != tb.shape
                or ta.dtype != tb.dtype
                or not torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))
            ):
                return False, checked
        checked += 1
    return True, checked


def moeckpt(*args: str) -> list[str]:
    return [sys.executable, "-m", "moeckpt.cli.main", *args]


STEPS = (
    ("import-hf", lambda w: moeckpt("import-hf", w["src"], w["ck1"], "--tp", "1", "--ep", "2", "--dp", "4",
                                    "--dtype", "bf16", "--overwrite"), "ck1"),
    ("reshard", lambda w: moeckpt("reshard", w["ck1"], w["ck2"], "--tp", "2", "--ep", "4", "--dp", "4",
                                  "--overwrite"), "ck2"),
    ("export-hf", lambda w: moeckpt("export-hf", w["ck2"], w["out"], "--overwrite"), "out"),
)  # fmt: skip


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = data["reps"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (step, _, _) in enumerate(STEPS):
        ours = [r[step]["moeckpt"]["s"] for r in reps]
        cps = [r[step]["cp"]["s"] for r in reps]
        xs = [i * 3 + j * 0.8 / max(1, len(reps)) for j in range(len(reps))]
        width = 0.7 / max(1, len(reps))
        ax.bar(xs, ours, width=width, color="tab:blue", label="moeckpt" if not i else None)
        ax.bar([x + 1.1 for x in xs], cps, width=width, color="tab:gray", label="cp -r + sync" if not i else None)
    ax.set_xticks([i * 3 + 0.9 for i in range(len(STEPS))], [s for s, _, _ in STEPS])
    ax.set_ylabel("seconds (each repetition)")
    gb = data["checkpoint_bytes"] / 1e9
    ax.set_title(f"DeepSeek-V3-shaped, {gb:.1f} GB training state ({data['where']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="scratch directory on the disk measured")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "benchmarks"))
    ap.add_argument("--layers", type=int, default=5, help="decoder layers (the first dense, the rest MoE)")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds of quiet after each page-cache drop")
    ap.add_argument("--where", default=platform.node())
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    w = {k: os.path.join(args.work, k) for k in ("src", "ck1", "ck2", "out")}
    config = dsv3_config(args.layers, args.hidden, args.experts, args.moe_intermediate)
    print(f"[{now()}] source", flush=True)
    shutil.rmtree(w["src"], ignore_errors=True)
    t0 = time.perf_counter()
    source = write_source(w["src"], config, 2 << 30)
    source["write_s"] = round(time.perf_counter() - t0, 1)
    print(f"  {source}", flush=True)
    data: dict = {
        "started": now(),
        "argv": sys.argv,
        "where": args.where,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "config": {k: getattr(config, k) for k in ("num_hidden_layers", "hidden_size", "n_routed_experts",
                                                     "moe_intermediate_size", "kv_lora_rank", "q_lora_rank")},
        "source": source,
        "reps": [],
    }  # fmt: skip
    for rep in range(args.reps):
        row: dict = {}
        for step, cmd, made in STEPS:
            ours = timed(cmd(w), args.settle)
            ours["bytes_written"] = dir_bytes(w[made])
            ref = copy_reference(w[made], args.work, args.settle)
            row[step] = {"moeckpt": ours, "cp": ref, "ratio": round(ours["s"] / ref["s"], 3)}
            print(
                f"  rep {rep + 1} {step:9s} {ours['s']:7.2f} s (cpu {ours['cpu_s']:6.1f}, peak RSS "
                f"{ours['peak_rss_bytes'] / 1e9:.2f} GB, {ours['bytes_written'] / 1e9:.2f} GB written), cp -r "
                f"{ref['s']:6.2f} s: {row[step]['ratio']:.3f}x",
                flush=True,
            )
        # The export's fixed cost, timed the same way (cold): the interpreter importing torch and the command,
        # before a byte of the checkpoint is read.
        row["startup"] = timed(moeckpt("export-hf", "--help"), args.settle)
        print(f"  rep {rep + 1} startup   {row['startup']['s']:7.2f} s (moeckpt export-hf --help, cold)", flush=True)
        if rep == 0:
            equal, checked = same_tensors(w["src"], w["out"])
            row["export_equals_source"] = {"equal": equal, "tensors": checked}
            print(f"  export equals the source bit for bit: {equal} ({checked} tensors)", flush=True)
        data["reps"].append(row)
        for k in ("ck1", "ck2", "out"):
            shutil.rmtree(w[k], ignore_errors=True)
    data["checkpoint_bytes"] = data["reps"][0]["import-hf"]["moeckpt"]["bytes_written"]
    data["finished"] = now()
    data["summary"] = {
        step: {
            "ratio_per_rep": [r[step]["ratio"] for r in data["reps"]],
            "peak_rss_gb_per_rep": [round(r[step]["moeckpt"]["peak_rss_bytes"] / 1e9, 3) for r in data["reps"]],
            "target_1_5x_every_rep": all(r[step]["ratio"] <= 1.5 for r in data["reps"]),
        }
        for step, _, _ in STEPS
    }
    data["summary"]["startup_s_per_rep"] = [r["startup"]["s"] for r in data["reps"]]
    with open(os.path.join(args.out, "families_dsv3.json"), "w") as f:
        json.dump(data, f, indent=1)
    plot(data, os.path.join(args.out, "families_dsv3.png"))
    print(json.dumps(data["summary"], indent=1))


if __name__ == "__main__":
    main()
