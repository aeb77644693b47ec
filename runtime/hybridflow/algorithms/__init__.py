"""RL algorithms for the single controller: the pure math they share (``core``) and their control flow."""
