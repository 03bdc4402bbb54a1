"""The tests of runner/strategies/."""
