"""The tests of runner/tools/."""
