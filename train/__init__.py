"""draftsmith training: the distillation recipe, losses and checkpoints."""
