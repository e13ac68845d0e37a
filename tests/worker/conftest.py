"""Worker tests use the shared fixtures of tests/conftest.py (shared_data, stories_hf)."""
