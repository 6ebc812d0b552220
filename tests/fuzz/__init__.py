"""Helpers of tests/test_fuzz.py: host training scripts, splicing generated statements into them,
deterministic mutants (valid and invalid)."""
