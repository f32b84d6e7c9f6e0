"""The EAGLE-3 trainer (stage 04): TTT loop, checkpoints, DDP, kernels, online states, plots."""
