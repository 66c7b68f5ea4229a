"""Test and benchmark harnesses (not part of the training API)."""
