"""draftsmith evaluation: verification, proposers, the speculative decoder, K*, sweeps and
reports."""
