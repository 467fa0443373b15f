"""draftsmith command-line scripts."""
