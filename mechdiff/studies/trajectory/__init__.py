"""The trajectory study kind: its study, its stages and its report."""
