"""Checking a converted folder: its integrity (headers, index, layout, checksums) and its numerics against the source."""
