"""The tests of runner/cli/."""
