"""The tests of runner/data/."""
