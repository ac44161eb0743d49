"""The machinery beside the six stage files, which a first reading can skip (README, "Files")."""
