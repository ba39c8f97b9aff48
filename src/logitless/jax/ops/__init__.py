"""jax/ops"""
