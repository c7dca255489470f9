"""pagoda.scheduler package."""
