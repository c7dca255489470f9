"""Each architecture's `MultiModalProcessor`."""
