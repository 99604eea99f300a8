"""Shared basics: file IO, statistics, metrics and component names (``L14H7``); imports nothing of mechdiff."""
