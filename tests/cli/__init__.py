"""Tests of the command line (moeckpt.cli): its reference doc, its options and its answers to bad input."""
