"""Tests of the repository's own rules: the import layers, module shape, the architecture doc, benchmark scripts."""
