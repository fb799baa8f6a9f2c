"""Block fine-tuning (Block-Attention, Ma et al., ICLR 2025, sec. 3.4): data, loop, checkpoints, CLI."""
