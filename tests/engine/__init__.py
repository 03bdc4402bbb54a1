"""The tests of runner/engine/."""
