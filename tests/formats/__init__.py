"""Tests of the format layer (moeckpt.formats): backends, storages, the index, golden bytes and the format spec."""
