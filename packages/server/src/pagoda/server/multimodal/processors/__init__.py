"""The `MultiModalProcessor` of each supported vision-language architecture, over its folder's own processor."""
