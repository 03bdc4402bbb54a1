"""The tests of runner/config/."""
