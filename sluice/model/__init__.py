"""Models that the project makes itself: corpus, tokenizer, tiny transformers models, brief training.

Import the submodules directly (`sluice.model.tiny`, `sluice.model.tokenizer`); this package imports
nothing, so the tokenizer and corpus stay usable without loading torch.
"""
