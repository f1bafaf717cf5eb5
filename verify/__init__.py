"""Checks: a download before converting (`sha_check`), a converted model's integrity (`model_check`),
fixed-prompt baselines compared across quant versions (`smoke`)."""
