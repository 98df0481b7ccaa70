"""Layer 6 (above the API): one-process tools: transforms, foreign sources, inspection,
Hugging Face export."""
