"""The tests of runner/generation/."""
