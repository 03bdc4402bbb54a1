"""The tests of runner/processes/."""
