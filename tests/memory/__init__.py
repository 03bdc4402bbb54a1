"""The tests of runner/memory/."""
