"""pagoda.pagedkernel package."""
