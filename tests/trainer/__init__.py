"""Tests of the trainer (moeckpt.trainer): training, optimizers, models, Hugging Face and DCP interop, memory tier."""
