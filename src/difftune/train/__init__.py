"""Training: the objective (flow-matching math), setup (builds a Run), the loop, checkpoints,
validation and events."""
