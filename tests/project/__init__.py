"""The repository as a whole, which no one part of runner/ holds: the README, the docs' commands, the architecture of
runner/'s imports, and the scripts of bench/."""
