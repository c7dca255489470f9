"""Images in the paged KV cache: what a processed multimodal prompt carries (`inputs`), how a model folder's own
processor makes one (`processor`), where images come from and what is refused (`media`)."""

from pagoda.server.multimodal.inputs import ImageItem, MultiModalInputs, ProcessedPrompt, content_key

__all__ = ["ImageItem", "MultiModalInputs", "ProcessedPrompt", "content_key"]
