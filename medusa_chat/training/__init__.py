"""Self-distillation, head training and tree fitting."""
