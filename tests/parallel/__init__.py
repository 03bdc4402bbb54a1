"""The tests of runner/parallel/."""
