"""draftsmith data: target loading, ShareGPT reading, tokenization, regeneration and the feature
cache."""
