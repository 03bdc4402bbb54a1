"""The tests of runner/tasks/."""
