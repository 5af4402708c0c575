"""torchtitan's checkpoint manager on the moeckpt format: the code docs/library.md shows, verbatim (a test checks).

Below this docstring, the module is what a torchtitan user copies: ``MoeckptCheckpointManager`` routes the
manager's ``dcp_save`` / ``dcp_load`` through ``moeckpt.dcp.StorageWriter`` / ``StorageReader`` and finds the
newest step by moeckpt's index; ``JsonDataloaderState`` keeps a torchtitan dataloader's state as JSON text where
torchtitan pickles it (moeckpt stores no pickle: a pickle in a checkpoint would run code when loaded).
"""

import json
import re
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

import moeckpt.dcp


class MoeckptCheckpointManager(CheckpointManager):
    """torchtitan's checkpoint manager, writing and reading moeckpt checkpoints (``step-N/moeckpt.json``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # torchtitan's build() makes the class that declares the Config
        pass

    @torch.no_grad()
    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if to_hf:  # the final Hugging Face export stays torchtitan's
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step = re.search(r"step-(\d+)$", checkpoint_id)  # torchtitan's folder name; the index records the step
        writer = moeckpt.dcp.StorageWriter(checkpoint_id, step=int(step.group(1)) if step else 0)
        if async_mode == AsyncMode.DISABLED:
            ret = dcp.save(state_dict, storage_writer=writer)
        elif async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        else:
            ret = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, storage_reader=moeckpt.dcp.StorageReader(checkpoint_id))
        self.states[MODEL].load_state_dict(state_dict)  # the model's keys sit flat in state_dict, as torchtitan's

    def _find_load_step(self, folder=""):
        # torchtitan takes a step folder once DCP's .metadata is in it; a moeckpt checkpoint is there once its index is
        folder = folder or self.folder
        if not filesystem.isdir(folder):
            return -1
        steps = [int(m.group(1)) for name in filesystem.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", name))]
        return max(
            (
                s
                for s in steps
                if filesystem.isfile(filesystem.join(self._create_checkpoint_id(s, folder), "moeckpt.json"))
            ),
            default=-1,
        )


class JsonDataloaderState:
    """Mixed into a torchtitan dataloader: its per-rank state as JSON text where torchtitan pickles it."""

    def state_dict(self):
        return {self._rank_id: json.dumps(StatefulDataLoader.state_dict(self)), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict):
        if self._rank_id not in state_dict:  # as torchtitan's: no state for this rank, start from the beginning
            return
        if state_dict["world_size"] != self.dp_world_size:
            raise ValueError(
                f"dataloader state saved at dp {state_dict['world_size']}, loading at dp "
                f"{self.dp_world_size}: torchtitan's dataloader does not reshard"
            )
        StatefulDataLoader.load_state_dict(self, json.loads(state_dict[self._rank_id]))
