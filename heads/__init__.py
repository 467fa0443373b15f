"""draftsmith draft families: draft LM, Medusa heads, EAGLE head, and the draft package format."""
