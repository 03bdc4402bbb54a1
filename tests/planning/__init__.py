"""The tests of runner/planning/."""
