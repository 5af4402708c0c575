"""The memory tier's ring of slot files: byte-identical checkpoint files written in place, reused, remapped."""

from __future__ import annotations

import os

import torch

from moeckpt.formats.backends.safetensors_write import encode
from moeckpt.formats.box import Box
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.pieces import CHECKSUM_BLOCK_BYTES, Piece
from moeckpt.trainer.memory_ring import MemoryRing

TENSORS = {
    "big": TensorEntry(
        name="big", shape=(3 * CHECKSUM_BLOCK_BYTES // 8 + 5, 2), dtype="float32", role="param", param=None
    ),
    "half": TensorEntry(name="half", shape=(6, 4), dtype="bfloat16", role="param", param=None),
    "scalar": TensorEntry(name="scalar", shape=(), dtype="int64", role="param", param=None),
    "mask": TensorEntry(name="mask", shape=(7,), dtype="bool", role="param", param=None),
}
LAYOUT = [
    ("mask", Box((0,), (7,))),  # odd-sized first: in this order the float pieces after it would not be aligned
    ("big", Box((0, 0), TENSORS["big"].shape)),
    ("half", Box((2, 0), (3, 4))),
    ("half", Box((5, 0), (0, 4))),  # an empty ZeRO part: never stored
    ("scalar", Box((), ())),
]


def _pieces(seed: int) -> list[Piece]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, box in LAYOUT:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}[
            TENSORS[name].dtype
        ]
        data = (torch.randn(box.shape, generator=g) * 100).to(dtype)
        out.append(Piece(name, box, data))
    return out


def _ring(tmp_path, **kw) -> MemoryRing:
    node = tmp_path / "node"
    node.mkdir(exist_ok=True)
    return MemoryRing(str(tmp_path / "ring"), 3, LAYOUT, TENSORS, slots=3, pin=False, node_dir=str(node), **kw)


def _commit(ring: MemoryRing, node, step: int) -> int:
    """A memory save of ``step`` into a slot of ``ring``, committed under ``node`` as the tier does; its slot."""
    k = ring.acquire(step)
    ring.finish(k, _pieces(step))
    (node / f"step-{step:08d}").mkdir()
    ring.link(k, str(node / f"step-{step:08d}"))
    ring.committed(k, step)
    return k


def _reference(pieces) -> bytes:
    """What the safetensors writer makes of ``pieces`` in the ring's file order (widest dtype first, stable)."""
    width = {"int64": 8, "float32": 4, "bfloat16": 2, "bool": 1}
    ordered = sorted(pieces, key=lambda p: -width[TENSORS[p.tensor].dtype])
    head, buffers = encode(ordered, TENSORS)
    return head + b"".join(bytes(b) for b in buffers)


def test_every_piece_is_an_aligned_view_of_the_slot_whatever_the_layout_order(tmp_path):
    """A layout whose odd-sized piece comes first: the ring lays the file out widest dtype first, so every piece's
    tensor is a view of the slot's mapping at an offset aligned to its element size (a device-to-host copy lands in
    the registered file), none a buffer of its own (a pageable copy, moved into the file later)."""
    ring = _ring(tmp_path)
    for k in range(3):
        slot = ring._slots[k]
        lo = slot.base.data_ptr()
        hi = lo + slot.base.numel()
        for (name, box), view in ring.views(k).items():
            if box.is_empty():
                continue
            assert lo <= view.data_ptr() < hi, f"{name} {box} is not in slot {k}'s mapping"
            assert view.data_ptr() % view.element_size() == 0, f"{name} {box} is not aligned"
    assert [TENSORS[t].dtype for t, _ in ring.layout] == ["int64", "float32", "bfloat16", "bool"]
    ring.close()


def test_a_slot_filled_by_the_copy_is_the_file_the_safetensors_writer_makes(tmp_path):
    ring = _ring(tmp_path)
    assert ring.stats.allocated == 3 and not ring.stats.pinned and ring.stats.unpinned_why
    for threads in (1, 4):
        k = ring.acquire(10 + threads)
        pieces = _pieces(threads)
        views = ring.views(k)
        landed = []
        for p in pieces:
            views[(p.tensor, p.box)].copy_(p.data)  # the snapshot's copy, straight into the slot
            landed.append(Piece(p.tensor, p.box, views[(p.tensor, p.box)]))
        assert ring.holds(k, landed)
        entry = ring.finish(k, landed, threads=threads)
        staging = tmp_path / f"staging{threads}"
        staging.mkdir()
        ring.link(k, str(staging))
        data = (staging / "rank-00003.safetensors").read_bytes()
        assert data == _reference(pieces) and entry.size == len(data)
    ring.close()


def test_a_piece_from_elsewhere_is_copied_in_and_the_file_is_the_same(tmp_path):
    ring = _ring(tmp_path)
    k = ring.acquire(1)
    pieces = _pieces(7)
    ring.finish(k, pieces)
    ring.link(k, str(tmp_path / "node"))
    assert (tmp_path / "node" / "rank-00003.safetensors").read_bytes() == _reference(pieces)


def test_the_ring_never_takes_a_busy_slot_and_unlinks_the_oldest_step_before_reuse(tmp_path):
    node = tmp_path / "node"
    ring = _ring(tmp_path)
    taken = [_commit(ring, node, step) for step in (1, 2, 3)]
    assert sorted(taken) == [0, 1, 2]
    assert ring.acquire(4) is None  # every slot busy (a persistent write of each still in flight)
    ring.release(taken[1])
    ring.release(taken[0])
    k = ring.acquire(4)
    assert k == taken[0]  # the oldest step's slot
    assert not (node / "step-00000001" / "rank-00003.safetensors").exists()  # step 1 unlinked before any change
    assert (node / "step-00000002" / "rank-00003.safetensors").read_bytes() == _reference(_pieces(2))


def test_a_restarted_process_maps_the_surviving_slots_and_knows_their_steps(tmp_path):
    node = tmp_path / "node"
    ring = _ring(tmp_path)
    k = ring.acquire(5)
    ring.finish(k, _pieces(5))
    (node / "step-00000005").mkdir()
    ring.link(k, str(node / "step-00000005"))
    ring.committed(k, 5)
    ring.close()
    again = _ring(tmp_path)  # the next process of the run
    assert (again.stats.remapped, again.stats.allocated) == (3, 0)
    # the slot holding step 5 is taken last; the committed file is intact until then
    order = [again.acquire(6), again.acquire(7)]
    assert k not in order
    assert (node / "step-00000005" / "rank-00003.safetensors").read_bytes() == _reference(_pieces(5))
    # another layout (a new world) replaces the files by a rename: the committed step keeps its bytes
    other = MemoryRing(
        str(tmp_path / "ring"), 3, LAYOUT[:2], TENSORS, slots=3, pin=False, node_dir=str(tmp_path / "elsewhere")
    )
    assert other.stats.allocated == 3
    assert (node / "step-00000005" / "rank-00003.safetensors").read_bytes() == _reference(_pieces(5))
    assert sorted(os.listdir(tmp_path / "ring")) == [f"slot-{i}.safetensors" for i in range(3)]


def test_the_trainers_memory_checkpoint_files_are_its_ring_slots_and_a_restart_remaps_them(tmp_path, monkeypatch):
    from moeckpt.trainer import memory_tier
    from moeckpt.trainer.train import TrainConfig, Trainer
    from tests.train_workers import memory_run

    monkeypatch.setenv(memory_tier.RING_ENV, "1")
    base = {"model": "zaya-tiny", "steps": 6, "seq_len": 32, "global_batch": 4, "warmup_steps": 2, "cpu": True}
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), memory_tier=True, memory_dir=str(tmp_path / "shm"), **base)
    memory_run(0, cfg.to_json(), 3, (1,), (2, 3))
    root = memory_tier.run_root(str(tmp_path / "shm"), memory_tier.run_id(cfg.run_dir, create=False))
    node = memory_tier.node_name()
    slots = {
        os.stat(os.path.join(root, f"{node}.ring", "rank-00000", n)).st_ino
        for n in os.listdir(os.path.join(root, f"{node}.ring", "rank-00000"))
    }
    for step in (2, 3):
        f = os.path.join(root, node, f"step-{step:08d}", "rank-00000.safetensors")
        assert os.stat(f).st_ino in slots and os.stat(f).st_nlink == 2  # the slot itself, no copy
    trainer = Trainer(cfg)  # a restart: the ring is mapped from the surviving files, the resume reads the slots
    try:
        ring = trainer.memory.ring
        assert (ring.stats.remapped, ring.stats.allocated) == (3, 0)
        assert (trainer.resume_tier, trainer.step) == ("memory", 3)
    finally:
        trainer.close()


def test_a_flipped_byte_in_a_ring_slot_and_a_short_slot_are_never_loaded(tmp_path, caplog):
    """The memory checkpoint's file is its ring slot (one inode): one byte flipped in the slot file fails the
    checksum and the resume takes the older memory step, saying so; that step's slot cut short is caught by its
    size and the resume falls back to storage, saying so. Neither copy is loaded."""
    import logging

    from moeckpt.trainer import memory_tier
    from moeckpt.trainer.metrics import read_metrics
    from moeckpt.trainer.train import TrainConfig, Trainer
    from tests.train_workers import memory_run

    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"),
        memory_tier=True,
        memory_dir=str(tmp_path / "shm"),
        model="zaya-tiny",
        steps=6,
        seq_len=32,
        global_batch=4,
        warmup_steps=2,
        cpu=True,
    )
    memory_run(0, cfg.to_json(), 3, (1,), (2, 3))  # storage: step 1; memory: steps 2 and 3, in two slots
    root = memory_tier.run_root(str(tmp_path / "shm"), memory_tier.run_id(cfg.run_dir, create=False))
    node = os.path.join(root, memory_tier.node_name())
    ring = os.path.join(root, f"{memory_tier.node_name()}.ring", "rank-00000")

    def slot_of(step: int) -> str:
        link = os.path.join(node, f"step-{step:08d}", "rank-00000.safetensors")
        (slot,) = [
            os.path.join(ring, n)
            for n in os.listdir(ring)
            if os.stat(os.path.join(ring, n)).st_ino == os.stat(link).st_ino
        ]
        return slot

    def resume() -> tuple[str | None, int]:
        trainer = Trainer(cfg)
        try:
            return trainer.resume_tier, trainer.step
        finally:
            trainer.close()
            if trainer.memory is not None and trainer.memory.ring is not None:
                trainer.memory.ring.close()  # unmapped before a slot file is cut short below

    def damaged() -> list[tuple[str, int]]:
        events = read_metrics(cfg.run_dir, events=True)
        return [(e["tier"], e["step"]) for e in events if e.get("event") == "damaged_checkpoint"]

    caplog.set_level(logging.WARNING, logger="moeckpt")
    slot3, slot2 = slot_of(3), slot_of(2)
    with open(slot3, "r+b") as f:  # one byte of the data, in the slot file itself
        f.seek(os.path.getsize(slot3) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    assert resume() == ("memory", 2)
    assert damaged() == [("memory", 3)]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "memory checkpoint of step 3" in said and "rejected" in said
    assert "resuming from memory step 2" in said

    caplog.clear()
    with open(slot2, "r+b") as f:  # the slot of step 2 cut short
        f.truncate(os.path.getsize(slot2) // 2)
    assert resume() == ("storage", 1)
    assert damaged() == [("memory", 3), ("memory", 2)]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "memory checkpoint of step 2" in said and "the index says" in said
    assert "resuming from storage" in said


def test_slots_are_registered_in_the_order_saves_take_them(tmp_path, monkeypatch):
    """A restarted process registers its slots in a thread while the model loads: the free slot first, then the
    one holding the oldest step, so the first save after the restart finds its slot pinned; each save records
    whether its own slot was."""
    node = tmp_path / "node"
    ring = _ring(tmp_path)
    for step in (5, 6):
        ring.release(_commit(ring, node, step))
    ring.close()
    again = _ring(tmp_path)
    by_step = {again._slots[k].step: k for k in range(3)}
    registered: list[int] = []

    populated = _can_populate()
    assert all(_resident(s.base) < again.size // 2 for s in again._slots)  # mapped, not yet faulted in

    class Runtime:
        def cudaHostRegister(self, ptr, size, flags):
            registered.append(next(k for k, s in enumerate(again._slots) if s.base.data_ptr() == ptr))
            assert not again.slot_pinned(registered[-1])
            if populated:  # its page tables filled before the driver is asked (off the driver's lock)
                assert _resident(again._slots[registered[-1]].base) >= again.size - 4096
            return 0

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    again._pin(True)
    assert registered == [by_step[None], by_step[5], by_step[6]]
    assert again.stats.pinned and all(again.slot_pinned(k) for k in range(3))
    assert again.acquire(7) == by_step[None] and again.acquire(8) == by_step[5]
    again.close()


def _resident(base: torch.Tensor) -> int:
    """Bytes of the mapping that starts at ``base`` present in this process's page tables (/proc/self/smaps)."""
    start = base.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, _, _hi = head.partition("-")
                inside = int(lo, 16) <= start < int(_hi, 16)
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    return 0


def _can_populate() -> bool:
    import mmap

    from moeckpt.trainer.memory_ring import _MADV_POPULATE_WRITE

    m = mmap.mmap(-1, 4096)
    try:
        m.madvise(_MADV_POPULATE_WRITE)
        return True
    except OSError:
        return False
    finally:
        m.close()
