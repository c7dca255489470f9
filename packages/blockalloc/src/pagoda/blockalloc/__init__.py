"""pagoda.blockalloc package."""
