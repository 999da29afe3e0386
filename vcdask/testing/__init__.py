"""Test helpers for vcdask and for authors of vcdask backends (imports pytest)."""
