"""KV cache tiers below the GPU (issue #39): the disk tier (`disk`)."""
