"""The tests, a package shaped like runner/'s: tests/<part>/ tests runner/<part>/, tests/test_<module>.py a module at
runner/'s top, tests/project/ the repository as a whole, and tests/support/ what they share (docs/testing.md)."""
