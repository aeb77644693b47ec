"""Running an RLHFJob: deployment of the roles, the step loop, rewards, checkpoints and metrics."""
