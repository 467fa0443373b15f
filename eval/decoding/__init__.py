"""The speculative decoding loop in one place: the decoder (batch one and batched), verification
and acceptance, the proposer interface and every family's proposer, dynamic trees, the KV cache
slots, the target wrapper, the decode statistics with the K controller and the cost model it
chooses K by.

This room imports nothing from the rest of ``draftsmith.eval`` (the evaluation tools above it:
loading drafts, sessions, measuring, sweeps, reports); they build on it.
"""
