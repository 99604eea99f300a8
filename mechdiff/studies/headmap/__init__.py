"""The headmap study kind: its study, its stages and its report."""
