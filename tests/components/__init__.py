"""The tests of runner/components/."""
